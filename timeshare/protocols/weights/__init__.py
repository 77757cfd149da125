"""The weight channel: trainer weights into a rollout engine through shared staging.

    sender = WeightSender("ipc:///run/timeshare/w-rank0.sock", TransferConfig())
    report = await sender.send(model.named_parameters(), version=7)

    receiver = WeightReceiver("ipc:///run/timeshare/w-rank0.sock", TransferConfig())
    report = receiver.receive(on_bucket, finalize=None, expected_names=None)

ZMQ carries small typed headers and ACKs; the bytes sit in staging that both processes map
(staging.py, shm.py). A pair is a session: staging is set up by the first transfer and reused
until `close()`. `sweep_stale` removes what a killed process left in a runtime directory
(segments.py, and socket files).

The settings, the report and `sweep_stale` import without torch or zmq: the job config embeds
`TransferConfig`, and reading a config must not load them. `WeightSender`, `WeightReceiver` and
`LentTensor` need them, so they are imported on first use (PEP 562 `__getattr__`).

Modules:

    sender.py            WeightSender: one session's staging, the bucket pipeline, its ending
    sender_inputs.py     what `send` accepts, and the checks made before anything is sent
    lent.py              LentTensor: a weight that writes itself into the staging it is lent
                         (a sharded trainer's all-gather, straight into staging)
    sender_socket.py     the sender's REQ sockets: the invitation at the endpoint, then the
                         session's own socket: requests out, each ACK checked, all bounded
    receiver.py          WeightReceiver: what each request means; the blocking and async waits
    receiver_socket.py   the receiver's REP socket: joins one session, then checks each request
                         and answers it exactly once
    frames.py            the wire format: msgpack Structs, and the sequence of requests
    layout.py            where tensors sit in a bucket: planning, packing, reassembly
    config.py            TransferConfig and TransferReport (no torch, no zmq)
    staging.py           the interface of staging buffers every transport implements
    transport.py         which staging implementation a session uses
    shm.py               shared-memory staging (/dev/shm segments)
    segments.py          names of staging segments, and sweeping those of dead processes
    descriptions.py      what the handshake tells the receiver about staging
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from timeshare.protocols.weights.config import TransferConfig, TransferReport
from timeshare.protocols.weights.segments import staging_tag, sweep_stale_segments
from timeshare.runtime import SHM_ROOT, Endpoint, sweep_foreign_segments, sweep_stale_sockets

if TYPE_CHECKING:
    # mypy sees the real types through these imports; at run time `__getattr__` below imports
    # them on first use. mypy never sees that `__getattr__` (it would type every unknown
    # attribute of this package as its return type, hiding a misspelt import).
    from timeshare.protocols.weights.lent import LentTensor
    from timeshare.protocols.weights.receiver import WeightReceiver
    from timeshare.protocols.weights.sender import WeightSender
else:
    _TORCH_AND_ZMQ_NAMES = {
        "LentTensor": "timeshare.protocols.weights.lent",
        "WeightReceiver": "timeshare.protocols.weights.receiver",
        "WeightSender": "timeshare.protocols.weights.sender",
    }

    def __getattr__(name: str) -> object:
        if name not in _TORCH_AND_ZMQ_NAMES:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(_TORCH_AND_ZMQ_NAMES[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value


__all__ = [
    "LentTensor",
    "TransferConfig",
    "TransferReport",
    "WeightReceiver",
    "WeightSender",
    "check_weight_endpoints",
    "sweep_stale",
    "weight_endpoint",
]


def weight_endpoint(runtime_dir: str | Path, rank: int) -> str:
    """The endpoint of rank `rank`'s weight channel in a job's runtime directory."""
    return f"ipc://{runtime_dir}/w-rank{rank}.sock"


def check_weight_endpoints(runtime_dir: str | Path, ranks: int) -> None:
    """Raise TransferError when the longest socket path the job's weight channels bind (the
    last rank's session socket) does not fit in a socket address."""
    Endpoint.parse(weight_endpoint(runtime_dir, ranks - 1)).session_socket(0)


def sweep_stale(runtime_dir: str | Path, *, owners_gone: bool = False) -> list[str]:
    """Remove staging segments and socket files that dead processes left for `runtime_dir`, and
    the segments an engine's processes recorded there once they are all gone.

    Segments whose owner process is alive, and sockets on which something listens, stay;
    `owners_gone` says every process of the directory has exited: all its sockets go.
    Returns the paths removed.
    """
    directory = Path(runtime_dir)
    removed = [str(SHM_ROOT / name) for name in sweep_stale_segments(staging_tag(directory))]
    removed += [str(p) for p in sweep_stale_sockets(directory, owners_gone=owners_gone)]
    removed += sweep_foreign_segments(directory)
    return removed
