"""SGLang as a rollout engine: SGLang's `Engine` in the rollout worker, weights through
timeshare's channel into a loader that SGLang runs inside its scheduler.

    spec.py              `[engine.sglang]` (`SglangSpec`): torch-free, the config embeds it
    args.py              SGLang's own check of the server arguments, in a child, at config load
    engine.py            the rollout engine (generation, sleep) and its inlet (driving a SYNC)
    order.py             what crosses SGLang's process boundary for a SYNC: an order, an answer
    loader.py            the loader, in SGLang's scheduler: a whole version through the channel
    boot.py              first in every process of the SGLang venv (its .pth): the CPU shims
                         as their packages are imported, parent-death in SGLang's processes
    plugin.py            SGLang's entry point into timeshare (`sglang.srt.plugins`)
    cpu_shims.py         torchvision's op schemas and the `sgl_kernel` stand-in, as patches,
    sgl_kernel_standin.py  for a CPU-only torch (both absent from a GPU install)
    seeded_sampling.py   a request's seed honoured on every attention backend (a patch)
    request_stops.py     a request stops at its own stop tokens only (a patch)
    die_with_host.py     SGLang's processes die with their rollout worker (a patch)

SGLang pins packages that vLLM's CPU build pins otherwise, so it runs from a venv of its own
(the Makefile's .venv-sglang, layered on .venv). Import from the modules: this package imports
nothing, so that reading a config (which imports spec.py) does not load SGLang.
"""
