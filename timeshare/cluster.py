"""`[cluster]`: the nodes a job spans, one daemon each, from the config file or the launcher.

A launcher says the same things in its own environment: torchrun's (`NNODES`, `NODE_RANK`,
`MASTER_ADDR`, `MASTER_PORT`) and Slurm's (`SLURM_NNODES`, `SLURM_NODEID`, and the leader as the
first host of `SLURM_JOB_NODELIST`). What a launcher gives fills the keys the file and the
TIMESHARE_* overrides leave unset; a value set there that a launcher contradicts, or two
launchers that disagree, is a `ConfigError` naming both. No torch here: the config is read
without it.

A node runs ranks `node_rank * ranks_per_node …` of the job (`node_ranks`): global rank numbers
are node * ranks-per-node + local rank, on every node and in every message.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Annotated

import msgspec

from timeshare.errors import ConfigError


class ClusterSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nodes: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    node_rank: Annotated[int, msgspec.Meta(ge=0)] = 0  # this node's index
    ranks_per_node: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: job.ranks / nodes
    leader_addr: str = "127.0.0.1"  # where the leader's daemon hosts the job store
    leader_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 29400
    # The fewest nodes the job may run on. 0: as many as its checkpoint was written by (the FSDP
    # trainer refuses a checkpoint of more ranks); n: a restart on as few as n nodes resumes
    # from the committed step, the trainer's checkpoint resharded to the ranks there are.
    min_nodes: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    # What `timeshare plan` checks a job against (the running job reads neither):
    device_gib: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # one rank's accelerator; 0: unstated
    sync_gbps: Annotated[float, msgspec.Meta(gt=0.0)] = 10.0  # one rank's SYNC rate, GB/s


def _port(raw: str) -> int:
    value = int(raw)
    if not 1 <= value <= 65535:
        raise ValueError(f"{value} is not a port")
    return value


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `node[01-04,07],gpu5` gives `node01`."""
    match = re.fullmatch(r"([^,\[\]]+)(?:\[([0-9]+)[^\]]*\])?([^,\[\]]*)(?:,.*)?", nodelist.strip())
    if not match or not match.group(1):
        raise ValueError(f"{nodelist!r} is not a Slurm host list")
    prefix, first_index, suffix = match.groups()
    return f"{prefix}{first_index or ''}{suffix}"


# (key of [cluster], environment variable, launcher, how its value reads)
LAUNCHER_VARIABLES: list[tuple[str, str, str, Callable[[str], int | str]]] = [
    ("nodes", "NNODES", "torchrun", int),
    ("node_rank", "NODE_RANK", "torchrun", int),
    ("leader_addr", "MASTER_ADDR", "torchrun", str),
    ("leader_port", "MASTER_PORT", "torchrun", _port),
    ("nodes", "SLURM_NNODES", "Slurm", int),
    ("node_rank", "SLURM_NODEID", "Slurm", int),
    ("leader_addr", "SLURM_JOB_NODELIST", "Slurm", first_host),
]


def launcher_values(environ: Mapping[str, str]) -> dict[str, tuple[int | str, str]]:
    """[cluster] keys a launcher's environment gives: key -> (value, where it came from)."""
    found: dict[str, tuple[int | str, str]] = {}
    for key, variable, launcher, read in LAUNCHER_VARIABLES:
        raw = environ.get(variable)
        if raw is None or raw == "":
            continue
        try:
            value = read(raw)
        except ValueError as exc:
            raise ConfigError(f"cluster.{key}: {variable}={raw!r} ({launcher}): {exc}") from exc
        source = f"{variable}={raw} ({launcher})"
        if key in found and found[key][0] != value:
            raise ConfigError(f"cluster.{key}: {found[key][1]} and {source} disagree")
        found.setdefault(key, (value, source))
    return found


def check_cluster(cluster: ClusterSection, ranks: int, where: Callable[[str], str]) -> None:
    """What a [cluster] of this job cannot be, each error naming the key and its source."""
    if cluster.node_rank >= cluster.nodes:
        raise ConfigError(
            f"cluster.node_rank ({cluster.node_rank}, from {where('cluster.node_rank')}) must "
            f"be below cluster.nodes ({cluster.nodes}, from {where('cluster.nodes')})"
        )
    if cluster.min_nodes > cluster.nodes:
        raise ConfigError(
            f"cluster.nodes ({cluster.nodes}, from {where('cluster.nodes')}) is fewer than "
            f"cluster.min_nodes ({cluster.min_nodes}, from {where('cluster.min_nodes')}): the "
            "job does not run on fewer nodes than that"
        )
    per_node = ranks_per_node(cluster, ranks)
    if per_node * cluster.nodes != ranks:
        raise ConfigError(
            f"job.ranks ({ranks}, from {where('job.ranks')}) is not cluster.nodes "
            f"({cluster.nodes}) x ranks per node ({per_node})"
        )


def ranks_per_node(cluster: ClusterSection, ranks: int) -> int:
    return cluster.ranks_per_node or ranks // cluster.nodes


def node_ranks(cluster: ClusterSection, ranks: int, node: int | None = None) -> range:
    """The job's global ranks that run on `node` (this node by default)."""
    node = cluster.node_rank if node is None else node
    return ranks_of_node(node, ranks_per_node(cluster, ranks))


def ranks_of_node(node: int, per_node: int) -> range:
    return range(node * per_node, (node + 1) * per_node)


def group_leader(rank: int, group_size: int) -> int:
    """The first rank of the group of `group_size` consecutive ranks that `rank` is in: where a
    rollout engine spanning that many ranks' devices (tensor parallelism) runs. A group lies
    within one node (the config's check: its size divides the ranks of a node)."""
    return rank - rank % group_size


def group_ranks(leader: int, group_size: int) -> range:
    return range(leader, leader + group_size)
