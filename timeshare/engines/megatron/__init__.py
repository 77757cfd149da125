"""The Megatron-core trainer: tensor-parallel GPT training over HF (transformers) weights."""
