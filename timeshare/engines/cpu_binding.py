"""Which cores each tensor-parallel worker of an engine's CPU build binds its threads to.

vLLM's and SGLang's CPU engines bind each TP worker's OpenMP threads from a variable of their
own (`VLLM_CPU_OMP_THREADS_BIND`, `SGLANG_CPU_OMP_THREADS_BIND`: "0,1|2,3", one group of cores
per worker). Left unset, both give each worker a NUMA node of its own and assert there are
enough of them, so tensor parallelism on a machine with one NUMA node (this VM, most cloud VMs)
fails at start-up. When the user has not set it, the engine splits the cores this process may
run on (its CPU affinity, which a cgroup or `taskset` narrows) into one group per worker. One
worker keeps the engine's own default. No engine and no torch here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def core_groups(cores: Sequence[int], workers: int) -> list[list[int]]:
    """`cores` split into `workers` contiguous groups, as even as they go; with fewer cores
    than workers, each worker gets one core, shared round robin."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if not cores:
        raise ValueError("no cores to bind to")
    ordered = sorted(cores)
    if len(ordered) < workers:
        return [[ordered[k % len(ordered)]] for k in range(workers)]
    base, extra = divmod(len(ordered), workers)
    groups, start = [], 0
    for k in range(workers):
        size = base + (k < extra)
        groups.append(ordered[start : start + size])
        start += size
    return groups


def binding_environment(
    variable: str, workers: int, cores: Sequence[int], environ: Mapping[str, str]
) -> dict[str, str]:
    """What to add to the environment an engine's workers start with: nothing for one worker
    or when the user chose a binding; else `variable` with one group of cores per worker."""
    if workers == 1 or variable in environ:
        return {}
    groups = core_groups(cores, workers)
    return {variable: "|".join(",".join(str(core) for core in group) for group in groups)}
