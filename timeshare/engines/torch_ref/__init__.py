"""The reference engines: a GRPO trainer and a rollout over a small causal LM in plain PyTorch.

    spec.py        its settings (`TorchRefSpec`) and config check: torch-free, the config embeds
                   them
    model.py       the Llama-style model; trainer.py, rollout.py the two engines
    checkpoint.py  atomic checkpoints and the committed step

The task and GRPO are every engine's (engines/task.py, engines/grpo.py). Import from the
modules: this package imports nothing, so that reading a config (which imports spec.py) does not
load torch.
"""
