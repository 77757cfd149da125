"""A job over two nodes on one machine: one daemon (or `timeshare run`) per node, each with its
own runtime and state directory, the leader's job store on a loopback port, and the checkpoint
directory shared (as a cluster's shared filesystem is)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.configs import job, toml
from tests.cycle.jobs import processes_of
from timeshare.protocols.nodes import NodeRecord, read_record
from timeshare.protocols.store import JobStore

NODES = 2


def node_dir(root: Path, node: int) -> Path:
    return root / f"node{node}"


def node_configs(
    root: Path,
    preset: Mapping[str, Any],
    port: int,
    nodes: int = NODES,
    only: Mapping[int, Mapping[str, Any]] | None = None,
    **sections: Any,
) -> list[Path]:
    """Each node's TOML: its own runtime dir, state dir and log; one checkpoint dir for all.
    `only[node]`: sections of that node alone (a fault on one node)."""
    paths = []
    for node in range(nodes):
        directory = node_dir(root, node)
        directory.mkdir(parents=True, exist_ok=True)
        data = job(
            directory,
            preset,
            **{
                **sections,
                **(only or {}).get(node, {}),
                "job": {**sections.get("job", {}), "checkpoint_dir": f"{root}/checkpoints"},
                "cluster": {"nodes": nodes, "node_rank": node, "leader_port": port},
                "log": {"file": f"{directory}/log.jsonl"},
            },
        )
        path = directory / "job.toml"
        path.write_text(toml(data))
        paths.append(path)
    return paths


@dataclass
class NodeRun:
    """`timeshare run` of one node."""

    node: int
    process: subprocess.Popen[str]
    directory: Path

    @property
    def summary(self) -> Path:
        return self.directory / "summary.json"

    def wait(self, timeout: float) -> tuple[int, str]:
        out, _ = self.process.communicate(timeout=timeout)
        return self.process.returncode, out

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)


def start_run(config: Path, node: int) -> NodeRun:
    directory = config.parent
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "timeshare",
            "run",
            str(config),
            "--summary",
            str(directory / "summary.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return NodeRun(node, process, directory)


@contextmanager
def running_nodes(configs: list[Path]) -> Iterator[list[NodeRun]]:
    """`timeshare run` on every node (the leader first); each one killed if still alive."""
    runs = [start_run(config, node) for node, config in enumerate(configs)]
    try:
        yield runs
    finally:
        for run in runs:
            if run.process.poll() is None:
                run.process.kill()
            with suppress(subprocess.TimeoutExpired):
                run.process.communicate(timeout=30)


def wait_for_record(
    port: int, node: int, condition: Callable[[NodeRecord], bool], timeout: float = 120.0
) -> NodeRecord:
    """Until node `node`'s record in the leader's store meets `condition`; that record."""
    store = JobStore.connect("127.0.0.1", port, timeout_s=timeout)
    deadline = time.monotonic() + timeout
    while True:
        record = read_record(store, node)
        if record is not None and condition(record):
            return record
        assert time.monotonic() < deadline, f"node {node} never got there: {record}"
        time.sleep(0.05)


def assert_nodes_left_nothing(root: Path, nodes: int = NODES) -> None:
    """On every node: no process of the job, no socket file, no record of workers."""
    for node in range(nodes):
        directory = node_dir(root, node)
        assert processes_of(directory / "run") == [], node
        run_dir = directory / "run"
        left = list(run_dir.rglob("*")) if run_dir.exists() else []
        assert [p for p in left if p.is_socket() or p.name == "workers.json"] == [], left
