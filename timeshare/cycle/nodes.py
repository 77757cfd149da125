"""This node's side of a job that runs over several nodes: its beat, the fences it crosses with
the other nodes, its last word, and the failure a node or the job store gone makes of the run.

Nothing here decides anything about the job either. When another node counts as gone is the
beat's rule (protocols/nodes.py); what a crossing or a lost node does to the job is the machine's
(state/machine.py); the runner (runner.py) owns the job's state and asks for what is here. This
performs: it keeps this node's record beating in the job store, meets the other nodes where the
plan says, and sends what came of it (`Crossed`, or the run's `CycleFailed`) into the runner's
inbox. On one node there is no beat and no crossing: only a lost store is still named here.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from timeshare.config import DeadlineSection
from timeshare.cycle.commands import CommandFeed
from timeshare.cycle.phases import cross_nodes, node_failed
from timeshare.cycle.telling import Telling
from timeshare.errors import CycleFailed, NodeLost, StoreError
from timeshare.protocols.nodes import BEAT_S, NodeBeat, NodeCrossing, store_lost
from timeshare.protocols.store import AsyncJobStore, JobStore
from timeshare.state import NEXT_PHASE, Crossed, JobState, Lifecycle, Phase

log = structlog.get_logger(__name__)

PREVIOUS_PHASE = {following: phase for phase, following in NEXT_PHASE.items()}
LAST_WORD_S = 2.0  # for a node's final record, on its way out


class NodeCoordinator:
    """This node's dealings with the other nodes of its job, over the job store.

    It keeps no copy of the job's state: `job_state` reads the runner's (the beat writes it into
    this node's record; a failure names the phase the job stands in). `deadlines` reads the
    deadlines in force; `reports` is the runner's inbox.
    """

    def __init__(
        self,
        store: AsyncJobStore,
        telling: Telling,
        reports: MemoryObjectSendStream[Crossed | CycleFailed],
        *,
        node: int,
        nodes: int,
        ranks: int,
        job_state: Callable[[], JobState],
        deadlines: Callable[[], DeadlineSection],
    ) -> None:
        self.store = store
        self.telling = telling
        self.reports = reports
        self.node = node
        self.nodes = nodes  # whose ranks cross every fence together (1: this node alone)
        self.ranks = ranks  # this node's, as many as every other node's
        self.job_state = job_state
        self.deadlines = deadlines
        self.beat: NodeBeat | None = None  # several nodes: this node's record, and the others'
        self.crossing: NodeCrossing | None = None  # several nodes, once every node has loaded
        self.crossing_scope = anyio.CancelScope()
        self.lost: NodeLost | None = None  # the node gone that cancelled the run

    # -- the beat --------------------------------------------------------------------------------

    async def start_beating(self, run: TaskGroup) -> None:
        """Several nodes: beat in the store until `run` ends. A node gone (or the store) cancels
        `run`, wherever it stands, and is kept in `lost`. Raises `StoreError` when the store
        cannot be reached at all."""
        if self.nodes == 1:
            return
        # Its calls wait at most node_s: a leader whose host vanished (no connection reset)
        # is noticed within that too.
        node_s = self.deadlines().node_s
        connection = await self.store.another_connection(timeout_s=node_s)
        self.beat = NodeBeat(connection, self.node, self.nodes, self.ranks, lost_s=node_s)
        run.start_soon(self._keep_beating, self.beat, run.cancel_scope)

    async def _keep_beating(self, beat: NodeBeat, run: anyio.CancelScope) -> None:
        """Beat until cancelled; a node lost (or the store) cancels the whole run."""
        while True:
            beat.update(self.job_state())  # what this beat's record says
            try:
                records = await anyio.to_thread.run_sync(beat.beat_once)
            except NodeLost as lost:
                log.error("cycle.node.lost", node=lost.node, error=str(lost))
                self.lost = lost
                run.cancel()
                return
            self.telling.nodes(records)
            await anyio.sleep(BEAT_S)

    async def last_word(self) -> None:
        """Several nodes: write this node's final record (stopped, or failed and why); the store
        may be gone.

        The leader then waits until every other node has stopped, failed or gone quiet: the
        store leaves with the leader's process, and a follower still draining would take that
        for the leader's death.
        """
        beat = self.beat
        if beat is None:
            return
        beat.update(self.job_state())
        try:
            with anyio.fail_after(LAST_WORD_S):
                await anyio.to_thread.run_sync(beat.write, abandon_on_cancel=True)
            if self.node != 0:
                return
            with anyio.fail_after(self._longest_phase_s()):
                while True:
                    if await anyio.to_thread.run_sync(beat.others_finished):
                        break
                    await anyio.sleep(BEAT_S)
        except (NodeLost, TimeoutError) as exc:
            log.warning("cycle.node.last_word", error=str(exc) or "timed out")

    def _longest_phase_s(self) -> float:
        """The longest another node may still take to finish what it is in."""
        deadlines = self.deadlines()
        longest = max(deadlines.for_command(phase.value) for phase in Phase)
        return longest + deadlines.barrier_s + deadlines.node_s

    # -- the crossings ---------------------------------------------------------------------------

    async def agree_at_start(
        self, cycle: int, step: int, commands: int, *, load_s: float
    ) -> tuple[int, int]:
        """Every node's workers loaded the checkpoint (within `load_s`): the nodes cross before
        SYNC and agree on the step the job resumes at and on the command generation after which
        commands apply, each the smallest any node brought. One node: its own."""
        if self.nodes == 1:
            return step, commands
        self.crossing = NodeCrossing.of(
            await self.store.another_connection(), self.store.blocking, self.node, self.nodes, cycle
        )
        agreed = await cross_nodes(
            self.crossing,
            StartBrought(step=step, commands=commands),
            agreed_start,
            brought_as=StartBrought,
            agreed_as=StartAgreed,
            following=Phase.SYNC,
            ranks_per_node=self.ranks,
            timeout_s=self.deadlines().ready_s + load_s,
        )
        if agreed.steps_by_node is not None:  # a checkpoint directory not shared, maybe
            log.warning("cycle.nodes.steps_differ", steps_by_node=agreed.steps_by_node)
        assert self.beat is not None
        self.beat.judging = True  # every node came: from now on, a node gone quiet is lost
        return agreed.step, agreed.commands

    def start_crossing(self, group: TaskGroup, following: Phase, commands: CommandFeed) -> None:
        """Meet the other nodes at the fence before `following`, as a task of `group`."""
        self.crossing_scope = anyio.CancelScope()
        group.start_soon(self._cross, following, commands, self.crossing_scope)

    def call_off_crossing(self) -> None:
        """A drain began: nobody waits for the other nodes at a fence any more."""
        self.crossing_scope.cancel()

    async def _cross(
        self, following: Phase, commands: CommandFeed, scope: anyio.CancelScope
    ) -> None:
        """Meet every node at the fence before `following`, bringing the last command this node
        has seen; then read every command up to the last any node had seen."""
        assert self.crossing is not None
        deadlines = self.deadlines()
        previous = PREVIOUS_PHASE[following].value
        timeout_s = deadlines.for_command(previous) + deadlines.barrier_s
        with scope:
            try:
                agreed = await cross_nodes(
                    self.crossing,
                    last_command_seen,
                    newest_command,
                    brought_as=CommandsSeen,
                    agreed_as=CommandsSeen,
                    following=following,
                    ranks_per_node=self.ranks,
                    timeout_s=timeout_s,
                )
                through = agreed.commands
                await commands.read_through(through)  # into the inbox, before the crossing
            except CycleFailed as failed:
                await self.reports.send(failed)
                return
            except StoreError as exc:
                await self.reports.send(self.store_lost(exc))
                return
            await self.reports.send(Crossed(following, through))

    # -- the run's failure -----------------------------------------------------------------------

    def store_lost(self, exc: StoreError) -> CycleFailed:
        """The run's failure when the job store is gone (with the leader that hosted it)."""
        lost = store_lost(self.store.address, self.node, self.ranks, exc)
        return node_failed(lost.node, lost.ranks, self._phase_now(), lost)

    def failure_of_lost(self) -> CycleFailed | None:
        """The run's failure when the beat found a node gone (and cancelled the run); else None."""
        if self.lost is None:
            return None
        return node_failed(self.lost.node, self.lost.ranks, self._phase_now(), self.lost)

    def _phase_now(self) -> str:
        state = self.job_state()
        return "start" if state.lifecycle is Lifecycle.STARTING else state.phases[0].value


class CommandsSeen(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a node brings to a crossing, and what they agree: the generation of the newest
    command written that the node had seen."""

    commands: int


class StartBrought(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a node brings to the start's crossing: the step its checkpoint holds, and the
    newest command it had seen."""

    step: int
    commands: int


class StartAgreed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the job starts: the smallest step and command generation any node brought, and
    every node's step where they differ (None where all are the same)."""

    step: int
    commands: int
    steps_by_node: list[int] | None = None


def last_command_seen(store: JobStore) -> CommandsSeen:
    """What this node brings to a crossing: the generation of the newest command written."""
    return CommandsSeen(store.latest_command())


def newest_command(brought: list[CommandsSeen]) -> CommandsSeen:
    """A crossing's agreement: commands apply up to the newest any node had seen."""
    return CommandsSeen(max(node.commands for node in brought))


def agreed_start(brought: list[StartBrought]) -> StartAgreed:
    """The start's agreement: the smallest step and command generation any node brought, and
    every node's step where they differ."""
    steps = [node.step for node in brought]
    return StartAgreed(
        step=min(steps),
        commands=min(node.commands for node in brought),
        steps_by_node=steps if len(set(steps)) > 1 else None,
    )
