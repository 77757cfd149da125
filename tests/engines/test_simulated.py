"""The simulated engines' device ledger and the request contract every adapter keeps."""

from __future__ import annotations

import pytest
import torch

from timeshare.engines.base import (
    RolloutRequest,
    RolloutTraits,
    SamplingParams,
    refuse_unsupported,
)
from timeshare.engines.simulated.engines import (
    EVERY_INPUT,
    DeviceLedger,
    SimulatedRollout,
    SimulatedTrainer,
)
from timeshare.engines.simulated.spec import SimulatedSpec
from timeshare.errors import (
    LoaderFailed,
    PromptTooLong,
    SimulatedOOM,
    UnsupportedInput,
    WeightsTorn,
)
from timeshare.protocols.store import JobStore


@pytest.fixture
def ledger() -> DeviceLedger:
    return DeviceLedger(JobStore.host(), capacity_mb=100.0)


def test_the_ledger_refuses_what_does_not_fit_and_frees_by_owner(ledger: DeviceLedger) -> None:
    ledger.allocate(1, "trainer.params", 60)
    with pytest.raises(SimulatedOOM, match=r"device 1: rollout.kv_cache needs 50 MiB, 60 of 100"):
        ledger.allocate(1, "rollout.kv_cache", 50)
    assert ledger.used(1) == 60  # the refused allocation left nothing behind
    ledger.allocate(0, "rollout.kv_cache", 50)  # another device has its own account
    assert ledger.release(1, "trainer.params") == 60
    assert ledger.used(1) == 0 and ledger.held(1, "trainer.params") == 0


def test_a_spanning_engine_is_woken_and_slept_by_its_leader(ledger: DeviceLedger) -> None:
    spec = SimulatedSpec(engine_span=2)
    leader, follower = SimulatedRollout(0, spec, ledger), SimulatedRollout(1, spec, ledger)
    follower.wake({"weights", "kv_cache"})
    assert ledger.used(1) == 0
    leader.wake({"weights", "kv_cache"})
    assert ledger.used(0) == ledger.used(1) == 85
    leader.sleep()
    assert ledger.used(0) == ledger.used(1) == 0


def test_trainer_memory_follows_the_phases(ledger: DeviceLedger) -> None:
    trainer = SimulatedTrainer(0, SimulatedSpec(), ledger)
    trainer.train_step([])
    assert ledger.used(0) == 70
    trainer.offload()
    assert ledger.used(0) == 30
    trainer.offload_params()
    assert trainer.held_mb() == 0
    assert [t[1][0].item() for t in trainer.iter_weights()][:2] == pytest.approx([1.0, 1.001])


def test_generation_refuses_torn_weights_and_carries_the_version(ledger: DeviceLedger) -> None:
    rollout = SimulatedRollout(0, SimulatedSpec(), ledger)
    request = RolloutRequest("a", (1, 2), SamplingParams(max_tokens=3))
    with pytest.raises(WeightsTorn):
        rollout.generate([request])
    rollout.begin_weight_update()
    with pytest.raises(LoaderFailed, match="simulated rollout: no weight 'w' to load"):
        rollout.load_weights([("w", torch.ones(2))])
    rollout.load_weights([("layer0.weight", torch.ones(1024))])
    rollout.finish_weight_update(7)
    rollout.mark_whole(7)  # as its LocalInlet does
    [sample] = rollout.generate([request])
    assert (sample.weight_version, len(sample.tokens)) == (7, 3)
    rollout.begin_weight_update()
    with pytest.raises(WeightsTorn):
        rollout.generate([request])


def test_an_adapter_names_every_field_it_cannot_honour() -> None:
    request = RolloutRequest("r1", (1,), images=("png",), processor_output={"pixel_values": 1})
    assert request.fields_in_use() == {"images", "processor_output"}
    with pytest.raises(UnsupportedInput, match=r"text-only cannot honour images, processor_output"):
        refuse_unsupported(request, RolloutTraits(), "text-only")
    refuse_unsupported(
        request, RolloutTraits(inputs=frozenset({"images", "processor_output"})), "multimodal"
    )
    with pytest.raises(PromptTooLong, match=r"'r1' needs 17 tokens \(1 of prompt, 16 to gen"):
        refuse_unsupported(request, RolloutTraits(inputs=EVERY_INPUT, max_tokens=16), "short")
