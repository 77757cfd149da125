"""`timesharectl`: operate a running `timeshared` through its control socket.

    timesharectl [--socket PATH] [--timeout S] status [--json]
    timesharectl pause [--wait] | resume | drain [--wait] | stop | reload
    timesharectl watch [--json]          stream transitions until interrupted
    timesharectl log-level LEVEL

The socket is --socket, else $TIMESHARE_SOCKET, else /run/timeshared/control.sock (the unit
files' path). Exit codes: 0 done, 1 the daemon refused (its error's name, message and state
are printed), 2 no daemon answered or the answer was not understood.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec

from timeshare.errors import DaemonRefused, NoDaemon
from timeshare.levels import LOG_LEVELS

DEFAULT_SOCKET = "/run/timeshared/control.sock"
EXIT_REFUSED = 1
EXIT_NO_DAEMON = 2
_ids = itertools.count(1)
V = TypeVar("V", bound=msgspec.Struct)


# -- what this client reads of the daemon's answers ----------------------------------------------
# Each field is optional (a missing one shows as the daemon would have left it: None, or a dash),
# but one of the wrong type is an answer not understood (exit 2), naming the field. The shapes
# are the daemon's: ServiceStatus (protocols/control.py), StepFigures (cycle/steps.py),
# NodeRecord and NodeSeen.view (protocols/nodes.py), the journal's transition entries.


class _RankSent(msgspec.Struct, frozen=True):
    rank: int | None = None
    sent_bytes: int | None = None
    loaded_bytes: list[int] | None = None


class _Sync(msgspec.Struct, frozen=True):
    gbps: float | None = None  # null: msgspec writes a NaN or an infinity so


class _LastStep(msgspec.Struct, frozen=True):
    step: int | None = None
    phases: dict[str, float] = {}
    sync: _Sync | None = None
    per_rank: list[_RankSent] | None = None
    reward_mean: float | None = None
    rollout_resident_mb: float | None = None


class _Node(msgspec.Struct, frozen=True):
    node: int
    ranks: list[int] | None = None
    host: str | None = None
    pid: int | None = None
    lifecycle: str | None = None
    step: int | None = None
    phases: list[str] | None = None
    beat_age_s: float | None = None
    silent: bool | None = None


class _Status(msgspec.Struct, frozen=True):
    lifecycle: str | None = None
    step: int | None = None
    steps: int | None = None
    committed_step: int | None = None
    weight_version: int | None = None
    phases: list[str] | None = None
    uptime_s: float | None = None
    engine: str | None = None
    ranks: int | None = None
    last_step: dict[str, object] | None = None  # read as _LastStep unless empty
    reason: str | None = None
    metrics_port: int | None = None
    pid: int | None = None
    nodes: list[_Node] | None = None


class _Event(msgspec.Struct, frozen=True):
    kind: str | None = None
    lifecycle: str | None = None
    step: int | None = None
    phases: list[str] = []
    reason: str | None = None


class _Reloaded(msgspec.Struct, frozen=True):
    changed: dict[str, object] = {}


class _LogLevelSet(msgspec.Struct, frozen=True):
    log_level: str | None = None


def _read(value: object, shape: type[V], what: str) -> V:
    """`value`, decoded JSON from the daemon, as `shape`; else the answer is not understood."""
    try:
        return msgspec.convert(value, shape)
    except msgspec.ValidationError as exc:
        raise NoDaemon(f"the daemon's {what} was not understood: {exc}") from exc


class Client:
    """One connection; `call` sends a request and returns its result (blocking, with a deadline)."""

    def __init__(self, path: Path, timeout_s: float | None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            raise NoDaemon(f"cannot connect to {path}: {exc}") from exc
        self.lines = self.sock.makefile("rb")

    def send(self, method: str, params: dict[str, object] | None = None) -> int:
        request_id = next(_ids)
        request = {"id": request_id, "method": method, "params": params or {}}
        self.sock.sendall(msgspec.json.encode(request) + b"\n")
        return request_id

    def receive(self) -> dict[str, object]:
        try:
            line = self.lines.readline()
        except TimeoutError as exc:
            raise NoDaemon("no answer within the deadline") from exc
        if not line:
            raise NoDaemon("the daemon closed the connection")
        try:
            reply = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise NoDaemon(f"not a reply: {line[:200]!r}") from exc
        if not isinstance(reply, dict):
            raise NoDaemon(f"not a reply: {line[:200]!r}")
        if "error" in reply:
            raise DaemonRefused(reply["error"])
        return reply

    def call(self, method: str, params: dict[str, object] | None = None) -> object:
        """The request's result: decoded JSON, for the caller to read as the shape it expects."""
        self.send(method, params)
        return self.receive().get("result")

    def events(self) -> Iterator[object]:
        self.send("watch")
        while True:
            yield self.receive().get("event", {})

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path = Path(args.socket or os.environ.get("TIMESHARE_SOCKET") or DEFAULT_SOCKET)
    wait = getattr(args, "wait", False)
    # A wait runs inside the daemon for args.timeout; the socket waits a little longer.
    timeout_s = args.timeout + 10.0 if wait else args.timeout
    try:
        client = Client(path, None if args.command == "watch" else timeout_s)
        try:
            return _run(client, args)
        finally:
            client.close()
    except DaemonRefused as exc:
        print(f"timesharectl: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (NoDaemon, OSError) as exc:
        print(f"timesharectl: {exc}", file=sys.stderr)
        return EXIT_NO_DAEMON
    except KeyboardInterrupt:
        return 0  # the end of a watch


def _run(client: Client, args: argparse.Namespace) -> int:
    command = args.command
    if command == "watch":
        for event in client.events():
            print(msgspec.json.encode(event).decode() if args.json else _event_line(event))
            sys.stdout.flush()
        return 0
    if command == "status":
        status = client.call("status")
        print(msgspec.json.encode(status).decode() if args.json else status_table(status))
        return 0
    if command == "log-level":
        result = client.call("set_log_level", {"level": args.level})
    elif command in ("pause", "drain"):
        result = client.call(command, {"wait": args.wait, "timeout_s": args.timeout})
    else:
        result = client.call(command)
    if command == "reload":
        changed = _read(result, _Reloaded, "reload answer").changed
        print("reloaded: " + (", ".join(f"{k} = {v}" for k, v in changed.items()) or "no change"))
    elif command == "log-level":
        print(f"log level: {_read(result, _LogLevelSet, 'log-level answer').log_level}")
    else:
        status = (
            _read(result.get("status", result), _Status, "status")
            if isinstance(result, dict)
            else _Status()
        )
        print(f"{command}: {status.lifecycle} at step {status.step}")
    return 0


def status_table(answer: object) -> str:
    """`timesharectl status` for people, from the daemon's answer (decoded JSON)."""
    status = _read(answer, _Status, "status")
    rows: list[tuple[str, object]] = [
        ("lifecycle", status.lifecycle),
        ("step", f"{_dash(status.step)} of {status.steps}"),
        ("committed step", _dash(status.committed_step)),
        ("weight version", _dash(status.weight_version)),
        ("phases", ", ".join(status.phases or []) or "-"),
        ("uptime", _duration(float(status.uptime_s or 0.0))),
        ("engine", f"{status.engine} x {status.ranks} ranks"),
    ]
    if status.last_step:
        last = _read(status.last_step, _LastStep, "last step")
        phases = "  ".join(f"{p} {s * 1000:.1f} ms" for p, s in last.phases.items())
        rows.append((f"last step ({last.step})", phases or "-"))
        gbps = last.sync.gbps if last.sync is not None else None
        rows.append(("sync", "-" if gbps is None else f"{gbps:.3f} GB/s"))
        rows += [("sync bytes", line) for line in _sync_bytes(last.per_rank or [])]
        if last.reward_mean is not None:
            rows.append(("reward", f"{last.reward_mean:.3f}"))
        if last.rollout_resident_mb:  # an engine that cannot release memory says so
            resident = f"{last.rollout_resident_mb:.1f} MiB (the rollout engine cannot release it)"
            rows.append(("resident while asleep", resident))
    if status.reason:
        rows.append(("reason", status.reason))
    if status.metrics_port:
        rows.append(("metrics", f"http://127.0.0.1:{status.metrics_port}/metrics"))
    rows.append(("pid", status.pid))
    rows += [(f"node {node.node}", _node_line(node)) for node in status.nodes or []]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _sync_bytes(per_rank: list[_RankSent]) -> list[str]:
    """Per rank: the bytes sent into its rollout engine and, for a tensor-parallel engine,
    what reached each worker's loader."""
    lines = []
    for rank in per_rank:
        line = f"rank {rank.rank}: sent {_mib(rank.sent_bytes)}"
        loaded = rank.loaded_bytes or []
        if loaded:
            line += (
                ", loaded " + " / ".join(_mib(b) for b in loaded) + f" by {len(loaded)} TP workers"
            )
        lines.append(line)
    return lines


def _mib(nbytes: int | None) -> str:
    return f"{float(nbytes or 0) / (1 << 20):.2f} MiB"


def _node_line(node: _Node) -> str:
    """One node of several: its ranks, where it stands, and whether its daemon beats."""
    ranks = node.ranks or []
    span = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no ranks"
    phases = ",".join(node.phases or []) or "-"
    age = float(node.beat_age_s or 0.0)  # on the reporting daemon's clock
    alive = f"silent for {age:.0f} s" if node.silent else "alive"  # past deadlines.node_s
    where = f"{node.host} pid {node.pid}"
    return f"{span}  {node.lifecycle} step {node.step}  {phases}  {alive} ({where})"


def _event_line(answer: object) -> str:
    event = _read(answer, _Event, "event")
    if event.kind == "transition":
        phases = ",".join(event.phases)
        return f"{event.lifecycle:<9} step {event.step}  {phases}"
    return f"{event.kind}: {event.lifecycle}" + (f" ({event.reason})" if event.reason else "")


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timesharectl", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", help=f"control socket (default {DEFAULT_SOCKET})")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (600)")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="where the job stands")
    status.add_argument("--json", action="store_true", help="the daemon's answer as JSON")
    for name, text in (
        ("pause", "pause at the next cycle boundary, engines asleep"),
        ("drain", "stop the cycle at the next safe point; the daemon stays up"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--wait", action="store_true", help="return once it took effect")
    commands.add_parser("reload", help="re-read the config file (answers once it is applied)")
    commands.add_parser("resume", help="resume a paused job (or start the remaining steps)")
    commands.add_parser("stop", help="drain and exit the daemon")
    watch = commands.add_parser("watch", help="stream transitions until interrupted")
    watch.add_argument("--json", action="store_true", help="one JSON object per line")
    level = commands.add_parser("log-level", help="set the daemon's log level")
    level.add_argument("level", choices=LOG_LEVELS)
    return parser


if __name__ == "__main__":
    sys.exit(main())
