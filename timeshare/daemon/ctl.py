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
from typing import Any

import msgspec

from timeshare.errors import DaemonRefused, NoDaemon
from timeshare.levels import LOG_LEVELS

DEFAULT_SOCKET = "/run/timeshared/control.sock"
EXIT_REFUSED = 1
EXIT_NO_DAEMON = 2
_ids = itertools.count(1)


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

    def send(self, method: str, params: dict[str, Any] | None = None) -> int:
        request_id = next(_ids)
        request = {"id": request_id, "method": method, "params": params or {}}
        self.sock.sendall(msgspec.json.encode(request) + b"\n")
        return request_id

    def receive(self) -> dict[str, Any]:
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

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        self.send(method, params)
        return self.receive().get("result")

    def events(self) -> Iterator[dict[str, Any]]:
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
    status = result.get("status", result) if isinstance(result, dict) else {}
    if command == "reload":
        changed = result.get("changed", {})
        print("reloaded: " + (", ".join(f"{k} = {v}" for k, v in changed.items()) or "no change"))
    elif command == "log-level":
        print(f"log level: {result.get('log_level')}")
    else:
        print(f"{command}: {status.get('lifecycle')} at step {status.get('step')}")
    return 0


def status_table(status: dict[str, Any]) -> str:
    """`timesharectl status` for people."""
    rows = [
        ("lifecycle", status.get("lifecycle")),
        ("step", f"{_dash(status.get('step'))} of {status.get('steps')}"),
        ("committed step", _dash(status.get("committed_step"))),
        ("weight version", _dash(status.get("weight_version"))),
        ("phases", ", ".join(status.get("phases") or []) or "-"),
        ("uptime", _duration(float(status.get("uptime_s") or 0.0))),
        ("engine", f"{status.get('engine')} x {status.get('ranks')} ranks"),
    ]
    last = status.get("last_step")
    if last:
        phases = "  ".join(f"{p} {s * 1000:.1f} ms" for p, s in last.get("phases", {}).items())
        rows.append((f"last step ({last.get('step')})", phases or "-"))
        gbps = (last.get("sync") or {}).get("gbps")
        rows.append(("sync", "-" if gbps is None else f"{gbps:.3f} GB/s"))
        rows += [("sync bytes", line) for line in _sync_bytes(last.get("per_rank") or [])]
        if last.get("reward_mean") is not None:
            rows.append(("reward", f"{last['reward_mean']:.3f}"))
        if last.get("rollout_resident_mb"):  # an engine that cannot release memory says so
            resident = (
                f"{last['rollout_resident_mb']:.1f} MiB (the rollout engine cannot release it)"
            )
            rows.append(("resident while asleep", resident))
    if status.get("reason"):
        rows.append(("reason", status["reason"]))
    if status.get("metrics_port"):
        rows.append(("metrics", f"http://127.0.0.1:{status['metrics_port']}/metrics"))
    rows.append(("pid", status.get("pid")))
    rows += [(f"node {node['node']}", _node_line(node)) for node in status.get("nodes") or []]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _sync_bytes(per_rank: list[dict[str, Any]]) -> list[str]:
    """Per rank: the bytes sent into its rollout engine and, for a tensor-parallel engine,
    what reached each worker's loader."""
    lines = []
    for rank in per_rank:
        line = f"rank {rank.get('rank')}: sent {_mib(rank.get('sent_bytes'))}"
        loaded = rank.get("loaded_bytes") or []
        if loaded:
            line += (
                ", loaded " + " / ".join(_mib(b) for b in loaded) + f" by {len(loaded)} TP workers"
            )
        lines.append(line)
    return lines


def _mib(nbytes: Any) -> str:
    return f"{float(nbytes or 0) / (1 << 20):.2f} MiB"


def _node_line(node: dict[str, Any]) -> str:
    """One node of several: its ranks, where it stands, and whether its daemon beats."""
    ranks = node.get("ranks") or []
    span = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no ranks"
    phases = ",".join(node.get("phases") or []) or "-"
    age = float(node.get("beat_age_s") or 0.0)  # on the reporting daemon's clock
    alive = f"silent for {age:.0f} s" if node.get("silent") else "alive"  # past deadlines.node_s
    where = f"{node.get('host')} pid {node.get('pid')}"
    return f"{span}  {node.get('lifecycle')} step {node.get('step')}  {phases}  {alive} ({where})"


def _event_line(event: dict[str, Any]) -> str:
    kind = event.get("kind")
    if kind == "transition":
        phases = ",".join(event.get("phases", []))
        return f"{event.get('lifecycle'):<9} step {event.get('step')}  {phases}"
    return f"{kind}: {event.get('lifecycle')}" + (
        f" ({event['reason']})" if event.get("reason") else ""
    )


def _dash(value: Any) -> str:
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
