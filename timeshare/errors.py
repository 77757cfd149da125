"""Every error timeshare raises on purpose: one root, leaves named for what happened.

Third-party exceptions (pyzmq, msgspec, OS errors) are mapped to these at the boundary where
they occur, so a caller never has to know which library sat underneath.
"""

from __future__ import annotations


class TimeshareError(Exception):
    """Root of every error timeshare raises on purpose."""


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


class StoreError(TimeshareError):
    """Raised when the job store cannot be hosted or reached, or refuses an operation."""


class CollectiveTimeout(TimeshareError):
    """Raised on every rank of a barrier that not every rank reached within its deadline.

    `missing` names the ranks that had not arrived; the job store stays usable afterwards.
    """

    def __init__(self, message: str, *, name: str, generation: int, missing: list[int]) -> None:
        super().__init__(message)
        self.name = name
        self.generation = generation
        self.missing = missing


class WorkerFailure(TimeshareError):
    """Base of the errors that name a worker: its rank and role, and the command it was running.

    `phase` is filled in by the driver when it knows which phase the command belonged to.
    """

    def __init__(self, message: str, *, rank: int, role: str, command: str | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.role = role
        self.command = command
        self.phase: str | None = None


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


class ConfigError(TimeshareError, ValueError):
    """Raised for configuration that cannot work: names the key and where its value came from.

    (A ValueError too, so that msgspec reports one raised while decoding with the key's path.)
    """
