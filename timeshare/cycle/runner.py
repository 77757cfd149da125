"""The cycle runner: sync decides, async acts.

One loop, three steps: `advance` the machine with what happened (state/machine.py), `plan` what
that asks for (state/plan.py), `perform` it. Performing starts phases and barrier meetings as
tasks, which report back into one inbox; what they report becomes the next event. Nothing here
decides anything about the job: a failure, a drain that is done, a pause that holds memory, the
BARRIER's rule — all are the machine's. The runner only keeps what the machine does not need:
each phase's results until the phase ends, each rank's samples until its next TRAIN.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup

from timeshare.config import Config, DeadlineSection
from timeshare.cycle.commands import watch_commands
from timeshare.cycle.hooks import BootstrapReport, CycleHooks, PhaseReport, RunSummary, Telling
from timeshare.cycle.phases import (
    blame_of,
    bootstrap,
    cycle_failed,
    held_memory,
    meet_at_barrier,
    rule_broken,
    run_phase,
)
from timeshare.cycle.workers import Workers, WorkerSpawner, spawn_workers, worker_ids
from timeshare.errors import CycleFailed, WorkerFailure
from timeshare.protocols.barrier import Barrier
from timeshare.protocols.commands.results import HeldResult, PhaseResult, RolloutResult
from timeshare.protocols.store import AsyncJobStore, JobStore
from timeshare.state import (
    MEMORY_FENCES,
    OPERATOR_EVENTS,
    BarrierChecked,
    Bootstrapped,
    Drained,
    Event,
    Failed,
    InvalidTransition,
    JobState,
    Lifecycle,
    PauseChecked,
    Phase,
    Plan,
    RankFinished,
    advance,
    initial_state,
    plan,
)

log = structlog.get_logger(__name__)

INBOX = 1000  # reports waiting for the loop: at most a phase and a meeting per rank, commands


async def run_cycle(
    config: Config,
    store: JobStore | None = None,
    *,
    hooks: CycleHooks | None = None,
    spawn: WorkerSpawner = spawn_workers,
    fences: frozenset[Phase] = MEMORY_FENCES,
) -> RunSummary:
    """Run the job until the machine stops it; raise `CycleFailed` on the first failure.

    The job store is hosted here unless the caller hosts it (`store`). `hooks` are how a front
    end watches and steers the run. `spawn` starts the workers (real processes unless a test
    passes a fake). `fences` is a test-only switch: the proof that each memory fence matters
    drops one.
    """
    job_store = AsyncJobStore(store) if store is not None else await AsyncJobStore.host()
    async with spawn(config, job_store.blocking) as workers:
        ended = await _Cycle(config, workers, job_store, hooks or CycleHooks(), fences).run()
        if isinstance(ended, RunSummary):
            await workers.shut_down(deadline_s=config.deadlines.for_command("shutdown"))
    if isinstance(ended, CycleFailed):
        raise ended
    return ended


@dataclass(frozen=True)
class _Ran:
    """Both workers of `rank` answered `phase`."""

    rank: int
    phase: Phase
    step: int
    started: float
    results: dict[str, PhaseResult]


@dataclass(frozen=True)
class _Met:
    """`rank` met every other rank at the store barrier."""

    rank: int


_Report = _Ran | _Met | CycleFailed | Event


class _Cycle:
    def __init__(
        self,
        config: Config,
        workers: Workers,
        store: AsyncJobStore,
        hooks: CycleHooks,
        fences: frozenset[Phase],
    ) -> None:
        self.config = config
        self.ranks = config.job.ranks
        self.workers = workers
        self.store = store
        self.hooks = hooks
        self.fences = fences
        self.send, self.inbox = anyio.create_memory_object_stream[_Report](INBOX)
        self.telling = Telling(hooks)
        self.failure: CycleFailed | None = None
        self.barriers: list[Barrier] = []
        self.cycle_id = 0  # names this cycle's store barriers
        self.meetings: dict[int, anyio.CancelScope] = {}
        self.at_barrier: dict[int, _Ran] = {}  # BARRIER answered; reported once the rank met
        self.batches: dict[int, msgspec.Raw] = {}  # rank -> its last ROLLOUT's samples

    @property
    def deadlines(self) -> DeadlineSection:
        source = self.hooks.deadlines
        return self.config.deadlines if source is None else source()

    async def run(self) -> RunSummary | CycleFailed:
        state = initial_state(self.ranks, max_steps=self.config.job.steps, fences=self.fences)
        self.telling.state(state)
        after = self.hooks.commands_from
        if after is None:  # commands written from now on apply (one sent in start-up waits)
            after = await self.store.latest_command()
        try:
            step = await self._bootstrap()
        except CycleFailed as failed:
            return await self._failed(state, failed)
        self.telling.summary.first_step = step
        started = time.monotonic()
        async with anyio.create_task_group() as group, self.inbox:
            ids = worker_ids(self.ranks)
            group.start_soon(watch_commands, self.store, self.send, after, self.workers, ids)
            state = await self._drive(group, state, Bootstrapped(step))
            group.cancel_scope.cancel()
        if state.lifecycle is Lifecycle.FAILED:
            return self._failure_of(state)
        log.info("cycle.run.stopped", step=state.step, reason=state.reason)
        return self.telling.stopped(state, time.monotonic() - started)

    async def _bootstrap(self) -> int:
        """Workers up, the checkpoint loaded; the step the job resumes at (the trainers')."""
        try:
            await self.workers.wait_ready(timeout_s=self.deadlines.ready_s)
        except WorkerFailure as exc:
            raise cycle_failed(exc.rank, exc.role, "bootstrap", exc) from exc
        loaded = await bootstrap(self.workers, self.ranks, self.deadlines.for_command("bootstrap"))
        step = min(result.step for result in loaded)
        for rank, result in enumerate(loaded):
            await self.telling.bootstrapped(BootstrapReport(step, rank, result))
        connections = [await self.store.another_connection() for _ in range(self.ranks)]
        self.barriers = [Barrier(c, rank, self.ranks) for rank, c in enumerate(connections)]
        self.cycle_id = await self.store.next_generation("cycle")
        return step

    # -- advance, plan, perform ------------------------------------------------------------------

    async def _drive(self, group: TaskGroup, state: JobState, event: Event) -> JobState:
        while True:
            try:
                outcome = advance(state, event)
            except InvalidTransition as exc:
                if not isinstance(event, OPERATOR_EVENTS):
                    raise  # the driver itself broke a rule: a bug, not an input
                log.warning("cycle.command.refused", error=str(exc))
                event = await self._next_event(state)
                continue
            before, state = state, outcome.state
            self.telling.state(state)
            if state.lifecycle is Lifecycle.PAUSED and before.lifecycle is not Lifecycle.PAUSED:
                log.info("cycle.pause.verified", workers=2 * self.ranks)
            if isinstance(event, BarrierChecked) and event.rank not in outcome.meet:
                await self._barrier_done(state, event.rank)  # nobody to meet: BARRIER ended
            steps = plan(before, outcome)
            follow_up = await self._perform(group, state, steps)
            if steps.ended:
                return state
            event = follow_up if follow_up is not None else await self._next_event(state)

    async def _perform(self, group: TaskGroup, state: JobState, steps: Plan) -> Event | None:
        """Do what the plan says; the event it leads to at once, if any."""
        if steps.cancel_meets:
            for scope in self.meetings.values():
                scope.cancel()
            self.meetings.clear()
            self.at_barrier.clear()
        for rank, phase in steps.start:
            group.start_soon(self._run_phase, rank, phase, state.step)
        for rank in steps.meet:
            self.meetings[rank] = anyio.CancelScope()
            group.start_soon(self._meet, rank, self.meetings[rank])
        if steps.publish:
            await self.store.publish(state)
        if steps.check_release:
            return await self._check_release()
        if steps.finish_drain:
            return Drained()
        return None

    async def _next_event(self, state: JobState) -> Event:
        """What happened next, as the machine's event (reports of cancelled work are dropped)."""
        while True:
            report = await self.inbox.receive()
            if isinstance(report, CycleFailed):
                return self._keep(report)
            if isinstance(report, _Ran):
                return await self._ran(report)
            if isinstance(report, _Met):
                if not state.ranks[report.rank].meeting:
                    continue  # a drain called the meeting off
                self.meetings.pop(report.rank, None)
                await self._barrier_done(state, report.rank)
                return RankFinished(report.rank, Phase.BARRIER)
            return report

    async def _ran(self, ran: _Ran) -> Event:
        if ran.phase is Phase.BARRIER:
            self.at_barrier[ran.rank] = ran
            trainer = ran.results["trainer"]
            assert isinstance(trainer, HeldResult)
            return BarrierChecked(ran.rank, trainer.held_mb)
        rollout = ran.results["rollout"]
        if isinstance(rollout, RolloutResult):
            self.batches[ran.rank] = rollout.samples
        await self._report(ran)
        return RankFinished(ran.rank, ran.phase)

    async def _barrier_done(self, state: JobState, rank: int) -> None:
        ran = self.at_barrier.pop(rank, None)
        if ran is not None and state.lifecycle is not Lifecycle.FAILED:
            await self._report(ran)

    # -- the tasks -------------------------------------------------------------------------------

    async def _run_phase(self, rank: int, phase: Phase, step: int) -> None:
        started = time.monotonic()
        params: dict[str, dict[str, Any]] = {"trainer": {"step": step}, "rollout": {"step": step}}
        if phase is Phase.TRAIN:
            params["trainer"]["batch"] = self.batches.pop(rank, [])
        try:
            deadline_s = self.deadlines.for_command(phase.value)
            results = await run_phase(self.workers, rank, phase, params, deadline_s)
        except CycleFailed as failed:
            await self.send.send(failed)
            return
        await self.send.send(_Ran(rank, phase, step, started, results))

    async def _meet(self, rank: int, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await meet_at_barrier(self.barriers[rank], self.cycle_id, self.deadlines.barrier_s)
            except CycleFailed as failed:
                await self.send.send(failed)
                return
            await self.send.send(_Met(rank))

    async def _check_release(self) -> Event:
        try:
            held = await held_memory(self.workers, self.ranks, self.deadlines.phase_s)
        except CycleFailed as failed:
            return self._keep(failed)
        return PauseChecked(held)

    # -- telling -------------------------------------------------------------------------------

    async def _report(self, ran: _Ran) -> None:
        trainer, rollout = ran.results["trainer"], ran.results["rollout"]
        seconds = time.monotonic() - ran.started
        report = PhaseReport(ran.step, ran.rank, ran.phase, ran.started, seconds, trainer, rollout)
        await self.telling.phase_ended(report)

    async def _failed(self, state: JobState, failed: CycleFailed) -> CycleFailed:
        """A failure before the cycle ran: the machine still learns it, and tells."""
        state = advance(state, self._keep(failed)).state
        self.telling.state(state)
        await self.store.publish(state)
        return self._failure_of(state)

    def _keep(self, failed: CycleFailed) -> Failed:
        """Keep the failure a task saw as the run's error; the machine's event for it."""
        self.failure = failed
        return Failed(str(failed), blame_of(failed))

    def _failure_of(self, state: JobState) -> CycleFailed:
        """The run's failure: the one a task saw, or the one the machine's rules found."""
        failure = self.failure or rule_broken(state)
        log.error(
            "cycle.run.failed",
            rank=failure.rank,
            role=failure.role,
            phase=failure.phase,
            error=str(failure.cause),
        )
        return failure
