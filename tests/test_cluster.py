"""`[cluster]` from the file and from a launcher's environment (torchrun's, Slurm's): what fills
what, and every conflict one error naming both sides."""

from __future__ import annotations

from pathlib import Path

import pytest

from timeshare.cluster import first_host, node_ranks
from timeshare.config import load_config
from timeshare.errors import ConfigError

TORCHRUN = {"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
SLURM = {"SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[07-10,12],cpu1"}


def write(tmp_path: Path, text: str = "") -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node01", "node01"),
        ("node[01-04,07]", "node01"),
        ("gpu[7]", "gpu7"),
        ("a,b,c", "a"),
        ("rack1-n[009-012]-ib,other", "rack1-n009-ib"),
    ],
)
def test_the_leader_is_the_first_host_of_a_slurm_host_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_a_single_node_config_needs_no_cluster_section(tmp_path: Path) -> None:
    loaded = load_config(write(tmp_path), environ={})
    assert (loaded.config.cluster.nodes, loaded.config.cluster.node_rank) == (1, 0)
    assert loaded.source_of("cluster.nodes") == "default"


@pytest.mark.parametrize(("environ", "launcher"), [(TORCHRUN, "torchrun"), (SLURM, "Slurm")])
def test_a_launcher_fills_what_the_file_leaves_unset(
    tmp_path: Path, environ: dict[str, str], launcher: str
) -> None:
    loaded = load_config(write(tmp_path, "[cluster]\nleader_port = 29511\n"), environ=environ)
    cluster = loaded.config.cluster
    assert cluster.leader_addr == ("10.0.0.7" if launcher == "torchrun" else "gpu07")
    assert loaded.source_of("cluster.nodes").endswith(f"({launcher})")
    assert loaded.source_of("cluster.leader_port") == f"file {tmp_path / 'job.toml'}"


def test_a_file_value_the_launcher_contradicts_names_both(tmp_path: Path) -> None:
    path = write(tmp_path, '[cluster]\nleader_addr = "10.0.0.9"\n')
    with pytest.raises(
        ConfigError,
        match=r"cluster\.leader_addr = '10\.0\.0\.9' \(from file .*\) conflicts with "
        r"MASTER_ADDR=10\.0\.0\.7 \(torchrun\)",
    ):
        load_config(path, environ=TORCHRUN)


def test_two_launchers_that_disagree_are_named(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"cluster\.leader_addr: MASTER_ADDR=10\.0\.0\.7 \(torchrun\) and "
        r"SLURM_JOB_NODELIST=gpu\[07-10,12\],cpu1 \(Slurm\) disagree",
    ):
        load_config(write(tmp_path), environ={**TORCHRUN, **SLURM})


@pytest.mark.parametrize(
    ("environ", "text", "message"),
    [
        ({"MASTER_PORT": "http"}, "", r"cluster\.leader_port: MASTER_PORT='http' \(torchrun\)"),
        ({"MASTER_PORT": "70000"}, "", r"70000 is not a port"),
        ({"SLURM_JOB_NODELIST": "[01-02]"}, "", r"is not a Slurm host list"),
        ({"NODE_RANK": "3"}, "", r"cluster\.node_rank \(3, from NODE_RANK=3 \(torchrun\)\)"),
        ({}, "[cluster]\nranks_per_node = 3\n", r"job\.ranks \(2, from default\) is not"),
        ({"NNODES": "4"}, "", r"job\.ranks \(2, from default\) is not cluster\.nodes \(4\)"),
        (
            {"NNODES": "1"},
            "[cluster]\nmin_nodes = 2\n",
            r"cluster\.nodes \(1, from NNODES=1 \(torchrun\)\) is fewer than cluster\.min_nodes "
            r"\(2, from file .*\): the job does not run on fewer nodes",
        ),
    ],
)
def test_what_cannot_run_is_one_error_naming_key_and_source(
    tmp_path: Path, environ: dict[str, str], text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), environ=environ)


def test_each_node_runs_its_slice_of_the_global_ranks(tmp_path: Path) -> None:
    environ = {**TORCHRUN, "NNODES": "2", "NODE_RANK": "1"}
    loaded = load_config(write(tmp_path, "[job]\nranks = 4\n"), environ=environ)
    cluster = loaded.config.cluster
    assert node_ranks(cluster, 4) == range(2, 4)
    assert node_ranks(cluster, 4, node=0) == range(0, 2)
    explicit = load_config(
        write(
            tmp_path, "[job]\nranks = 6\n[cluster]\nnodes = 3\nnode_rank = 2\nranks_per_node = 2\n"
        ),
        environ={},
    )
    assert node_ranks(explicit.config.cluster, 6) == range(4, 6)
