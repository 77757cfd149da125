"""The worker factory: one process that loads the worker's code once and forks each worker.

Importing a worker's code (torch above all) costs about 2 s of CPU; a job of N ranks paid it 2N
times at every start. The zygote pays it once per cycle and forks each worker in milliseconds:

    python -m timeshare.cycle.zygote RUNTIME_DIR          (the directory only names the job)

It reads one `ForkRequest` per line on stdin, forks, and answers on the file descriptor
`--replies` names: `Forked` (or `Refused`), and `Exited` the moment a worker exits (SIGCHLD).
JSON lines of typed Structs (factory.py), never pickle.

A forked worker starts its own session (its own process group: a kill of the group takes its
children too), names itself `ts-<role>-<rank>` for `ps`, dies with the zygote (parent-death
signal), and leaves the zygote's pipes alone. The zygote stays single-threaded and touches no
tensor, so forking it is safe. When its stdin closes (the driver is done, or was killed), it
kills every worker group it started and exits: no worker outlives its driver by more than that.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import selectors
import signal
import sys
import time
import traceback

import msgspec

from timeshare.cycle.factory import Exited, Forked, ForkRequest, Refused, Reply
from timeshare.engines.worker import WorkerSpec, run
from timeshare.runtime import die_with_parent, end_groups

PR_SET_NAME = 15
NAME_LIMIT = 15  # bytes of a task's name, not counting its NUL
_requests = msgspec.json.Decoder(ForkRequest)
REAP_S = 5.0  # for the killed workers to be reaped before the zygote exits (factory.py waits)


def main() -> None:
    parser = argparse.ArgumentParser(prog="timeshare.cycle.zygote")
    parser.add_argument("runtime_dir", help="the job's runtime directory (names the job)")
    parser.add_argument("--replies", type=int, required=True, help="descriptor for the replies")
    args = parser.parse_args()
    _set_name("ts-zygote")
    Zygote(sys.stdin.fileno(), args.replies).serve()


class Zygote:
    def __init__(self, requests_fd: int, replies_fd: int) -> None:
        self.selector: selectors.BaseSelector | None = None
        self.requests_fd = requests_fd
        self.replies_fd = replies_fd
        self.children: set[int] = set()
        self.unread = b""  # requests read but not yet a whole line
        self.wakeup_r, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_w, False)
        signal.set_wakeup_fd(self.wakeup_w)  # SIGCHLD wakes the loop below
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def serve(self) -> None:
        self.selector = selector = selectors.DefaultSelector()
        selector.register(self.requests_fd, selectors.EVENT_READ)
        selector.register(self.wakeup_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in selector.select():
                    if key.fileobj == self.wakeup_r:
                        os.read(self.wakeup_r, 4096)
                    elif not self._take_requests():
                        return
                self._reap()
        finally:
            self._kill_children()

    def _take_requests(self) -> bool:
        """Fork a worker per whole request line; False once the driver closed the requests."""
        data = os.read(self.requests_fd, 1 << 16)
        if not data:
            return False
        *lines, self.unread = (self.unread + data).split(b"\n")
        for line in lines:
            self._fork(line)
        return True

    def _fork(self, line: bytes) -> None:
        try:
            request = _requests.decode(line)
        except msgspec.DecodeError as exc:  # ValidationError included
            self._reply(Refused(f"a bad request: {exc}"))
            return
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._become_worker(request.spec, zygote)
        self.children.add(pid)
        self._reply(Forked(request.request_id, pid))

    def _become_worker(self, spec: WorkerSpec, zygote: int) -> None:
        """In the forked child: cut every tie to the zygote's loop, then run the worker."""
        code = 1
        try:
            os.setsid()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with_parent(zygote)
            _set_name(f"ts-{spec.role}-{spec.rank}")
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)  # stdin was the zygote's request pipe
            if self.selector is not None:
                self.selector.close()  # its epoll descriptor is the zygote's, not the worker's
            for fd in (devnull, self.replies_fd, self.wakeup_r, self.wakeup_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            run(spec)
            code = 0
        except SystemExit as exc:  # sys.exit() is 0, sys.exit(n) is n, sys.exit("why") is 1
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self._reply(Exited(pid, os.waitstatus_to_exitcode(status)))

    def _kill_children(self) -> None:
        """Every worker group still alive is killed, and every worker reaped (no zombies)."""
        end_groups(list(self.children))
        deadline = time.monotonic() + REAP_S
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)

    def _reply(self, reply: Reply) -> None:
        with contextlib.suppress(OSError):  # the driver is gone: nobody to tell
            os.write(self.replies_fd, msgspec.json.encode(reply) + b"\n")


def _set_name(name: str) -> None:
    """The name `ps` and /proc/<pid>/comm show."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode()[:NAME_LIMIT])


if __name__ == "__main__":
    main()
