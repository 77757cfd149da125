"""One reward process: loads the user's reward function, then scores one sample at a time on its
main thread. Run by the pool (reward_pool.py) as `python -m timeshare.task.reward_child ARGS`,
ARGS the JSON of `ChildArgs`.

The protocol runs over the process's stdin and stdout, in frames: a 4-byte big-endian length,
then a msgpack payload (never pickle: a frame is data, not code). The child first answers with a
`Hello` (ready, or the load error); then, for each `RewardCall` it reads, one `RewardOutcome`.
A user's print() must not corrupt the frames, nor a read of stdin steal them: the protocol keeps
duplicates of both descriptors, fd 1 becomes stderr (the worker's log) and fd 0 /dev/null.

The function runs on the main thread (math-verify's timeouts use signal.alarm, which works
there alone); the pool enforces the deadline by killing the process, and the process dies with
the pool's owner (PR_SET_PDEATHSIG). It exits 0 at the end of its stdin.
"""

from __future__ import annotations

import io
import os
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from timeshare.errors import ConfigError
from timeshare.runtime import die_with_parent
from timeshare.task import reward_function
from timeshare.task.reward_function import (
    RewardCall,
    RewardOutcome,
    call_function,
    check_signature,
    checked_result,
    is_file_path,
    load_function,
    resolve_file,
)

HEADER = struct.Struct(">I")
# A frame longer than this is taken for a broken stream, not waited for.
MAX_FRAME_BYTES = 256 * 1024 * 1024
# An error's text is cut to its last this many characters (a RecursionError's traceback is long).
MAX_ERROR_CHARS = 16_000


class ChildArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What the pool tells a reward process on its command line (as JSON)."""

    path: str
    name: str
    base_dir: str | None = None
    parent_pid: int
    # A dataset's columns: the function's parameters are checked against them when given.
    columns: list[str] | None = None


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    """A reward process's first frame: ready (no error), or why its function did not load."""

    pid: int
    error: str | None = None


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_exactly(fd: int, size: int) -> bytes | None:
    """`size` bytes from `fd`, blocking; None at end of file before the first byte."""
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            if left == size:
                return None
            raise EOFError(f"the pool's pipe ended inside a frame ({size - left} of {size} bytes)")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> bytes | None:
    """The next frame's payload; None at end of file between frames."""
    header = read_exactly(fd, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise EOFError(f"a frame of {size} bytes is more than {MAX_FRAME_BYTES}: a broken stream")
    payload = read_exactly(fd, size)
    if payload is None:
        raise EOFError("the pool's pipe ended after a frame's header")
    return payload


def _own_frames_dropped(error: BaseException) -> BaseException:
    """`error` with the frames of this module and reward_function.py (the calling machinery)
    dropped from the top of its traceback: what is left is the user's code."""
    ours = {Path(__file__).resolve(), Path(reward_function.__file__).resolve()}
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() not in ours:
            break
        tb = tb.tb_next
    return error.with_traceback(tb)


def error_text(where: str, error: BaseException) -> str:
    """The error a call raised, as the outcome carries it: the function named, the traceback."""
    text = "".join(traceback.format_exception(_own_frames_dropped(error))).rstrip()
    text = f"{where} raised {type(error).__name__}: {error}\n{text}"
    if len(text) > MAX_ERROR_CHARS:
        text = "...\n" + text[-MAX_ERROR_CHARS:]
    return text


def serve(function: Callable[..., Any], where: str, calls_in: int, outcomes_out: int) -> None:
    """Score every call read from `calls_in` until its end, one outcome written for each."""
    decoder = msgspec.msgpack.Decoder(RewardCall)
    encoder = msgspec.msgpack.Encoder()
    while (payload := read_frame(calls_in)) is not None:
        call = decoder.decode(payload)
        started = time.monotonic()
        try:
            score, extras = checked_result(call_function(function, call), where)
            outcome = RewardOutcome(score=score, extras=extras, seconds=time.monotonic() - started)
        except (Exception, SystemExit) as error:  # the user's code: anything it raises
            outcome = RewardOutcome(
                score=None, error=error_text(where, error), seconds=time.monotonic() - started
            )
        write_all(outcomes_out, frame(encoder.encode(outcome)))


def main(argv: list[str]) -> int:
    # Before anything can print: the protocol keeps its own descriptors (not inherited by
    # anything the user's code starts), fd 1 goes to stderr and fd 0 reads nothing.
    outcomes_out = os.dup(1)
    calls_in = os.dup(0)
    os.dup2(2, 1)
    if isinstance(sys.stdout, io.TextIOWrapper):  # a line at a time, as stderr writes
        sys.stdout.reconfigure(line_buffering=True)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # Ctrl-C in a terminal reaches the whole process group: the pool decides when this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = msgspec.json.decode(argv[1], type=ChildArgs)
    die_with_parent(args.parent_pid)
    where = f"{args.path}:{args.name}"
    base_dir = None if args.base_dir is None else Path(args.base_dir)
    encoder = msgspec.msgpack.Encoder()
    try:
        if is_file_path(args.path):
            # A reward file may import the modules beside it.
            sys.path.append(str(resolve_file(args.path, base_dir).parent))
        function = load_function(args.path, args.name, base_dir=base_dir)
        if args.columns is not None:
            check_signature(function, where, args.columns)
    except ConfigError as error:
        if error.__cause__ is not None:  # the user's module raised: its traceback, to the log
            traceback.print_exception(error.__cause__, file=sys.stderr)
        write_all(outcomes_out, frame(encoder.encode(Hello(pid=os.getpid(), error=str(error)))))
        return 1
    write_all(outcomes_out, frame(encoder.encode(Hello(pid=os.getpid()))))
    serve(function, where, calls_in, outcomes_out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m timeshare.task.reward_child ARGS_JSON (started by the pool)")
    sys.exit(main(sys.argv))
