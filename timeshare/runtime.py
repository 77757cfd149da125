"""The runtime directory and its socket files; process identity from /proc.

An endpoint is ``ipc:///<runtime dir>/<name>.sock`` (same machine; the usual case) or
``tcp://host:port``; the weight channel and the command lanes bind them, the daemon's control
socket lives beside them. libzmq leaves an ipc socket file behind when a process exits, killed or
not; the binding side removes its own file on close, refuses to take over a file a live process
still listens on, and `sweep_stale_sockets` removes the files of dead processes.

A process is identified by its pid and its start time (`process_start_time`), so that a pid
reused by a later process is not taken for the one that wrote it down.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from timeshare.errors import TransferError

# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
TCP_PORT = re.compile(r"[0-9]{1,5}")
# A session's ipc socket is named with 32 bits of its id: unique among the sessions of one
# endpoint (and a receiver never reconnects, so an old name could not be mistaken anyway),
# and 9 bytes of the 107 a socket path may have.
SESSION_SUFFIX_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class Endpoint:
    url: str
    path: Path | None  # the socket file of an ipc endpoint

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        if url.startswith("ipc://"):
            raw = url.removeprefix("ipc://")
            if not raw.startswith("/"):
                raise TransferError(f"ipc endpoint needs an absolute path: {url!r}")
            if len(raw.encode()) > MAX_SOCKET_PATH:
                raise TransferError(
                    f"ipc endpoint path is {len(raw.encode())} bytes, the limit is "
                    f"{MAX_SOCKET_PATH}: {url!r}"
                )
            return cls(url, Path(raw))
        if url.startswith("tcp://"):
            host, _, port = url.removeprefix("tcp://").rpartition(":")
            port_ok = port == "*" or (TCP_PORT.fullmatch(port) and int(port) <= 65535)
            if not host or not port_ok:
                raise TransferError(
                    f"tcp endpoint must be tcp://host:port (port 0-65535, 0 or * for any free "
                    f"one), got {url!r}"
                )
            return cls(url, None)
        raise TransferError(f"endpoint must be ipc:///path or tcp://host:port, got {url!r}")

    @property
    def runtime_dir(self) -> Path | None:
        return None if self.path is None else self.path.parent

    @property
    def host(self) -> str | None:
        """A tcp endpoint's host, as written (an IPv6 address in brackets); None for ipc."""
        return None if self.path is not None else self.url.removeprefix("tcp://").rpartition(":")[0]

    @property
    def port(self) -> int | None:
        """A tcp endpoint's port (0 for any free one); None for ipc."""
        if self.path is not None:
            return None
        port = self.url.rpartition(":")[2]
        return 0 if port == "*" else int(port)

    def check_connectable(self) -> None:
        """A connecting side needs a real port: 0 or * only mean something to bind."""
        if self.port == 0:
            raise TransferError(f"cannot connect to {self.url!r}: the port is only for binding")

    def session_socket(self, session: int, port: int = 0) -> Endpoint:
        """Where the session `session` of this endpoint runs: for ipc the file beside this one
        named for the session; for tcp `port` on this endpoint's host (0 when binding: any)."""
        if self.path is None:
            return Endpoint(f"tcp://{self.host}:{port}", None)
        suffix = f".{session & SESSION_SUFFIX_MASK:08x}"
        try:
            return Endpoint.parse(f"{self.url}{suffix}")
        except TransferError as exc:
            raise TransferError(
                f"endpoint {self.url!r} leaves no room for a session's socket "
                f"({len(suffix)} bytes more): {exc}"
            ) from exc

    def member(self, index: int) -> Endpoint:
        """Where member `index` of a session with several receivers (an engine's tensor-parallel
        workers) is invited: member 0 at this endpoint itself (one receiver is today's wire),
        member k beside it: for ipc the file named for k, for tcp port + k."""
        if index == 0:
            return self
        if self.path is None:
            if self.port == 0:
                raise TransferError(
                    f"endpoint {self.url!r}: several receivers need a fixed port (member k "
                    "listens at port + k), not 0 or *"
                )
            assert self.port is not None
            return Endpoint.parse(f"tcp://{self.host}:{self.port + index}")
        try:
            return Endpoint.parse(f"{self.url}.m{index}")
        except TransferError as exc:
            raise TransferError(
                f"endpoint {self.url!r} leaves no room for member {index}'s socket: {exc}"
            ) from exc

    def is_live(self) -> bool:
        """Whether something accepts connections here now (a probe: connect, then close)."""
        if self.path is not None:
            return socket_is_live(self.path)
        assert self.host is not None
        try:
            with socket.create_connection((self.host.strip("[]"), self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def prepare_bind(self) -> None:
        """Make the runtime directory (0700) and clear a stale socket file before binding."""
        if self.path is None:
            return
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise TransferError(f"endpoint {self.url} exists and is not a socket")
        if socket_is_live(self.path):
            raise TransferError(f"endpoint {self.url} is bound by a live process")
        remove_socket_file(self.path)

    def bound_inode(self) -> int | None:
        if self.path is None:
            return None
        with contextlib.suppress(FileNotFoundError):
            return self.path.stat().st_ino
        return None

    def remove_socket_file(self, inode: int | None) -> None:
        """Remove the socket file this side bound (not one another process bound since)."""
        if self.path is not None and inode is not None and self.bound_inode() == inode:
            remove_socket_file(self.path)


def socket_is_live(path: Path) -> bool:
    """Whether a process accepts connections on the UNIX socket file `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise
        return True


def remove_socket_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sweep_stale_sockets(runtime_dir: Path, *, owners_gone: bool = False) -> list[Path]:
    """Remove socket files in `runtime_dir` on which nothing listens; return them.

    `owners_gone`: every process that could have bound one has exited, so all are stale. (An
    exited process that nobody reaped yet may still answer a connect on some kernels, gVisor's
    among them, so the probe alone would keep its socket file.)
    """
    removed: list[Path] = []
    if not runtime_dir.is_dir():
        return removed
    for entry in runtime_dir.iterdir():
        try:
            is_socket = stat.S_ISSOCK(entry.lstat().st_mode)
        except FileNotFoundError:
            continue
        if is_socket and (owners_gone or not socket_is_live(entry)):
            remove_socket_file(entry)
            removed.append(entry)
    return removed


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (from /proc), or None if it does not exist."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def running_since(pid: int) -> int | None:
    """Like `process_start_time`, but None for a zombie too: a process that has exited holds no
    memory and no mapping, even while nobody has reaped it yet."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Until every process of `pids` has exited (zombies count as exited); those that have not."""
    deadline = time.monotonic() + timeout_s
    left = [pid for pid in pids if running_since(pid) is not None]
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = [pid for pid in left if running_since(pid) is not None]
    return left


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses: fields count from the last ')'.
    return line[line.rindex(")") + 2 :].split()


def kill_group(pid: int) -> None:
    """SIGKILL the process group `pid` leads, or `pid` alone if it has none yet (a worker just
    forked, before its setsid)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    except PermissionError:
        pass  # the pid went to another user's process: not ours to kill


# Python's multiprocessing resource tracker, which a process that starts others with spawn
# starts too (one per tree): it holds the names of the named semaphores (/dev/shm/sem.mp-*) that
# its processes made, and unlinks those still there once every process it serves has exited (one
# killed before its own finalizers ran leaves them to it). Killed with the rest, it leaves them in
# /dev/shm for good: `end_groups` lets it finish first.
RESOURCE_TRACKER = "multiprocessing.resource_tracker"
TRACKERS_S = 5.0  # for the trackers to unlink and exit, once what they serve is gone


def end_groups(pgids: list[int], trackers_s: float = TRACKERS_S) -> None:
    """SIGKILL the process groups `pgids` (each pid alone that leads none yet), all but Python's
    resource trackers in them first, so that those unlink what the killed processes left; then,
    once they exited or `trackers_s` passed, what is left of the groups."""
    members = group_members(set(pgids))
    trackers = [pid for pid in members if is_resource_tracker(pid)]
    for pid in set(members) - set(trackers):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    wait_gone(trackers, trackers_s)
    for pgid in pgids:
        kill_group(pgid)


def group_members(pgids: set[int]) -> list[int]:
    """The live processes whose process group is one of `pgids` (from /proc)."""
    members = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            fields = _stat_fields(int(proc.name))
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) in pgids:
                members.append(int(proc.name))
    return members


def is_resource_tracker(pid: int) -> bool:
    try:
        return RESOURCE_TRACKER.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies, however it dies (Linux's parent-death signal).

    `parent`: the pid the parent had; if it died before the signal was armed, exit now. Without
    it, a parent already gone shows as this process having been reparented to init.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    orphaned = os.getppid() == 1 if parent is None else os.getppid() != parent
    if orphaned:
        os._exit(1)


# Shared-memory segments that processes of a job create under names of their own (an inference
# engine's, such as vLLM's message queues) are recorded here, so that whoever sweeps the runtime
# directory removes them once those processes are gone, however they died.
FOREIGN_SEGMENTS_SUFFIX = ".segments.json"
# ... and the directory their temporary files go to (TMPDIR): vLLM's and SGLang's ZMQ ipc
# socket files among them, which libzmq leaves behind at exit (in /tmp, by default, for ever).
# It goes with the record. A directory of the system's temporary one, not of the runtime dir:
# a socket path holds 107 bytes, and vLLM adds 37 to it.
FOREIGN_TEMP_PREFIX = "timeshare-tmp-"
FOREIGN_TEMP_MAKER = "maker.json"  # in such a directory: the process that made it
SHM_ROOT = Path("/dev/shm")  # noqa: S108 - POSIX shared memory lives here on Linux
SEMAPHORE_PREFIX = "sem.mp-"  # Python's named semaphores (multiprocessing's), in /dev/shm


def record_foreign_segments(
    runtime_dir: Path, owner: str, pids: list[int], names: list[str], temp: Path | None = None
) -> None:
    """Say that `names` (in /dev/shm) and the directory `temp` (`foreign_temp_dir`'s) belong to
    the processes `pids`; rewrites `owner`'s record."""
    owners = [[pid, process_start_time(pid)] for pid in pids]
    record = {"owners": owners, "segments": sorted(set(names)), "temp": str(temp or "")}
    path = runtime_dir / f"{owner}{FOREIGN_SEGMENTS_SUFFIX}"
    runtime_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)


def release_foreign_segments(runtime_dir: Path, owner: str) -> list[str]:
    """Remove `owner`'s recorded segments and its record now (its processes stopped cleanly)."""
    return _remove_record(runtime_dir / f"{owner}{FOREIGN_SEGMENTS_SUFFIX}")


def sweep_foreign_segments(runtime_dir: Path) -> list[str]:
    """Remove the recorded segments whose processes have all exited; return their paths."""
    removed: list[str] = []
    if not runtime_dir.is_dir():
        return removed
    for path in runtime_dir.glob(f"*{FOREIGN_SEGMENTS_SUFFIX}"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        # A zombie maps nothing: an owner killed but not yet reaped is gone already.
        owners = record.get("owners", [])
        alive = [pid for pid, start in owners if start is not None and running_since(pid) == start]
        if not alive:
            removed += _remove_record(path)
    return removed


def foreign_temp_dir(owner: str) -> Path:
    """A new directory for `owner`'s processes' temporary files (record it: its record's
    release or sweep removes it). It names this process in a file of its own, so that
    `sweep_foreign_temp_dirs` removes it once this process is gone, should the record be lost
    (a runtime dir deleted after a SIGKILL). (In the directory, not in its name: a socket's
    path holds 107 bytes, and vLLM adds 37 to the directory's.)"""
    me = os.getpid()
    maker = {"pid": me, "start": process_start_time(me), "pid_namespace": pid_namespace()}
    temp = Path(tempfile.mkdtemp(prefix=f"{FOREIGN_TEMP_PREFIX}{owner}-"))
    try:
        (temp / FOREIGN_TEMP_MAKER).write_text(json.dumps(maker))
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # (no sweep could ever tell it was ours)
        raise
    return temp


def sweep_foreign_temp_dirs(root: Path | None = None) -> list[str]:
    """Remove the directories `foreign_temp_dir` made (in `root`, the system's temporary
    directory by default) for processes that are gone; return their paths. One made in
    another pid namespace (a container sharing /tmp) is not this one's to judge."""
    removed = []
    for path in (root or Path(tempfile.gettempdir())).glob(f"{FOREIGN_TEMP_PREFIX}*"):
        try:
            maker = json.loads((path / FOREIGN_TEMP_MAKER).read_text())
            pid, start, namespace = maker["pid"], maker["start"], maker["pid_namespace"]
        except (OSError, ValueError, TypeError, KeyError):
            continue  # not one it made, or not readable: left alone
        if namespace != pid_namespace() or running_since(pid) == start:
            continue
        with contextlib.suppress(OSError):
            if path.lstat().st_uid == os.getuid():
                shutil.rmtree(path)  # (refuses a symbolic link)
                removed.append(str(path))
    return removed


def pid_namespace() -> int:
    """This process's pid namespace (its inode): where the pids it sees mean what they say."""
    return os.stat("/proc/self/ns/pid").st_ino


def _remove_record(path: Path) -> list[str]:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except ValueError:
        record = {}
    removed = []
    temp = Path(str(record.get("temp") or ""))
    # only a directory `foreign_temp_dir` made: a record names nothing else to remove
    if temp.is_absolute() and temp.name.startswith(FOREIGN_TEMP_PREFIX) and temp.is_dir():
        shutil.rmtree(temp, ignore_errors=True)
        removed.append(str(temp))
    for name in record.get("segments", []):
        if "/" in name:  # a name, never a path: nothing outside /dev/shm is ever removed
            continue
        try:
            (SHM_ROOT / name).unlink()
            removed.append(str(SHM_ROOT / name))
        except FileNotFoundError:
            pass
    path.unlink(missing_ok=True)
    return removed


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant of it alive now (from /proc)."""
    tree = [pid]
    for parent in tree:
        tree += children_of(parent)
    return tree


def children_of(pid: int) -> list[int]:
    """The children of process `pid` (any of its threads started them), from /proc."""
    children = []
    for listed in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(child) for child in listed.read_text().split()]
        except (OSError, ValueError):
            continue
    return children


def mapped_segments(pid: int, prefix: str) -> list[str]:
    """Names of the /dev/shm files starting with `prefix` that process `pid` maps."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    names = set()
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.startswith(f"{SHM_ROOT}/{prefix}"):
            names.add(path[len(str(SHM_ROOT)) + 1 :].removesuffix(" (deleted)"))
    return sorted(names)


def mapped_anywhere(names: set[str], *, excluding: frozenset[int] = frozenset()) -> set[str]:
    """Those of `names` (files in /dev/shm) that a live process of this machine maps (but the
    processes `excluding`), under any name: a named semaphore's maker maps it by the temporary
    name it made it under, which shows as deleted in its maps (glibc makes it whole under that
    name, then links the real one)."""
    inodes: dict[int, str] = {}
    for name in names:
        with contextlib.suppress(OSError):
            inodes[(SHM_ROOT / name).stat().st_ino] = name
    mapped: set[str] = set()
    for proc in Path("/proc").iterdir():
        if inodes and proc.name.isdigit() and int(proc.name) not in excluding:
            mapped.update(inodes[inode] for inode in _shm_inodes(proc) if inode in inodes)
    return mapped


def _shm_inodes(proc: Path) -> set[int]:
    """The inodes of the /dev/shm files the process `proc` (/proc/<pid>) maps."""
    try:
        maps = (proc / "maps").read_text()
    except OSError:
        return set()
    inodes = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(f"{SHM_ROOT}/"):
            inodes.add(int(fields[4]))
    return inodes


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid` (from /proc), or None if it does not exist."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def reap(children: list[int], timeout_s: float) -> list[int]:
    """Wait for those of this process's `children` that exit within `timeout_s`; a child that
    is not this process's (or was reaped already) is skipped. Returns those still running."""
    deadline = time.monotonic() + timeout_s
    left = list(children)
    while left:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done == pid:
                left.remove(pid)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return left
