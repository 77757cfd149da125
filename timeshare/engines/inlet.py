"""Where a rollout engine's weights come in: the receiving end of the weight channel for one rank.

Most engines receive in their own worker process: a `WeightReceiver` there feeds each bucket to
the engine's `load_weights`, and `finish_weight_update` runs once the transfer is FINALIZED
(`LocalInlet`). An engine that loads weights in processes of its own (vLLM's workers) receives
there instead and gives the rollout worker an inlet that drives those processes
(engines/vllm/engine.py). Either way one `receive` is one whole version, within the channel's
deadlines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from timeshare.protocols.weights import TransferConfig, TransferReport, WeightReceiver


class WeightInlet(Protocol):
    def receive(self, progress: Callable[[], None]) -> TransferReport:
        """One whole weight version, loaded and post-processed; `progress` after each bucket."""
        ...

    def close(self) -> None: ...


class WeightLoader(Protocol):
    """What a `LocalInlet` loads into: a rollout engine that loads in its worker process (its
    `open_inlet` returns `LocalInlet(self, ...)`). The inlet marks the version whole
    (`RolloutEngine.mark_whole`) once `finish_weight_update` returned."""

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket (tensors are views of staging: copy what is kept)."""

    def finish_weight_update(self, version: int) -> None:
        """After the last bucket: post-load processing, and a refusal of a version that did
        not arrive whole (a weight missing)."""

    def mark_whole(self, version: int) -> None: ...


class LocalInlet:
    """A receiver in this process, loading into `engine` bucket by bucket."""

    def __init__(self, engine: WeightLoader, endpoint: str, transfer: TransferConfig) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.transfer = transfer
        self.receiver = WeightReceiver(endpoint, transfer)

    def receive(self, progress: Callable[[], None]) -> TransferReport:
        if self.receiver.closed:
            # A failed transfer ended its session and closed its receiver: the next transfer is
            # a new session, taken by a new receiver (as vLLM's backend does, vllm/backend.py).
            self.receiver = WeightReceiver(self.endpoint, self.transfer)

        def load(named: list[tuple[str, torch.Tensor]]) -> None:
            self.engine.load_weights(named)
            progress()

        report = self.receiver.receive(load)  # within the config's begin_timeout_s
        self.engine.finish_weight_update(report.version)
        self.engine.mark_whole(report.version)
        return report

    def close(self) -> None:
        self.receiver.close()
