"""Which GPUs a rollout engine's processes use: those of the ranks it serves.

A trainer rank takes the device `rank % device_count` (fsdp/trainer.py, megatron/trainer.py).
A rollout engine serves a group of consecutive ranks of one node (cluster.group_leader: one rank
at TP 1, N at TP N), so its workers must run on those ranks' devices: left alone, every engine
of a node would start on the first devices, rank 1's on rank 0's GPU. SGLang takes the first
device as an argument (`base_gpu_id`); vLLM takes the devices it may see from the environment
its processes start with (`CUDA_VISIBLE_DEVICES`, narrowed here to the group's, in the terms the
user gave: indices or UUIDs). On a machine without GPUs nothing is placed. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping

from timeshare.errors import ConfigError

VISIBLE = "CUDA_VISIBLE_DEVICES"


def group_devices(leader: int, workers: int, device_count: int) -> range:
    """The device indices of the group of `workers` ranks whose first rank is `leader`."""
    if device_count < 1:
        raise ValueError(f"no devices to place on (device_count {device_count})")
    first = leader % device_count
    if first + workers > device_count:
        raise ConfigError(
            f"a rollout engine for ranks {leader}-{leader + workers - 1} needs devices "
            f"{first}-{first + workers - 1}, but this node shows {device_count}: "
            "each node's ranks must match its devices, a tensor-parallel group within them"
        )
    return range(first, first + workers)


def visible_environment(
    leader: int, workers: int, device_count: int, environ: Mapping[str, str]
) -> dict[str, str]:
    """What to add to the environment an engine's processes start with: `CUDA_VISIBLE_DEVICES`
    naming the group's devices; nothing without devices."""
    if device_count == 0:
        return {}
    devices = group_devices(leader, workers, device_count)
    given = environ.get(VISIBLE)
    names = [name.strip() for name in given.split(",")] if given else []
    if len(names) < device_count:  # (unset: devices by index)
        names = [str(index) for index in range(device_count)]
    return {VISIBLE: ",".join(names[index] for index in devices)}
