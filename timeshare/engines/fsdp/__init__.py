"""The FSDP2 trainer: a transformers causal LM sharded with fully_shard."""
