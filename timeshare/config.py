"""The job's configuration: typed sections from a TOML file, plus environment overrides.

    [job]        ranks, steps, runtime_dir, checkpoint_dir
    [deadlines]  phase_s, stall_s, barrier_s, ready_s; [deadlines.commands] per command
    [transfer]   the weight channel (TransferConfig)
    [engine]     trainer, rollout (the registered engines, engines/registry.py), the task and
                 GRPO ([engine.task], [engine.grpo]) and each engine's own section
                 ([engine.<name>], typed by that engine's spec)
    [checks]     the drift probe: invariance_every, invariance_samples; what a rollout that
                 does not hold its trainer's weights does: on_weights_mismatch
    [[faults]]   injected faults, for drills
    [log]        level, and a file for JSON lines
    [daemon]     the service `timeshared`: control socket, state directory, metrics, drain
    [cluster]    nodes, node_rank, ranks_per_node, leader_addr, leader_port: also from a
                 launcher's environment (torchrun's, Slurm's), see cluster.py

`TIMESHARE_<SECTION>__<KEY>=value` overrides a key (nested keys join with `__`; the value is read
as a TOML value, else as a string). An unknown key, a wrong type, a value out of range or
deadlines that do not nest is one `ConfigError` naming the key and where its value came from.
Every value reaches the code that uses it as an explicit argument; nothing reads globals.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import msgspec

from timeshare.cluster import ClusterSection, check_cluster, launcher_values, ranks_per_node
from timeshare.engines import registry
from timeshare.engines.drift import ChecksSection
from timeshare.engines.faults import Fault
from timeshare.engines.handoff import KEEP_CHECKPOINTS
from timeshare.engines.spec import EngineSpec, check_engines
from timeshare.errors import ConfigError, TransferError
from timeshare.levels import LogLevel
from timeshare.protocols.weights import check_weight_endpoints
from timeshare.protocols.weights.config import TransferConfig
from timeshare.state import Phase
from timeshare.units import Seconds

ENV_PREFIX = "TIMESHARE_"


class JobSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ranks: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 2
    steps: Annotated[int, msgspec.Meta(ge=1)] = 2
    runtime_dir: str = "/tmp/timeshare"  # noqa: S108 - a default; systemd gives RUNTIME_DIRECTORY
    checkpoint_dir: str = "runs/checkpoints"
    # The newest committed steps each trainer keeps; older ones are deleted as new ones commit
    # (never the one a resume needs: the newest committed step is always among them).
    keep_checkpoints: Annotated[int, msgspec.Meta(ge=1, le=1000)] = KEEP_CHECKPOINTS


class DeadlineSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    phase_s: Seconds = 30.0  # one phase's command on a worker
    stall_s: Seconds = 10.0  # a busy worker without progress
    barrier_s: Seconds = 20.0  # waiting for the other ranks at BARRIER
    ready_s: Seconds = 60.0  # workers up and connected; a follower node: the leader's store
    node_s: Seconds = 5.0  # several nodes: a node whose daemon is silent this long is lost
    commands: dict[str, Seconds] = {}  # per command (a phase, bootstrap, shutdown): not phase_s

    def for_command(self, command: str) -> float:
        """The deadline of one worker command."""
        return self.commands.get(command, self.phase_s)


class LogSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    level: LogLevel = "info"
    file: str = ""  # structlog JSON lines of the run and its workers; "" for none
    tensorboard: str = ""  # a directory: TensorBoard scalars of every step; "" for none
    trace: str = ""  # a file: the run's timeline as a Chrome trace (Perfetto); "" for none
    # `file` and `trace` each start anew at this size, the full one kept as <name>.1 (older
    # ones as .2, ...), `keep` of them: a job of days stays within (1 + keep) x max_mb each.
    max_mb: Annotated[float, msgspec.Meta(ge=0.0)] = 256.0  # 0: never
    keep: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 4
    # The run's directory: samples.jsonl (the first `samples_per_step` samples of each step and
    # rank, as text) and reward_errors.jsonl go there. "": the directory of `file`, else the
    # parent of job.checkpoint_dir.
    dir: str = ""
    samples_per_step: Annotated[int, msgspec.Meta(ge=0)] = 0

    def run_dir(self, checkpoint_dir: str) -> Path:
        if self.dir:
            return Path(self.dir)
        if self.file:
            return Path(self.file).parent
        return Path(checkpoint_dir).parent


class DaemonSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`timeshared` only. Empty paths come from systemd's environment, else the defaults."""

    socket: str = ""  # "": $RUNTIME_DIRECTORY/control.sock, else <job.runtime_dir>/control.sock
    state_dir: str = ""  # "": $STATE_DIRECTORY, else runs/timeshared
    metrics: bool = True
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9464  # 0: any free port
    drain_s: Seconds = 120.0  # SIGTERM or stop: from the request to exit
    max_request_bytes: Annotated[int, msgspec.Meta(ge=256, le=1 << 20)] = 65536
    max_clients: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    client_idle_s: Seconds = 600.0  # a connection without a request is closed after this


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    job: JobSection = JobSection()
    deadlines: DeadlineSection = DeadlineSection()
    # The channel's own bucket size; its deadlines nested inside a SYNC's (deadlines.phase_s).
    transfer: TransferConfig = TransferConfig(
        ack_timeout_s=10.0,
        finalize_timeout_s=20.0,
        handshake_timeout_s=20.0,
        begin_timeout_s=20.0,
    )
    engine: EngineSpec = EngineSpec()
    checks: ChecksSection = ChecksSection()
    faults: list[Fault] = []
    log: LogSection = LogSection()
    daemon: DaemonSection = DaemonSection()
    cluster: ClusterSection = ClusterSection()


COMMANDS = frozenset({*(phase.value for phase in Phase), "bootstrap", "shutdown"})
# (inner, command): an inner deadline runs inside that command's, so it must be shorter.
NESTED_DEADLINES = [
    *(("deadlines.stall_s", command) for command in sorted(COMMANDS)),
    ("transfer.ack_timeout_s", Phase.SYNC.value),
    ("transfer.finalize_timeout_s", Phase.SYNC.value),
    ("transfer.handshake_timeout_s", Phase.SYNC.value),
    ("transfer.begin_timeout_s", Phase.SYNC.value),
]


@dataclass(frozen=True)
class LoadedConfig:
    """The effective config and, for every key set by the file or the environment, its source."""

    config: Config
    sources: dict[str, str]

    def source_of(self, key: str) -> str:
        return self.sources.get(key, "default")


def load_config(
    path: Path | None,
    environ: Mapping[str, str] | None = None,
    *,
    overrides: Mapping[str, tuple[object, str]] | None = None,
    probe: bool = True,
) -> LoadedConfig:
    """Read `path` (if any), apply TIMESHARE_* overrides, validate everything.

    `overrides`: key -> (value, where it came from), over the file and the environment (a
    command line's). `probe=False`: the engines' probes are left out (check_engines).
    """
    environ = os.environ if environ is None else environ
    data: dict[str, object] = {}
    sources: dict[str, str] = {}
    if path is not None:
        data = _read_toml(path)
        for key in _leaf_keys(data):
            sources[key] = f"file {path}"
    for name, raw in sorted(environ.items()):
        if name.startswith(ENV_PREFIX):
            key = _env_key(name)
            _set(data, key, _env_value(raw))
            sources[key] = f"env {name}"
    for key, (value, source) in (overrides or {}).items():
        _set(data, key, value)
        sources[key] = source
    _apply_launcher(data, sources, environ)
    # A section given in part keeps the job's defaults for the rest (a [transfer] that sets only
    # bucket_mb keeps the SYNC-nested timeouts, not the channel's standalone ones).
    config = _convert(_merged(msgspec.to_builtins(Config()), data), sources)
    _check_nesting(config, sources)
    _check_runtime_dir(config, sources)
    _check_drift_probe(config, sources)
    check_cluster(config.cluster, config.job.ranks, lambda key: sources.get(key, "default"))
    check_engines(
        config.engine,
        lambda key: sources.get(key, "default"),
        ranks=config.job.ranks,
        ranks_per_node=ranks_per_node(config.cluster, config.job.ranks),
        probe=probe,
    )
    return LoadedConfig(config, sources)


def _check_drift_probe(config: Config, sources: dict[str, str]) -> None:
    """The drift probe asks the rollout to re-score sequences alone: an engine that can."""
    every, rollout = config.checks.invariance_every, config.engine.rollout
    if every and rollout in registry.ENGINES and not registry.ENGINES[rollout].rescores:
        where = sources.get("checks.invariance_every", "default")
        raise ConfigError(
            f"checks.invariance_every ({every}, from {where}): the {rollout} rollout cannot "
            "re-score a sequence alone (the drift probe needs it)"
        )


def effective_lines(loaded: LoadedConfig) -> list[str]:
    """`key = value  # source` for every key of the effective config (`timeshare config show`)."""
    values = msgspec.to_builtins(loaded.config)
    lines = []
    for key in _leaf_keys(values):
        value = _get(values, key)
        lines.append(f"{key} = {_toml_value(value)}  # {loaded.source_of(key)}")
    return lines


def flat(config: Config) -> dict[str, object]:
    """Every leaf key of `config` (`deadlines.phase_s`, ...) with its value."""
    values = msgspec.to_builtins(config)
    return {key: _get(values, key) for key in _leaf_keys(values)}


# Keys a running service may change (a reload); any other changed key refuses the reload.
LIVE_KEYS = ("job.steps", "deadlines.", "log.level")


@dataclass(frozen=True)
class ConfigChanges:
    """What differs between two configs: every changed key with its new value, and those of
    them that a running service cannot take (`fixed`)."""

    changed: dict[str, object]
    fixed: list[str]


def changes(before: Config, after: Config) -> ConfigChanges:
    old, new = flat(before), flat(after)
    changed = {k: new.get(k) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
    return ConfigChanges(changed, [k for k in changed if not k.startswith(LIVE_KEYS)])


def with_live_values(running: Config, read: Config) -> Config:
    """`running` with the live keys' values of `read` (a reloaded file: its values win)."""
    job = msgspec.structs.replace(running.job, steps=read.job.steps)
    log = msgspec.structs.replace(running.log, level=read.log.level)
    return msgspec.structs.replace(running, job=job, deadlines=read.deadlines, log=log)


# -- reading -----------------------------------------------------------------------------------


def _read_toml(path: Path) -> dict[str, object]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def _apply_launcher(
    data: dict[str, object], sources: dict[str, str], env: Mapping[str, str]
) -> None:
    """[cluster] keys from a launcher's environment, where the file and TIMESHARE_* left them
    unset; a value set there that the launcher contradicts is an error naming both."""
    for name, (value, source) in launcher_values(env).items():
        key = f"cluster.{name}"
        if key in sources:
            if _get(data, key) != value:
                raise ConfigError(
                    f"{key} = {_get(data, key)!r} (from {sources[key]}) conflicts with {source}"
                )
            continue
        _set(data, key, value)
        sources[key] = source


def _env_key(name: str) -> str:
    parts = name.removeprefix(ENV_PREFIX).lower().split("__")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"env {name}: expected TIMESHARE_<SECTION>__<KEY>")
    return ".".join(parts)


def _env_value(raw: str) -> object:
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: a string


def _convert(data: dict[str, object], sources: dict[str, str]) -> Config:
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        message = str(exc)
        key = _key_of(message)
        where = sources.get(key) or _source_within(key, sources) or "default"
        if key in ENGINE_KINDS and message.startswith("Invalid enum value"):
            return _unknown_engine(data, key, where, exc)
        raise ConfigError(
            f"{key or 'config'}: {message.split(' - at ', maxsplit=1)[0]} (from {where})"
        ) from exc


ENGINE_KINDS: dict[str, registry.Role] = {"engine.trainer": "trainer", "engine.rollout": "rollout"}


def _unknown_engine(
    data: dict[str, object], key: str, where: str, exc: msgspec.ValidationError
) -> NoReturn:
    """`engine.trainer` or `rollout` names no registered engine of its role: say which exist."""
    try:
        registry.find(str(_get(data, key)), ENGINE_KINDS[key])
    except ConfigError as unknown:
        raise ConfigError(f"{unknown} (from {where})") from exc
    raise ConfigError(f"{key}: {exc} (from {where})") from exc


def _key_of(message: str) -> str:
    """`job.rnks` from "Object contains unknown field `rnks` - at `$.job`", and the like."""
    path = re.search(r" - at `\$\.?([^`]*)`", message)
    base = path.group(1).replace("[...]", "") if path else ""
    base = re.sub(r"\[\d+\]", "", base)
    unknown = re.search(r"unknown field `([^`]+)`", message)
    if unknown:
        return f"{base}.{unknown.group(1)}" if base else unknown.group(1)
    return base


def _source_within(key: str, sources: dict[str, str]) -> str | None:
    for known, source in sources.items():
        if known.startswith(f"{key}.") or key.startswith(f"{known}."):
            return source
    return None


def _check_runtime_dir(config: Config, sources: dict[str, str]) -> None:
    """Every socket the job binds there must fit in a socket address (107 bytes)."""
    try:
        check_weight_endpoints(config.job.runtime_dir, config.job.ranks)
    except TransferError as exc:
        where = sources.get("job.runtime_dir", "default")
        raise ConfigError(f"job.runtime_dir is too long (from {where}): {exc}") from exc


def _check_nesting(config: Config, sources: dict[str, str]) -> None:
    values = msgspec.to_builtins(config)
    for command in config.deadlines.commands:
        if command not in COMMANDS:
            key = f"deadlines.commands.{command}"
            raise ConfigError(
                f"{key}: no such command (from {sources.get(key, 'default')}); "
                f"commands are {', '.join(sorted(COMMANDS))}"
            )
    for inner, command in [*NESTED_DEADLINES, *_engine_deadlines(config)]:
        custom = command in config.deadlines.commands
        outer = f"deadlines.commands.{command}" if custom else "deadlines.phase_s"
        inner_s, outer_s = _seconds(values, inner), _seconds(values, outer)
        if inner_s >= outer_s:
            raise ConfigError(
                f"{inner} ({inner_s:g} s, from {sources.get(inner, 'default')}) must be shorter "
                f"than {outer} ({outer_s:g} s, from {sources.get(outer, 'default')}), "
                "which it runs inside"
            )


def _engine_deadlines(config: Config) -> list[tuple[str, str]]:
    """The rollout engine's own generate deadline, where it sets one: inside ROLLOUT's."""
    rollout = config.engine.rollout
    if getattr(config.engine.section(rollout), "generate_timeout_s", None) is None:
        return []  # (an engine that sets none takes 0.9 of ROLLOUT's deadline: worker_spec)
    return [(f"engine.{rollout}.generate_timeout_s", Phase.ROLLOUT.value)]


# -- nested dicts --------------------------------------------------------------------------------


def _leaf_keys(data: Mapping[str, object], prefix: str = "") -> list[str]:
    keys = []
    for name, value in data.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and value:
            keys += _leaf_keys(value, f"{key}.")
        else:
            keys.append(key)
    return keys


def _merged(defaults: Mapping[str, object], given: Mapping[str, object]) -> dict[str, object]:
    """`given` over `defaults`, table by table (a value that is not a table replaces)."""
    merged = dict(defaults)
    for name, value in given.items():
        default = merged.get(name)
        if isinstance(value, Mapping) and isinstance(default, Mapping):
            merged[name] = _merged(default, value)
        else:
            merged[name] = value
    return merged


def _get(data: Mapping[str, object], key: str) -> object:
    value: object = data
    for part in key.split("."):
        if not isinstance(value, Mapping):
            raise KeyError(key)
        value = value[part]
    return value


def _seconds(data: Mapping[str, object], key: str) -> float:
    """A deadline's value (a number of seconds: the config was validated)."""
    value = _get(data, key)
    assert isinstance(value, int | float), (key, value)
    return float(value)


def _set(data: dict[str, object], key: str, value: object) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        child = data.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is a value, not a section")
        data = child
    data[leaf] = value


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value)  # strings, and lists and tables, as TOML reads them
