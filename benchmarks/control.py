"""Control-socket latency under load: clients polling `status` while 256 MiB syncs run.

    python benchmarks/control.py --clients 20 --interval 0.1 --json runs/control.json

Starts a real `timeshared` (simulated engines, one rank, 16 tensors of 16 MiB = 256 MiB of
weights moved every SYNC through the weight channel), waits until it runs, then has --clients
threads each poll `status` on its own connection for --seconds, one request every --interval
seconds (0: back to back, which saturates the daemon's loop on a small machine). Reports the
round trip (p50, p99, max) over all requests and over those answered while a SYNC ran, the
daemon's largest event-loop lag (its own probe, `loop_lag_max_ms` in status), and the syncs.
Target: p99 round trip under 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TARGET_P99_MS = 10.0
CONFIG = """
[job]
ranks = 1
steps = 1000000
runtime_dir = "{root}/run"
checkpoint_dir = "{root}/checkpoints"

[deadlines]
phase_s = 120.0
stall_s = 60.0

[transfer]
bucket_mb = 64.0
pipeline_depth = 2
ack_timeout_s = 60.0
finalize_timeout_s = 60.0
handshake_timeout_s = 60.0
begin_timeout_s = 60.0

[engine]
trainer = "simulated"
rollout = "simulated"

[engine.simulated]
account_memory = false
tensors = 16
tensor_numel = 4194304

[daemon]
state_dir = "{root}/state"
metrics_port = 0
max_clients = 256

[log]
level = "warning"
"""


class Poller(threading.Thread):
    def __init__(self, path: Path, until: float, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.path, self.until, self.interval_s = path, until, interval_s
        self.samples: list[tuple[float, bool]] = []  # (round trip s, a SYNC was running)

    def run(self) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(30)
            client.connect(str(self.path))
            reader = client.makefile("rb")
            request = b'{"id": 1, "method": "status"}\n'
            while time.monotonic() < self.until:
                started = time.perf_counter()
                client.sendall(request)
                reply = json.loads(reader.readline())
                elapsed = time.perf_counter() - started
                self.samples.append((elapsed, "sync" in reply["result"]["phases"]))
                time.sleep(max(self.interval_s - elapsed, 0.0))


def call(path: Path, method: str) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(30)
        client.connect(str(path))
        client.sendall(json.dumps({"id": 1, "method": method}).encode() + b"\n")
        reply: dict[str, Any] = json.loads(client.makefile("rb").readline())
        return reply


def wait_running(path: Path, process: subprocess.Popen[bytes]) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"timeshared exited with {process.returncode}")
        try:
            status: dict[str, Any] = call(path, "status")["result"]
            if status["lifecycle"] == "running" and (status["weight_version"] or 0) >= 1:
                return status
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("timeshared did not start running within 120 s")


def summarise(times: list[float]) -> dict[str, float]:
    if not times:
        return {"n": 0}
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": p99 * 1000,
        "max_ms": ordered[-1] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between polls")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ts-ctl-", dir="/tmp") as directory:
        root = Path(directory)
        config = root / "timeshared.toml"
        config.write_text(CONFIG.format(root=root))
        path = root / "run" / "control.sock"
        process = subprocess.Popen(
            [sys.executable, "-m", "timeshare.daemon", "--config", str(config)],
            stderr=subprocess.DEVNULL,
        )
        try:
            before = wait_running(path, process)
            until = time.monotonic() + args.seconds
            pollers = [Poller(path, until, args.interval) for _ in range(args.clients)]
            for poller in pollers:
                poller.start()
            for poller in pollers:
                poller.join(timeout=args.seconds + 60)
            after = call(path, "status")["result"]
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    samples = [s for p in pollers for s in p.samples]
    result = {
        "clients": args.clients,
        "interval_s": args.interval,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
        "weights_mb": 256,
        "syncs": (after["weight_version"] or 0) - (before["weight_version"] or 0),
        "all": summarise([t for t, _ in samples]),
        "during_sync": summarise([t for t, syncing in samples if syncing]),
        "loop_lag_max_ms": after["loop_lag_max_ms"],
        "target_p99_ms": TARGET_P99_MS,
        "last_sync_gbps": (after.get("last_step") or {}).get("sync_gbps"),
    }
    print(
        f"{args.clients} clients polling status every {args.interval:g} s for {args.seconds:g} s;"
        f" {result['syncs']} syncs of 256 MiB"
    )
    print(f"{'requests':<12} {'n':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name in ("all", "during_sync"):
        row = result[name]
        if row["n"]:
            print(
                f"{name:<12} {row['n']:>7} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
                f"{row['max_ms']:>8.2f}"
            )
    print(f"largest event-loop lag: {result['loop_lag_max_ms']:.2f} ms")
    verdict = "met" if result["all"].get("p99_ms", 1e9) < TARGET_P99_MS else "missed"
    print(f"target p99 < {TARGET_P99_MS:g} ms: {verdict}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
