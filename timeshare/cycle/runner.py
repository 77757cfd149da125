"""The cycle runner: sync decides, async acts.

One loop, three steps: `advance` the machine with what happened (state/machine.py), `plan` what
that asks for (state/plan.py), `perform` it. Performing starts phases and barrier meetings as
tasks, which report back into one inbox; what they report becomes the next event. Nothing here
decides anything about the job: a failure, a drain that is done, a pause that holds memory, the
BARRIER's rule — all are the machine's. The runner only keeps what the machine does not need:
each phase's results until the phase ends, each rank's samples until its next TRAIN.

With several nodes, each node's daemon runs this over its own ranks (global rank numbers:
node * ranks-per-node + local); its dealings with the other nodes (the beat, the crossings at
fences, its last word) are nodes.py's. The runner keeps the one copy of the job's state
(`_Cycle.state`, moved only by `_move`): everything else reads it there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup, TaskStatus

from timeshare.cluster import node_ranks
from timeshare.config import Config, DeadlineSection
from timeshare.cycle.commands import NODES_POLL_S, POLL_S, CommandFeed
from timeshare.cycle.hooks import BootstrapReport, CycleHooks, PhaseReport, RunSummary
from timeshare.cycle.meeting import NodeMeeting
from timeshare.cycle.nodes import NodeCoordinator
from timeshare.cycle.phases import (
    blame_of,
    bootstrap,
    cycle_failed,
    held_memory,
    meet_at_barrier,
    node_failed,
    rule_broken,
    run_phase,
)
from timeshare.cycle.telling import Telling
from timeshare.cycle.weights_check import WeightsCheck
from timeshare.cycle.workers import Workers, WorkerSpawner, spawn_workers, worker_ids
from timeshare.errors import CycleFailed, StoreError, WorkerFailure
from timeshare.protocols.commands.params import NO_SAMPLES, PhaseParams
from timeshare.protocols.commands.results import CommandResult, HeldResult, RolloutResult
from timeshare.protocols.nodes import BEAT_S
from timeshare.protocols.store import AsyncJobStore, JobStore
from timeshare.state import (
    MEMORY_FENCES,
    OPERATOR_EVENTS,
    BarrierChecked,
    Bootstrapped,
    Commanded,
    Crossed,
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
    Request,
    Requested,
    advance,
    initial_state,
    plan,
)
from timeshare.state.job import LIVE

log = structlog.get_logger(__name__)

# The job's state changes at every phase (hundreds of times a second on one node of simulated
# engines); it is written to the store at most this often, the newest each time, and once more
# as the run ends. Each write is a hop into a worker thread and back: a fifth of a daemon's CPU
# at 16 nodes when every change was written (benchmarks/scale.py, py-spy --gil).
PUBLISH_EVERY_S = 0.1
# Several nodes: at the beat's pace, as each node's record in the store (10 writes a second on
# every node were 10,240 a second into the leader's store at 1,024 nodes; this is 2,048). A new
# lifecycle (paused, draining, stopped, failed) is written at once all the same, on any number
# of nodes: it is what an operator waits for.
NODES_PUBLISH_EVERY_S = BEAT_S
INBOX = 1000  # reports waiting for the loop: at most a phase and a meeting per rank, commands


async def run_cycle(
    config: Config,
    store: JobStore | None = None,
    *,
    hooks: CycleHooks | None = None,
    spawn: WorkerSpawner = spawn_workers,
    fences: frozenset[Phase] = MEMORY_FENCES,
    across_nodes: bool = True,
) -> RunSummary:
    """Run the job (this node's ranks of it) until the machine stops it; raise `CycleFailed`
    on the first failure.

    The job store is hosted (or, on a follower node, reached) here unless the caller did
    (`store`). `hooks` are how a front end watches and steers the run. `spawn` starts the
    workers (real processes unless a test passes a fake). `fences` and `across_nodes` are
    test-only switches: the proof that each memory fence matters drops one, and the proof that
    the fences must hold across nodes keeps them within each node.
    """
    if store is not None:
        job_store = AsyncJobStore(store)
    else:
        try:
            job_store = await AsyncJobStore.for_job(
                config.cluster, ready_s=config.deadlines.ready_s
            )
        except StoreError as exc:
            raise node_failed(
                0, node_ranks(config.cluster, config.job.ranks, node=0), "start", exc
            ) from exc
    async with spawn(config, job_store.blocking) as workers:
        cycle = _Cycle(
            config,
            job_store,
            workers,
            hooks=hooks or CycleHooks(),
            fences=fences,
            across_nodes=across_nodes,
        )
        ended = await cycle.run()
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
    answered: float
    results: dict[str, CommandResult]


@dataclass(frozen=True)
class _Met:
    """`rank` met every other rank at the node's meeting."""

    rank: int


_Report = _Ran | _Met | CycleFailed | Event


class _Cycle:
    """One run of the cycle on this node's ranks, over `workers` (spawned for it)."""

    def __init__(
        self,
        config: Config,
        store: AsyncJobStore,
        workers: Workers,
        *,
        hooks: CycleHooks,
        fences: frozenset[Phase],
        across_nodes: bool,
    ) -> None:
        self.config = config
        self.node = config.cluster.node_rank
        self.node_ranks = node_ranks(config.cluster, config.job.ranks)  # global, this node's
        self.ranks = len(self.node_ranks)
        self.store = store
        self.workers = workers
        self.hooks = hooks
        self.fences = fences
        self.send, self.inbox = anyio.create_memory_object_stream[_Report](INBOX)
        self.telling = Telling(hooks, self.node)
        self.coordinator = NodeCoordinator(
            store,
            self.telling,
            self.send,
            node=self.node,
            nodes=config.cluster.nodes if across_nodes else 1,
            ranks=self.ranks,
            job_state=lambda: self.state,
            deadlines=lambda: self.deadlines,
        )
        self.failure: CycleFailed | None = None
        # BARRIER's meeting of this node's ranks
        self.meeting = NodeMeeting(self.ranks, first_rank=self.node_ranks.start, node=self.node)
        self.meetings: dict[int, anyio.CancelScope] = {}
        self.at_barrier: dict[int, _Ran] = {}  # BARRIER answered; reported once the rank met
        self.batches: dict[int, msgspec.Raw] = {}  # rank -> its last ROLLOUT's samples
        self.weights = WeightsCheck(self.node_ranks, config.checks.on_weights_mismatch, workers)
        self.commands: CommandFeed | None = None
        self.publish_due = anyio.Event()  # the state changed since it was last written
        self.lifecycle_moved = anyio.Event()  # ... to a new lifecycle: written without delay
        self.state: JobState  # the machine's, as last moved: the one copy (see `_move`)

    @property
    def deadlines(self) -> DeadlineSection:
        source = self.hooks.deadlines
        return self.config.deadlines if source is None else source()

    async def run(self) -> RunSummary | CycleFailed:
        self._move(
            initial_state(
                self.ranks,
                max_steps=self.config.job.steps,
                fences=self.fences,
                nodes=self.coordinator.nodes,
                first_rank=self.node_ranks.start,
            )
        )
        ended: RunSummary | CycleFailed | None = None
        async with anyio.create_task_group() as beating:
            try:  # several nodes: a node gone (or the store) ends the run, wherever it stands
                await self.coordinator.start_beating(beating)
            except StoreError as exc:
                return await self._failed(self.coordinator.store_lost(exc))
            ended = await self._run()
            beating.cancel_scope.cancel()
        lost = self.coordinator.failure_of_lost()
        if lost is not None:
            ended = self._lost(lost)
        assert ended is not None
        # The others learn at once that this node stopped or failed.
        await self.coordinator.last_word()
        return ended

    async def _run(self) -> RunSummary | CycleFailed:
        try:
            after = self.hooks.commands_from
            if after is None:  # commands written from now on apply (one sent in start-up waits)
                after = await self.store.latest_command()
            step, after = await self._bootstrap(after)
        except CycleFailed as failed:
            return await self._failed(failed)
        except StoreError as exc:  # several nodes: the leader, and its store, are gone
            return await self._failed(self.coordinator.store_lost(exc))
        self.telling.summary.first_step = step
        started = time.monotonic()
        async with anyio.create_task_group() as group, self.inbox:
            ids = worker_ids(self.node_ranks)
            poll_s = POLL_S if self.coordinator.nodes == 1 else NODES_POLL_S
            self.commands = CommandFeed(
                self.store, self.send, after, self.workers, ids, poll_s=poll_s
            )
            await group.start(self._watch_commands, self.commands)
            group.start_soon(self._keep_publishing)
            await self._drive(group, Bootstrapped(step))
            group.cancel_scope.cancel()
        await self._publish()  # where the run ended (the run is over: a store gone is logged)
        if self.state.lifecycle is Lifecycle.FAILED:
            return self._failure_of()
        log.info("cycle.run.stopped", step=self.state.step, reason=self.state.reason)
        return self.telling.stopped(self.state, time.monotonic() - started)

    async def _bootstrap(self, after: int) -> tuple[int, int]:
        """Workers up, the checkpoint loaded; the step the job resumes at (the trainers', the
        smallest of every node's), and the command generation after which commands apply."""
        try:
            await self.workers.wait_ready(timeout_s=self.deadlines.ready_s)
        except WorkerFailure as exc:
            raise cycle_failed(exc.rank, exc.role, "bootstrap", exc) from exc
        deadline_s = self.deadlines.for_command("bootstrap")
        loaded = await bootstrap(self.workers, self.node_ranks, deadline_s)
        step = min(result.step for result in loaded)
        cycle_id = await self.store.next_generation(f"cycle/node/{self.node}")
        # Several nodes: every node loaded; they agree on the step and on the commands.
        step, after = await self.coordinator.agree_at_start(
            cycle_id, step, after, load_s=deadline_s
        )
        for rank, result in zip(self.node_ranks, loaded, strict=True):
            await self.telling.bootstrapped(BootstrapReport(step, rank, result))
        return step, after

    # -- advance, plan, perform ------------------------------------------------------------------

    async def _drive(self, group: TaskGroup, event: Event) -> None:
        """Advance, plan, perform, until the plan says the run has ended."""
        while True:
            before = self.state
            try:
                outcome = advance(before, event)
            except InvalidTransition as exc:
                if not isinstance(event, OPERATOR_EVENTS):
                    raise  # the driver itself broke a rule: a bug, not an input
                log.warning("cycle.command.refused", error=str(exc))
                event = await self._next_event()
                continue
            self._move(outcome.state)
            self._tell_move(before, outcome.refused)
            if isinstance(event, BarrierChecked) and event.rank not in outcome.meet:
                await self._barrier_done(event.rank)  # nobody to meet: BARRIER ended
            steps = plan(before, outcome)
            follow_up = await self._perform(group, steps)
            if steps.ended:
                return
            event = follow_up if follow_up is not None else await self._next_event()

    def _move(self, state: JobState) -> None:
        """The machine moved the job to `state`: kept here only (nodes.py reads it here too)."""
        self.state = state
        self.telling.state(state)

    def _tell_move(self, before: JobState, refused: tuple[str, ...]) -> None:
        """The move on the timeline, in the log and in the store: a new lifecycle (written
        without waiting for the publish pace), a verified pause, refusals."""
        state = self.state
        if state.lifecycle is not before.lifecycle:
            self.telling.mark(state.lifecycle.value, time.monotonic(), step=state.step)
            self.lifecycle_moved.set()
        if state.lifecycle is Lifecycle.PAUSED and before.lifecycle is not Lifecycle.PAUSED:
            log.info("cycle.pause.verified", workers=2 * self.ranks)
        for reason in refused:
            log.warning("cycle.command.refused", error=reason)

    async def _perform(self, group: TaskGroup, steps: Plan) -> Event | None:
        """Do what the plan says; the event it leads to at once, if any."""
        step = self.state.step
        if steps.cancel_meets:
            for scope in self.meetings.values():
                scope.cancel()
            self.meetings.clear()
            self.meeting.call_off()
            self.at_barrier.clear()
            self.coordinator.call_off_crossing()
        for phase in sorted(
            {phase for _, phase in steps.start} & self.fences, key=list(Phase).index
        ):
            self.telling.mark(f"fence before {phase.name}", time.monotonic(), step=step)
        for rank, phase in steps.start:
            group.start_soon(self._run_phase, rank, phase, step)
        for rank in steps.meet:
            self.meetings[rank] = anyio.CancelScope()
            group.start_soon(self._meet, rank, self.meetings[rank])
        if steps.cross is not None:
            assert self.commands is not None
            self.coordinator.start_crossing(group, steps.cross, self.commands)
        if steps.publish:
            self.publish_due.set()
        if steps.check_release:
            return await self._check_release()
        if steps.finish_drain:
            return Drained()
        return None

    async def _next_event(self) -> Event:
        """What happened next, as the machine's event (reports of cancelled work are dropped)."""
        while True:
            report = await self.inbox.receive()
            if isinstance(report, CycleFailed):
                return self._keep(report)
            if isinstance(report, Commanded):
                self.telling.mark(
                    f"command {_command_name(report)}",
                    time.monotonic(),
                    generation=report.generation,
                )
                if report.command == Requested(Request.STOP):
                    self.telling.summary.stop_requested = True  # the daemon stops too
                return report
            if isinstance(report, Crossed):
                if self.state.crossing is not report.following:
                    continue  # a stop called the crossing off
                self.telling.mark(
                    f"nodes met before {report.following.name}",
                    time.monotonic(),
                    commands=report.through,
                )
                return report
            if isinstance(report, _Ran):
                return await self._ran(report)
            if isinstance(report, _Met):
                if not self.state.ranks[report.rank].meeting:
                    continue  # a drain called the meeting off
                self.meetings.pop(report.rank, None)
                await self._barrier_done(report.rank)
                return RankFinished(report.rank, Phase.BARRIER)
            return report

    async def _ran(self, ran: _Ran) -> Event:
        if ran.phase is Phase.BARRIER:
            self.at_barrier[ran.rank] = ran
            trainer = ran.results["trainer"]
            assert isinstance(trainer, HeldResult)
            return BarrierChecked(ran.rank, trainer.held_mb)
        rollout = ran.results["rollout"]
        if isinstance(rollout, RolloutResult) and rollout.served_by is None:
            # An engine serving a tensor-parallel group brings the other ranks' batches too.
            self.batches[ran.rank] = rollout.samples
            for rank, samples in rollout.batches.items():
                self.batches[self.node_ranks.index(rank)] = samples
        await self._report(ran)
        if ran.phase is Phase.SYNC:  # every rollout holds its trainer's weights, or the run ends
            trainer = ran.results["trainer"]
            failed = await self.weights.synced(
                ran.step, self.node_ranks[ran.rank], trainer, rollout
            )
            if failed is not None:
                return self._keep(failed)
        return RankFinished(ran.rank, ran.phase)

    async def _barrier_done(self, rank: int) -> None:
        ran = self.at_barrier.pop(rank, None)
        if ran is not None and self.state.lifecycle is not Lifecycle.FAILED:
            await self._report(ran)

    # -- the tasks -------------------------------------------------------------------------------

    async def _run_phase(self, rank: int, phase: Phase, step: int) -> None:
        started = time.monotonic()
        batch = self.batches.pop(rank, NO_SAMPLES) if phase is Phase.TRAIN else NO_SAMPLES
        params = {
            "trainer": PhaseParams(step=step, batch=batch),
            "rollout": PhaseParams(step=step),
        }
        try:
            deadline_s = self.deadlines.for_command(phase.value)
            global_rank = self.node_ranks[rank]
            results = await run_phase(self.workers, global_rank, phase, params, deadline_s)
        except CycleFailed as failed:
            await self.send.send(failed)
            return
        await self.send.send(_Ran(rank, phase, step, started, time.monotonic(), results))

    async def _meet(self, rank: int, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await meet_at_barrier(self.meeting, rank, self.deadlines.barrier_s)
            except CycleFailed as failed:
                await self.send.send(failed)
                return
            await self.send.send(_Met(rank))

    async def _watch_commands(
        self, commands: CommandFeed, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Started once the commands written before the run are in the inbox."""
        try:
            try:
                await commands.catch_up()
            finally:
                task_status.started()  # (a store gone: the cycle starts, to learn it below)
            await commands.watch()
        except StoreError as exc:  # several nodes: the leader, and its store, are gone
            await self.send.send(self.coordinator.store_lost(exc))

    async def _keep_publishing(self) -> None:
        """Write the job's state as it changes, at most every PUBLISH_EVERY_S (several nodes:
        NODES_PUBLISH_EVERY_S), a new lifecycle at once; a store gone is the run's failure,
        reported into the inbox."""
        every_s = PUBLISH_EVERY_S if self.coordinator.nodes == 1 else NODES_PUBLISH_EVERY_S
        while True:
            await self.publish_due.wait()
            self.publish_due, self.lifecycle_moved = anyio.Event(), anyio.Event()
            lost = await self._publish()
            if lost is not None:
                await self.send.send(lost)
                return
            with anyio.move_on_after(every_s):
                await self.lifecycle_moved.wait()

    async def _publish(self) -> CycleFailed | None:
        """Where the job stands, into the store; the failure if the store is gone."""
        try:
            await self.store.publish(self.state, node=self.node)
        except StoreError as exc:
            if self.state.lifecycle in LIVE:
                return self.coordinator.store_lost(exc)
            log.warning("cycle.state.unpublished", error=str(exc))  # the run is over anyway
        return None

    async def _check_release(self) -> Event:
        try:
            held = await held_memory(self.workers, self.node_ranks, self.deadlines.phase_s)
        except CycleFailed as failed:
            return self._keep(failed)
        return PauseChecked(held)

    # -- telling -------------------------------------------------------------------------------

    async def _report(self, ran: _Ran) -> None:
        trainer, rollout = ran.results["trainer"], ran.results["rollout"]
        seconds = time.monotonic() - ran.started
        rank = self.node_ranks[ran.rank]
        report = PhaseReport(
            ran.step, rank, ran.phase, ran.started, seconds, trainer, rollout, ran.answered
        )
        await self.telling.phase_ended(report)

    async def _failed(self, failed: CycleFailed) -> CycleFailed:
        """A failure before the cycle ran: the machine still learns it, and tells."""
        self._move(advance(self.state, self._keep(failed)).state)
        await self._publish()
        return self._failure_of()

    def _lost(self, failed: CycleFailed) -> CycleFailed:
        """The run ends because a node is gone: the machine learns it, as any failure."""
        event = self._keep(failed)
        if self.state.lifecycle in LIVE:
            self._move(advance(self.state, event).state)
        return self._failure_of()

    def _keep(self, failed: CycleFailed) -> Failed:
        """Keep the failure a task saw as the run's error; the machine's event for it."""
        self.failure = failed
        return Failed(str(failed), blame_of(failed))

    def _failure_of(self) -> CycleFailed:
        """The run's failure: the one a task saw, or the one the machine's rules found."""
        failure = self.failure or rule_broken(self.state)
        log.error(
            "cycle.run.failed",
            rank=failure.rank,
            role=failure.role,
            phase=failure.phase,
            error=str(failure.cause),
        )
        return failure


def _command_name(command: Commanded) -> str:
    event = command.command
    return event.request.value if isinstance(event, Requested) else f"steps {event.max_steps}"
