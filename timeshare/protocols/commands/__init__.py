"""Command lanes between the driver and its workers: a work lane and a control lane, each a
UNIX stream socket of length-prefixed frames (lane_socket.py).

driver_side.py: `WorkerLanes` (calls with deadlines; exits and stalls seen, by state/stall.py).
lane_server.py: what serves it (a listening socket per lane; each worker's liveness; replies).
cpu_wait.py: how long the machine kept a worker's process tree from a CPU (not a stall).
processes.py: `WorkerId`, and `watch_process` (a worker's exit, seen the moment it happens).
worker_side.py: `WorkerServer` (connects per lane; work in the main thread, control in its own).
frames.py: the typed msgpack frames both speak.
results.py: what each command returns, one Struct per (command, role).
"""

from timeshare.protocols.commands.driver_side import LaneCall, WorkerLanes
from timeshare.protocols.commands.processes import WorkerId, watch_process
from timeshare.protocols.commands.worker_side import WorkerServer

__all__ = ["LaneCall", "WorkerId", "WorkerLanes", "WorkerServer", "watch_process"]
