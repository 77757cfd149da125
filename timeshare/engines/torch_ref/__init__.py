"""The reference engine pair: GRPO on a small causal LM in plain PyTorch (CPU or GPU).

    spec.py        its settings (`TorchRefSpec`, `ModelConfig`): torch-free, the config embeds them
    model.py       the Llama-style model; trainer.py, rollout.py the two engines; grpo.py the loss
    task.py        the verifiable task (vocab.py: its tokens); checkpoint.py atomic checkpoints

Import from the modules: this package imports nothing, so that reading a config (which imports
spec.py) does not load torch.
"""
