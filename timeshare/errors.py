"""Every error timeshare raises on purpose, in one place: one root, leaves named for what happened.

Each class says when it is raised. Third-party exceptions (pyzmq, msgspec, TCPStore, OS errors)
are mapped to these at the boundary where they occur, so a caller never has to know which
library sat underneath. Across a socket an error travels by its class's name: a worker's as
`WorkerError.remote_type`, a refusal of the control socket as the reply's `name`.
"""

from __future__ import annotations

import signal


class TimeshareError(Exception):
    """Raised never itself: the root of every error timeshare raises on purpose, so that one
    `except TimeshareError` catches them all."""


class ReportError(TimeshareError):
    """Raised by `timeshare report` and `timeshare trace` for a run directory that is missing,
    or holds no summary or log of a run (or one that cannot be read), for an output that cannot
    be written, or without the `report` extra: names the path, or what to install."""


class ConfigError(TimeshareError, ValueError):
    """Raised for configuration that cannot work: names the key and where its value came from.

    (A ValueError too, so that msgspec reports one raised while decoding with the key's path.)
    """


# -- the state machines (timeshare/state) ----------------------------------------------------------


class InvalidTransition(TimeshareError):
    """Raised when an event or a request is not legal in a state machine's state.

    Nothing changed. `state` and `event` are the machine's own objects: a `JobState` and an event
    of the phase machine, or a service lifecycle and an operator request of the service's table.
    """

    def __init__(self, message: str, *, state: object, event: object) -> None:
        super().__init__(message)
        self.state = state
        self.event = event


# -- the weight channel (protocols/weights) --------------------------------------------------------


class TransferError(TimeshareError):
    """Raised when a weight transfer cannot be done or was not done whole.

    Bad input (duplicate names, a value that is not a tensor, names missing from or extra to the
    expected set) is raised before anything is sent wherever the input allows it.
    """


class AckTimeout(TransferError):
    """Raised when the peer of a weight channel did not answer within its deadline.

    The message names the phase (mapped, begin, bucket, released, finalized), the bucket's index
    within the transfer where one was involved, the sequence number and the endpoint. The session
    is closed on this side: a bucket is never re-sent.
    """

    def __init__(
        self, message: str, *, phase: str, seq: int | None, endpoint: str, bucket: int | None = None
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.seq = seq
        self.endpoint = endpoint
        self.bucket = bucket


class PeerError(TransferError):
    """Raised on the sender when the receiver replied with an error frame.

    `remote_type` and `remote_message` carry the receiver's exception; the receiver re-raises its
    own exception on its side.
    """

    def __init__(self, message: str, *, remote_type: str, remote_message: str) -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_message = remote_message


class ProtocolError(TransferError):
    """Raised when a frame is malformed, foreign (another session) or out of sequence."""


class SessionClosed(TransferError):
    """Raised when a closed or broken weight-channel session is used again.

    A session breaks on any failed transfer; a new sender/receiver pair is needed.
    """


class PeerClosed(TransferError):
    """Raised on a receiver waiting for a transfer when the sender closed the session."""


# -- the job store and its barriers (protocols/store, protocols/barrier) ---------------------------


class StoreError(TimeshareError):
    """Raised when the job store cannot be hosted or reached, or refuses an operation."""


class NodeLost(TimeshareError):
    """Raised on a node of a job spanning several when another node's daemon went silent (it
    died, or cannot reach the job store), or when this node lost the job store itself (the
    leader's daemon died). `node` and `ranks` name the node that is gone (the leader, for a
    lost store)."""

    def __init__(self, message: str, *, node: int, ranks: range) -> None:
        super().__init__(message)
        self.node = node
        self.ranks = ranks


class CollectiveTimeout(TimeshareError):
    """Raised on every rank of a barrier that not every rank reached within its deadline.

    `missing` names the ranks that had not arrived; the job store stays usable afterwards.
    """

    def __init__(self, message: str, *, name: str, generation: int, missing: list[int]) -> None:
        super().__init__(message)
        self.name = name
        self.generation = generation
        self.missing = missing


# -- workers, as their command lanes see them (protocols/commands) ---------------------------------


class WorkerFailure(TimeshareError):
    """Raised when a worker cannot be reached or answered badly (the leaves say how): names its
    rank and role, and the command it was running."""

    def __init__(self, message: str, *, rank: int, role: str, command: str | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.role = role
        self.command = command


class WorkerError(WorkerFailure):
    """Raised when a command raised inside a worker; carries the remote type and message."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        role: str,
        command: str,
        remote_type: str,
        remote_message: str,
    ) -> None:
        super().__init__(message, rank=rank, role=role, command=command)
        self.remote_type = remote_type
        self.remote_message = remote_message


class WorkerDied(WorkerFailure):
    """Raised when a worker's process exited (seen from the exit itself, not a deadline)."""

    def __init__(
        self, message: str, *, rank: int, role: str, command: str | None, returncode: int
    ) -> None:
        super().__init__(message, rank=rank, role=role, command=command)
        self.returncode = returncode


class WorkerStalled(WorkerFailure):
    """Raised when a worker busy with a command made no progress for `stall_timeout_s`."""


class WorkersNotReady(WorkerFailure):
    """Raised when a worker did not connect both lanes within the start-up deadline."""


class CommandTimeout(WorkerFailure):
    """Raised when a command did not finish within its deadline, progress or not."""


class BadResult(WorkerFailure):
    """Raised when a worker's answer does not decode as the result its command returns."""


class Aborted(TimeshareError):
    """Raised inside a worker's running call when the driver aborts it (reported as its result)."""


class UnknownCommand(TimeshareError):
    """Raised (and reported to the driver) for a command a worker has no handler for."""


class SimulatedFault(TimeshareError):
    """Raised inside a worker by an injected `raise` fault (a drill, or a test)."""


# -- the cycle (timeshare/cycle) -------------------------------------------------------------------


class MemoryHeld(TimeshareError):
    """Raised (as a `CycleFailed`'s cause) when a worker still holds device memory where the
    cycle requires it free: its trainer at BARRIER, or any worker once the job paused."""


class WeightsMismatch(TimeshareError):
    """Raised (as a `CycleFailed`'s cause) when a rank's rollout does not hold the weights its
    trainer sent at SYNC, under `[checks] on_weights_mismatch = "fail"`: names the rank, the TP
    worker (None: the engine's own digest) and both digests (state/weights.py)."""

    def __init__(self, message: str, *, rank: int, worker: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.worker = worker


class CycleFailed(TimeshareError):
    """Raised by the driver when a phase failed on a rank: names rank, role and phase.

    The typed cause (WorkerError, WorkerDied, WorkerStalled, CommandTimeout, CollectiveTimeout,
    ...) is `cause` and `__cause__`; `after_s` is how long after the phase started it was seen.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        role: str,
        phase: str,
        cause: BaseException,
        after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.role = role
        self.phase = phase
        self.cause = cause
        self.after_s = after_s


# -- engines (timeshare/engines) -------------------------------------------------------------------


class UnsupportedInput(TimeshareError):
    """Raised by an engine adapter given a request field it cannot honour (never dropped
    silently)."""


class PatchRefused(TimeshareError):
    """Raised when a patch to an engine we do not own meets a target it was not written for (a
    version or a source it does not know): nothing is patched, and the error names the target,
    what was found and what the patch knows."""


class PromptTooLong(UnsupportedInput):
    """Raised by a rollout engine given a request whose prompt and completion do not fit the
    sequence it can hold (its context length or KV cache), naming the request and the lengths."""


class WeightsTorn(TimeshareError):
    """Raised by a rollout engine asked to generate while its weights are not a whole version."""


class SimulatedOOM(TimeshareError):
    """Raised when an allocation does not fit on a simulated device."""


class EngineAsleep(TimeshareError):
    """Raised by the reference rollout engine asked to load or generate while the memory it
    needs is released."""


class LoaderFailed(TimeshareError):
    """Raised by an inference engine's own weight loader refusing a bucket (a name, a shape or a
    dtype it does not take); the trainer sees it as `PeerError` naming it and the engine."""


class GenerateTimeout(TimeshareError):
    """Raised by a rollout engine whose generate ran past its deadline; the requests were
    aborted inside the engine, which stays usable."""


class EngineBroken(TimeshareError):
    """Raised by an engine whose call into its inference engine did not return within its
    deadline: the engine cannot be trusted again (the worker is restarted)."""


class OffPolicy(TimeshareError):
    """Raised by the reference trainer when a sample in its batch was produced by weights other
    than the ones being trained."""


class CheckpointError(TimeshareError):
    """Raised when a checkpoint cannot be written or read."""


# -- the task (timeshare/task) --------------------------------------------------------------------


class RewardFailed(TimeshareError):
    """Raised in ROLLOUT when the job's reward function failed on a sample (raised, timed out,
    died, or returned what is not a score) under `on_error = "fail"`, or failed on more than
    `max_skipped_fraction` of a batch under `"skip"`: names the function, the sample and its
    row, and the file every failure was written to (reward_errors.jsonl). Never a reward of 0.
    """


class RewardFunctionError(TimeshareError):
    """Raised when a reward function returned what is not a reward (NaN or infinite, a string, a
    list, a dict without a numeric "score", a numeric extra that is not finite), or when a
    sample supplies no value for one of its required parameters: names the function and what
    was received. The pool reports it as the sample's `RewardOutcome.error`."""


# -- the control socket: requests the daemon refuses (protocols/control) ---------------------------


class ControlError(TimeshareError):
    """Raised for a control request the daemon refuses; `name` (the class's) is what the wire
    carries, stable for scripts, and the message is for people."""

    def __init__(self, message: str, *, request_id: int | str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id

    @property
    def name(self) -> str:
        return type(self).__name__


class BadRequest(ControlError):
    """Raised for a line that is not a JSON object with a string `method`."""


class UnknownMethod(ControlError):
    """Raised for a method the daemon does not have."""


class BadParams(ControlError):
    """Raised for parameters of the wrong name, type or range."""


class RequestTooLarge(ControlError):
    """Raised for a line longer than the server's limit (the connection is then closed)."""


class NotRunning(ControlError):
    """Raised for a request that needs a cycle when none runs (idle, failed), or for a `--wait`
    whose effect can no longer come (the cycle ended)."""


class ReloadRefused(ControlError):
    """Raised when a reloaded config is broken or changes what cannot change live."""


class WaitTimeout(ControlError):
    """Raised when `wait` was asked for and the request did not take effect in `timeout_s`."""


class Busy(ControlError):
    """Raised when the daemon already serves as many clients as it allows."""


# -- the programs (timeshare/daemon) ---------------------------------------------------------------


class SocketInUse(TimeshareError):
    """Raised when another process already listens on the control socket's path."""


class NoDaemon(TimeshareError):
    """Raised by `timesharectl` when nothing answers on the socket, or the answer is not the
    protocol."""


class DaemonRefused(TimeshareError):
    """Raised by `timesharectl` when the daemon answers with an error (`error`: its fields)."""

    def __init__(self, error: dict[str, object]) -> None:
        name, message, state = error.get("name"), error.get("message"), error.get("state")
        super().__init__(f"{name}: {message} (state: {state})")
        self.error = error


class Interrupted(TimeshareError):
    """Raised by `timeshare run` when a signal (SIGINT, SIGTERM) stops it; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def first_error(error: BaseException) -> BaseException:
    """The first error an exception group holds, however deeply nested (a task group's failure
    said plainly); any other error itself."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
