"""examples/cluster/: the two-node job loads on each node as each launcher gives it (systemd
drop-ins, Slurm), the Slurm script parses, and systemd accepts the base unit with each drop-in."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import required_tool
from tests.daemon.test_systemd import installed_units as installed_base_units
from tests.daemon.test_systemd import verify
from timeshare.cluster import node_ranks
from timeshare.config import LoadedConfig, load_config

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "cluster"
JOB = EXAMPLE / "job.toml"
SLURM_SCRIPT = EXAMPLE / "slurm.sbatch"
UNITS = ROOT / "systemd"
NODES = 2
RANKS_PER_NODE = 2


def drop_in(node: int) -> Path:
    return EXAMPLE / "systemd" / f"node{node}" / "timeshared.service.d" / "cluster.conf"


def drop_in_environment(path: Path) -> dict[str, str]:
    """The variables a drop-in's `Environment=` lines set (systemd's quoting: shell-like words
    of NAME=value)."""
    environ: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("Environment="):
            for word in shlex.split(line.removeprefix("Environment=")):
                name, _, value = word.partition("=")
                environ[name] = value
    return environ


def drop_in_config_file(path: Path) -> Path:
    """The config the drop-in's ExecStart= points the daemon at."""
    starts = [line for line in path.read_text().splitlines() if line.startswith("ExecStart=")]
    assert starts[0] == "ExecStart=", "a drop-in resets the base unit's ExecStart= first"
    match = re.fullmatch(r"ExecStart=/usr/local/bin/timeshared --config (\S+)", starts[-1])
    assert match, starts
    return Path(match.group(1))


def load_for(node: int) -> LoadedConfig:
    return load_config(JOB, environ=drop_in_environment(drop_in(node)))


@pytest.mark.parametrize("node", range(NODES))
def test_each_drop_in_gives_its_node_of_the_job(node: int) -> None:
    loaded = load_for(node)
    cluster = loaded.config.cluster
    assert (cluster.nodes, cluster.node_rank, cluster.leader_port) == (NODES, node, 29400)
    assert loaded.config.job.ranks == NODES * RANKS_PER_NODE
    first = node * RANKS_PER_NODE
    assert node_ranks(cluster, loaded.config.job.ranks) == range(first, first + RANKS_PER_NODE)
    assert loaded.source_of("cluster.node_rank") == "env TIMESHARE_CLUSTER__NODE_RANK"
    # The daemon reads the example's job where the drop-in's install lines put it.
    installed = drop_in_config_file(drop_in(node))
    assert f"examples/cluster/job.toml {installed}\n" in drop_in(node).read_text()


def test_every_node_meets_at_one_leader_and_one_shared_checkpoint_dir() -> None:
    configs = [load_for(node).config for node in range(NODES)]
    leaders = {(c.cluster.leader_addr, c.cluster.leader_port) for c in configs}
    checkpoints = {c.job.checkpoint_dir for c in configs}
    assert len(leaders) == 1 and len(checkpoints) == 1, (leaders, checkpoints)
    (checkpoint_dir,) = checkpoints
    # Absolute: a relative one would be under each daemon's own (local) state directory.
    assert Path(checkpoint_dir).is_absolute()
    for node in range(NODES):
        text = drop_in(node).read_text()
        # ProtectSystem=strict: the unit may write the shared directory only where it says so.
        writable = re.findall(r"^ReadWritePaths=(\S+)$", text, flags=re.MULTILINE)
        assert any(Path(checkpoint_dir).is_relative_to(path) for path in writable), writable
    # The ranks of all nodes are the job's, each once.
    total = configs[0].job.ranks
    ranks = [r for node in range(NODES) for r in node_ranks(configs[0].cluster, total, node)]
    assert ranks == list(range(NODES * RANKS_PER_NODE))


def test_the_drop_ins_differ_only_in_the_node() -> None:
    settings = []
    for node in range(NODES):
        lines = [
            line
            for line in drop_in(node).read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        assert f"Environment=TIMESHARE_CLUSTER__NODE_RANK={node}" in lines
        settings.append([line.replace(f"NODE_RANK={node}", "NODE_RANK=n") for line in lines])
    assert settings[0] == settings[1]


def test_the_slurm_script_parses_and_runs_one_timeshare_per_node() -> None:
    result = subprocess.run(
        [required_tool("bash"), "-n", str(SLURM_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    text = SLURM_SCRIPT.read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.MULTILINE)
    assert f"--nodes={NODES}" in directives and "--ntasks-per-node=1" in directives
    # SLURM_NODEID is each task's own: expanded by the task's shell, inside single quotes.
    command = re.search(r"^srun bash -c '(.*?)'$", text, flags=re.MULTILINE | re.DOTALL)
    assert command, "one `srun bash -c '...'` runs the job's node on every node"
    assert "timeshare run examples/cluster/job.toml" in command.group(1)
    assert '--summary "runs/cluster/node-$SLURM_NODEID.json"' in command.group(1)
    assert "TIMESHARE_JOB__RUNTIME_DIR=" in command.group(1)


def test_the_slurm_tasks_each_get_their_own_node_and_runtime_dir(tmp_path: Path) -> None:
    """The script's task command, run by bash as srun would on each node (SLURM_NODEID set)."""
    text = SLURM_SCRIPT.read_text()
    command = re.search(r"^srun bash -c '(.*?)'$", text, flags=re.MULTILINE | re.DOTALL)
    assert command
    # `timeshare` stands in as a function printing what it got and the environment it reads.
    shown = (
        'timeshare() { printf "%s\\n" "$@" '
        '"$TIMESHARE_JOB__RUNTIME_DIR" "$TIMESHARE_LOG__FILE"; }\n'
        + command.group(1).replace("exec timeshare", "timeshare")
    )
    seen = []
    for node in range(NODES):
        result = subprocess.run(
            [required_tool("bash"), "-c", shown],
            env={"SLURM_NODEID": str(node), "SLURM_JOB_ID": "77", "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        seen.append(result.stdout.splitlines())
    for node, lines in enumerate(seen):
        assert lines[:4] == [
            "run",
            "examples/cluster/job.toml",
            "--summary",
            f"runs/cluster/node-{node}.json",
        ]
        assert lines[4] == f"/tmp/timeshare-cluster-77-{node}"
        assert lines[5] == f"runs/cluster/node-{node}.log.jsonl"
    assert seen[0][4] != seen[1][4]


def test_the_job_loads_under_slurm_variables() -> None:
    environ = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    loaded = load_config(JOB, environ=environ)
    cluster = loaded.config.cluster
    assert (cluster.leader_addr, cluster.node_rank, cluster.nodes) == ("gpu07", 1, 2)
    assert loaded.source_of("cluster.leader_addr") == "SLURM_JOB_NODELIST=gpu[07-08] (Slurm)"
    assert node_ranks(cluster, loaded.config.job.ranks) == range(2, 4)


def installed_units(directory: Path, node: int) -> Path:
    """The base units and node `node`'s drop-in as installed, their binaries this
    environment's (verify checks that they exist)."""
    units = installed_base_units(directory)
    bin_dir = Path(sys.executable).parent
    drop_ins = units / "timeshared.service.d"
    drop_ins.mkdir()
    text = drop_in(node).read_text().replace("/usr/local/bin/", f"{bin_dir}/")
    (drop_ins / "cluster.conf").write_text(text)
    return units


@pytest.mark.parametrize("node", range(NODES))
def test_systemd_accepts_the_unit_with_each_drop_in(tmp_path: Path, node: int) -> None:
    result = verify(installed_units(tmp_path, node))
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_verify_reads_the_drop_in(tmp_path: Path) -> None:
    """The check above can fail: a key systemd does not know in the drop-in is reported."""
    units = installed_units(tmp_path, 1)
    conf = units / "timeshared.service.d" / "cluster.conf"
    conf.write_text(conf.read_text() + "NoSuchSetting=1\n")
    result = verify(units)
    assert "cluster.conf" in result.stderr and "NoSuchSetting" in result.stderr, result.stderr


def test_the_drop_in_keeps_the_base_units_restarts() -> None:
    """A follower exits 1 until its leader is up: the base unit's Restart= starts it again."""
    service = (UNITS / "timeshared.service").read_text()
    assert "\nRestart=on-failure\n" in service
    for node in range(NODES):
        text = drop_in(node).read_text()
        assert not re.search(r"^(Restart|RestartSec|StartLimit\w*)=", text, flags=re.MULTILINE)
