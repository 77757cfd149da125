"""Per-step figures of a run, built from the driver's phase records (the `--summary` JSON).

Step n is TRAIN n (on the samples of weight version n-1), OFFLOAD, SYNC of version n, BARRIER,
RESUME and the ROLLOUT that samples version n for step n+1. For each step: the wall time of each
phase (slowest rank) and per rank, the reward of the samples trained on, the sync's bytes and
rate, whether every rollout holds exactly the trainer's weights, the largest difference between
trainer and rollout logprobs of the sampled tokens, and the bubble: the part of a rank's step
spent in no engine call and no transfer (fence waits and orchestration), averaged over ranks.

A run killed after TRAIN k was committed but before step k ended resumes at k and runs the rest
of step k as its bootstrap; the TRAIN it does not repeat comes from the checkpoint (the entry
says `"resumed": true`), so step k still has its entry.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from timeshare.daemon.driver import BootstrapRecord, PhaseRecord
from timeshare.durable import write_atomically
from timeshare.state import Phase

PHASES = [phase.value for phase in Phase]


class StepLog:
    """Collects phase records; a step is complete when every rank has run all six phases."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._pending: dict[int, list[PhaseRecord]] = defaultdict(list)

    def resume(self, record: BootstrapRecord) -> None:
        """Step `record.step` was trained before a crash and ends in this run: seed its TRAIN
        (from the checkpoint's metrics) and OFFLOAD (done again by the bootstrap) for the rank.

        Nothing to seed at step 0, or when the engine keeps no metrics in its checkpoints.
        """
        train = record.results["trainer"].get("train")
        if not train:
            return
        now = time.monotonic()
        seconds = float(train.get("train_s", 0.0))
        resumed = {**train, "engine_s": seconds, "resumed": True}
        self._pending[record.step] += [
            PhaseRecord(
                record.step, record.rank, Phase.TRAIN, now - seconds, seconds, {"trainer": resumed}
            ),
            PhaseRecord(record.step, record.rank, Phase.OFFLOAD, now, 0.0, {"trainer": {}}),
        ]

    def add(self, record: PhaseRecord) -> dict[str, Any] | None:
        """Take one phase record; return the step's entry if this record completed the step."""
        if record.phase is Phase.TRAIN or record.step in self._pending:
            self._pending[record.step].append(record)
        records = self._pending.get(record.step, [])
        if len(records) < self.ranks * len(PHASES):
            return None
        del self._pending[record.step]
        return step_entry(record.step, records, self.ranks)


def step_entry(step: int, records: list[PhaseRecord], ranks: int) -> dict[str, Any]:
    by_rank: dict[int, dict[str, PhaseRecord]] = defaultdict(dict)
    for record in records:
        by_rank[record.rank][record.phase.value] = record
    trains = [by_rank[r]["train"].results["trainer"] for r in range(ranks)]
    syncs = [by_rank[r]["sync"].results for r in range(ranks)]
    transfer_bytes = sum(int(s["trainer"]["bytes"]) for s in syncs)
    transfer_s = max(float(s["trainer"]["seconds"]) for s in syncs)
    per_rank = [
        {"rank": r, "phases": {p: by_rank[r][p].seconds for p in PHASES}} for r in range(ranks)
    ]
    return {
        "step": step,
        "weight_version": int(syncs[0]["trainer"]["version"]),
        "sample_version": step - 1,
        "reward_mean": _mean(float(t["reward_mean"]) for t in trains),
        "phases": {p: max(by_rank[r][p].seconds for r in range(ranks)) for p in PHASES},
        "per_rank": per_rank,
        "bubble_s": _mean(_bubble(by_rank[r]) for r in range(ranks)),
        "step_s": max(_wall(by_rank[r]) for r in range(ranks)),
        "sync": {
            "bytes": transfer_bytes,
            "seconds": transfer_s,
            "gbps": transfer_bytes / transfer_s / 1e9 if transfer_s > 0 else 0.0,
        },
        "weights_match": all(s["trainer"]["digest"] == s["rollout"]["digest"] for s in syncs),
        "ranks_agree": len({s["trainer"]["digest"] for s in syncs}) == 1,
        "logprob_max_abs_diff": max(float(t["logprob_max_abs_diff"]) for t in trains),
        "committed_step": min(int(t["committed"]) for t in trains),
        "resumed": any(t.get("resumed", False) for t in trains),
    }


def _wall(phases: dict[str, PhaseRecord]) -> float:
    start = min(r.started for r in phases.values())
    return max(r.started + r.seconds for r in phases.values()) - start


def _bubble(phases: dict[str, PhaseRecord]) -> float:
    """A rank's step less the time its engines worked (each phase: the longer of the two)."""
    working = sum(
        max(float(result.get("engine_s", 0.0)) for result in record.results.values())
        for record in phases.values()
    )
    return max(_wall(phases) - working, 0.0)


def _mean(values: Any) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


class SummaryFile:
    """The `--summary` JSON, rewritten atomically after every step.

    A run resumed from committed step k keeps the steps up to k it finds there and appends from
    k+1, so no committed step appears twice and weight versions only grow.
    """

    def __init__(self, path: Path, ranks: int) -> None:
        self.path = path
        self.ranks = ranks
        self.steps: list[dict[str, Any]] = []

    def resume_from(self, committed: int) -> None:
        if self.path.exists():
            previous = json.loads(self.path.read_text())
            self.steps = [s for s in previous.get("steps", []) if s["step"] <= committed]
        self.write()

    def has(self, step: int) -> bool:
        return any(s["step"] == step for s in self.steps)

    def append(self, entry: dict[str, Any]) -> None:
        self.steps.append(entry)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"ranks": self.ranks, "steps": self.steps}, indent=1)
        write_atomically(self.path, text.encode())
