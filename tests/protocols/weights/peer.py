"""A weight-channel peer in its own process, for tests: `python -m tests.protocols.weights.peer`.

Reads one JSON object from argv[1] and prints one JSON line per event on stdout:
{"event": "received", ...} / {"event": "sent", ...} / {"event": "error", "type", "message"}.
Behaviours (`mode`) make it fail the way a real engine or trainer would: raise in on_bucket,
raise in finalize (at once, or after `finalize_sleep_s`), take `finalize_sleep_s` to finalize,
keep a view of staging, hang, or SIGKILL itself mid-transfer.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import structlog
import torch

from timeshare.protocols.weights import TransferConfig, WeightReceiver, WeightSender

structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def digest(tensor: torch.Tensor) -> list[Any]:
    """dtype, shape and a hash of the bytes: equal digests mean bit-identical tensors."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return [
        str(tensor.dtype),
        list(tensor.shape),
        hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest(),
    ]


def make_weights(spec: str, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weight sets both sides (and the test) can rebuild from (spec, seed)."""
    gen = torch.Generator().manual_seed(seed)
    if spec == "all_dtypes":
        return all_dtypes(gen)
    if spec.startswith("mb:"):  # mb:<total MiB>:<tensor MiB>
        total_mb, tensor_mb = (float(x) for x in spec[3:].split(":"))
        count = max(1, int(total_mb / tensor_mb))
        numel = int(tensor_mb * 2**20 / 4)
        return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(count)}
    raise ValueError(f"unknown weight spec {spec!r}")


def all_dtypes(gen: torch.Generator) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    base = torch.randn(37, 29, generator=gen)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        out[f"float.{dtype}"] = base.to(dtype)
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        out[f"int.{dtype}"] = torch.randint(
            -100 if dtype != torch.uint8 else 0, 100, (41, 3), generator=gen
        ).to(dtype)
    out["bool"] = torch.rand(17, generator=gen) > 0.5
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            out[f"fp8.{name}"] = base.clamp(-8, 8).to(getattr(torch, name))
    out["empty"] = torch.empty(0, 7)
    out["empty.int"] = torch.empty(3, 0, dtype=torch.int64)
    out["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    out["scalar.int"] = torch.tensor(7, dtype=torch.int32)
    out["noncontig.t"] = torch.randn(64, 48, generator=gen).t()
    out["noncontig.slice"] = torch.randn(40, 40, generator=gen)[::3, 1::2]
    out["noncontig.expand"] = torch.randn(5, 1, generator=gen).expand(5, 9)
    # Larger than the small buckets the tests use: split and reassembled.
    out["big.fp32"] = torch.randn(300, 1000, generator=gen)
    out["big.bf16.noncontig"] = torch.randn(1200, 400, generator=gen).bfloat16().t()
    out["after.big"] = torch.randn(10, generator=gen)
    return out


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def run_receiver(args: dict[str, Any]) -> None:
    cfg = TransferConfig(**args["config"])
    mode: str = args.get("mode", "ok")
    fail_bucket: int = args.get("bucket", 1)
    expected = args.get("expected_names")
    kept: list[torch.Tensor] = []
    if "start_when" in args:  # started early (imports done), connects when the file appears
        wait_for_file(args["start_when"])
    receiver = WeightReceiver(
        args["endpoint"],
        cfg,
        device=args.get("device", "cpu"),
        member=args.get("member", 0),
        members=args.get("members", 1),
    )
    with receiver:
        emit(event="ready", pid=os.getpid())
        if "receive_when" in args:  # connected (invitations queue up), not yet receiving
            wait_for_file(args["receive_when"])
        for _ in range(args.get("transfers", 1)):
            loader = FaultyLoader(
                mode,
                fail_bucket,
                kept,
                args.get("finalize_sleep_s", 3.0),
                hang_s=args.get("hang_s", 3600.0),
                hang_until=args.get("hang_until"),
            )
            try:
                report = receiver.receive(
                    loader.on_bucket, loader.finalize, expected_names=expected
                )
            except Exception as exc:
                emit(event="error", type=type(exc).__name__, message=str(exc))
                return
            emit(
                event="received",
                version=report.version,
                bytes=report.bytes,
                tensors=report.tensors,
                buckets=report.buckets,
                checksummed=report.checksummed,
                digests=loader.digests,
                devices=sorted(loader.devices),
            )


def wait_for_file(path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


class FaultyLoader:
    """An engine's loading callbacks, failing in the way `mode` says at bucket `fail_bucket`."""

    def __init__(
        self,
        mode: str,
        fail_bucket: int,
        kept: list[torch.Tensor],
        sleep_s: float,
        *,
        hang_s: float,
        hang_until: str | None = None,
    ) -> None:
        self.mode = mode
        self.fail_bucket = fail_bucket
        self.kept = kept
        self.sleep_s = sleep_s
        self.hang_s = hang_s
        self.hang_until = hang_until
        self.buckets = 0
        self.digests: dict[str, list[Any]] = {}
        self.devices: set[str] = set()  # where the tensors it was handed live

    def on_bucket(self, items: list[tuple[str, torch.Tensor]]) -> None:
        index = self.buckets
        self.buckets += 1
        if index == self.fail_bucket:
            if self.mode == "raise_on_bucket":
                raise RuntimeError(f"engine failed to load bucket {index}")
            if self.mode == "kill_on_bucket":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "hang_on_bucket":
                if self.hang_until is not None:  # stuck until the test lets it go
                    wait_for_file(self.hang_until, timeout_s=self.hang_s)
                else:  # an engine stuck, for a while or for good
                    time.sleep(self.hang_s)
            if self.mode == "keep_view":
                self.kept.append(items[0][1])
        self.devices.update(tensor.device.type for _, tensor in items)
        if self.mode == "sink":
            return
        for name, tensor in items:
            self.digests[name] = digest(tensor)

    def finalize(self) -> None:
        if self.mode in ("slow_finalize", "slow_raise_in_finalize"):
            time.sleep(self.sleep_s)
        if self.mode in ("raise_in_finalize", "slow_raise_in_finalize"):
            raise ValueError("post-load processing failed")


async def run_sender(args: dict[str, Any]) -> None:
    cfg = TransferConfig(**args["config"])
    weights = make_weights(args["spec"], args.get("seed", 0))
    kill_after = args.get("kill_after_tensors")

    async def stream() -> AsyncIterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(weights.items()):
            if kill_after is not None and i == kill_after:
                await anyio.sleep(0.2)  # let the last header reach the receiver
                os.kill(os.getpid(), signal.SIGKILL)
            yield item

    with WeightSender(args["endpoint"], cfg, receivers=args.get("receivers", 1)) as sender:
        emit(event="ready", pid=os.getpid())
        for version in range(args.get("transfers", 1)):
            try:
                report = await sender.send(stream(), version=version)
            except Exception as exc:
                emit(event="error", type=type(exc).__name__, message=str(exc))
                return
            emit(event="sent", version=report.version, bytes=report.bytes, buckets=report.buckets)


def main() -> None:
    args = json.loads(sys.argv[1])
    if args["role"] == "receiver":
        run_receiver(args)
    else:
        anyio.run(run_sender, args)


if __name__ == "__main__":
    main()
