"""The simulated engines: real tensors through the real weight channel, simulated device memory.

    spec.py      their settings (`SimulatedSpec`): torch-free, the config embeds them
    engines.py   the device ledger, the trainer and the rollout engine, and their builders

Import from the modules: this package imports nothing, so that reading a config (which imports
spec.py) does not load torch.
"""
