"""A two-node job on a starved machine: every process of both nodes held to a fraction of one
CPU (a cgroup's quota, as a loaded box or a noisy VM would), so that stretches of work which
report no progress last longer than the stall timeout. Slow is not stalled: the job completes,
with the same weights on both nodes. It was starved: a thread of the job waited for a CPU, in
all, longer than the stall timeout, and a quota held the job back as long (where the machine
cannot starve it, the test is skipped naming why)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.configs import TINY
from tests.daemon.test_run import steps_of
from tests.nodes.cluster import assert_nodes_left_nothing, node_configs, running_nodes
from tests.ports import free_port
from tests.starving import cpu_starved

STEPS = 2
STALL_S = TINY["deadlines"]["stall_s"]
CHANNEL_WAITS = ("ack", "finalize", "handshake", "begin")


@pytest.mark.slow
@pytest.mark.alone  # held to a share of a CPU: beside other tests it would get less still
def test_a_two_node_job_starved_of_cpu_completes(runtime_dir: Path) -> None:
    root = runtime_dir
    configs = node_configs(
        root,
        TINY,
        free_port(),
        job={"ranks": 4, "steps": STEPS},
        # The stall timeout as it is (10 s): the rollout's first wake alone is 2 s of CPU
        # (torch imports its compiler), which starved takes 20 s. The deadlines that do bound
        # a starved job (a phase, the start, the weight channel's waits) ample.
        deadlines={"phase_s": 300.0, "ready_s": 300.0, "node_s": 60.0},
        transfer={f"{wait}_timeout_s": 120.0 for wait in CHANNEL_WAITS},
    )
    with (
        running_nodes(configs) as runs,
        cpu_starved([r.process.pid for r in runs], 0.4) as starving,
    ):
        outcomes = [run.wait(timeout=600) for run in runs]
    for node, (code, out) in enumerate(outcomes):
        assert code == 0, f"node {node} ({starving}): {out}"
    # It was starved, by the quota and not only by a busy machine: a thread of the job waited
    # for a CPU longer in all than the stall timeout, the quota holding the job back as long.
    assert starving.waited_s > STALL_S, starving
    assert starving.throttled_s is None or starving.throttled_s > STALL_S, starving
    summaries = [steps_of(run.summary) for run in runs]
    for first, second in zip(*summaries, strict=True):
        assert first["weights_match"] and second["weights_match"], first["step"]
        assert first["weights_digest"] == second["weights_digest"], first["step"]
    assert [s["step"] for s in summaries[0]] == list(range(1, STEPS + 1))
    assert_nodes_left_nothing(root)
