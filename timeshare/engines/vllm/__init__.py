"""vLLM as a rollout engine: vLLM's `LLM` in the rollout worker, weights through vLLM's own
weight-transfer API into a timeshare backend inside vLLM's workers.

    spec.py      `[engine.vllm]` (`VllmSpec`): torch-free, the config embeds it
    args.py      vLLM's own check of the engine arguments, in a child process, at config load
    engine.py    the rollout engine (generation, sleep) and its inlet (driving a SYNC)
    backend.py   the weight-transfer backend, in vLLM's worker processes; report.py what it
                 tells the rollout worker
    plugin.py    vLLM's entry point into timeshare, in every process vLLM starts

Import from the modules: this package imports nothing, so that reading a config (which imports
spec.py) does not load vLLM.
"""
