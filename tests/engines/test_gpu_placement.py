"""Which GPUs a rollout engine's processes use: its group's (gpu_placement.py). Pure: the
engines apply it on CUDA alone (vLLM through CUDA_VISIBLE_DEVICES, SGLang base_gpu_id)."""

from __future__ import annotations

import pytest

from timeshare.engines.gpu_placement import VISIBLE, group_devices, visible_environment
from timeshare.errors import ConfigError


@pytest.mark.parametrize(
    ("leader", "workers", "count", "devices"),
    [
        (0, 1, 8, range(0, 1)),  # TP 1: each rank's engine on the rank's own device
        (5, 1, 8, range(5, 6)),
        (2, 2, 4, range(2, 4)),  # TP 2, the second group of a node of four
        (12, 4, 8, range(4, 8)),  # node 1 of 8-GPU nodes: rank 12 is its device 4
        (0, 8, 8, range(0, 8)),
    ],
)
def test_a_group_runs_on_its_ranks_devices(
    leader: int, workers: int, count: int, devices: range
) -> None:
    assert group_devices(leader, workers, count) == devices


def test_a_group_beyond_the_nodes_devices_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"ranks 2-5 needs devices 2-5, but this node shows 4"):
        group_devices(2, 4, 4)


def test_the_environment_names_the_groups_devices_as_the_user_named_them() -> None:
    assert visible_environment(2, 2, 4, {}) == {VISIBLE: "2,3"}
    # The node's own list (indices or UUIDs) narrowed to the group's share of it.
    assert visible_environment(2, 2, 4, {VISIBLE: "4,5,6,7"}) == {VISIBLE: "6,7"}
    uuids = "GPU-a, GPU-b"
    assert visible_environment(1, 1, 2, {VISIBLE: uuids}) == {VISIBLE: "GPU-b"}


def test_without_devices_nothing_is_placed() -> None:
    assert visible_environment(3, 2, 0, {VISIBLE: "0,1"}) == {}
