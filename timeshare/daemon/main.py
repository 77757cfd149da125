"""`timeshared --config PATH` (also `python -m timeshare.daemon`): the cycle as a service.

Paths come from the config, else from systemd's environment, else defaults:

    state      [daemon].state_dir, else $STATE_DIRECTORY, else runs/timeshared
    runtime    [job].runtime_dir as set, else $RUNTIME_DIRECTORY, else the job's default;
               the workers' sockets go in <runtime>/job, the control socket is
               <runtime>/control.sock unless [daemon].socket says otherwise
    checkpoints, the log file, tensorboard and trace, when relative, are under the state
               directory

Started by socket activation (timeshared.socket), the daemon comes up idle: a status query never
starts training; `timesharectl resume` does.

Signals: SIGTERM and SIGINT drain and exit (0 within [daemon].drain_s, else 1); SIGHUP reloads.
Exit codes: 0 stopped, 1 the cycle failed or the drain overran, 2 bad config, or the control
socket or metrics port in use.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack, suppress
from functools import partial
from pathlib import Path

import anyio
import msgspec
import structlog

from timeshare import logs
from timeshare.config import Config, LoadedConfig, load_config
from timeshare.daemon.control import ControlServer, bind_control_socket
from timeshare.daemon.metrics import Metrics, MetricsServer, serve_metrics
from timeshare.daemon.progress import load_saved_progress
from timeshare.daemon.requests import OperatorRequests
from timeshare.daemon.service import Service, ServiceParts, ServicePaths
from timeshare.daemon.systemd import (
    Notifier,
    listen_sockets,
    take_service_variables,
    watchdog_interval_s,
)
from timeshare.errors import ConfigError, ControlError, SocketInUse, StoreError
from timeshare.protocols.store import AsyncJobStore
from timeshare.report.writers import close_off_loop, open_writers
from timeshare.state.service import ServiceLifecycle

log = structlog.get_logger(__name__)

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
DEFAULT_STATE_DIR = "runs/timeshared"
ANSWER_GRACE_S = 2.0  # at exit, for replies already being written
EXTEND_EVERY_S = 5.0  # EXTEND_TIMEOUT_USEC while starting or draining, by twice this
EXTENDED = frozenset({ServiceLifecycle.DRAINING, ServiceLifecycle.STOPPING})


def resolve(
    loaded: LoadedConfig, config_file: Path, environ: Mapping[str, str]
) -> tuple[Config, ServicePaths]:
    """The config with the daemon's paths filled in, and where the daemon keeps its files."""
    config = loaded.config
    state_dir = Path(
        config.daemon.state_dir or environ.get("STATE_DIRECTORY", "") or DEFAULT_STATE_DIR
    )
    runtime = Path(config.job.runtime_dir)
    if loaded.source_of("job.runtime_dir") == "default" and environ.get("RUNTIME_DIRECTORY"):
        runtime = Path(environ["RUNTIME_DIRECTORY"].split(":")[0])
    socket_path = Path(config.daemon.socket) if config.daemon.socket else runtime / "control.sock"
    job = msgspec.structs.replace(
        config.job,
        runtime_dir=str(runtime / "job"),
        checkpoint_dir=str(_under(state_dir, config.job.checkpoint_dir)),
    )
    log_section = msgspec.structs.replace(
        config.log,
        **{
            key: str(_under(state_dir, path)) if path else ""
            for key, path in (
                ("file", config.log.file),
                ("tensorboard", config.log.tensorboard),
                ("trace", config.log.trace),
            )
        },
    )
    config = msgspec.structs.replace(config, job=job, log=log_section)
    return config, ServicePaths(config_file, state_dir, socket_path)


def _under(base: Path, path: str) -> Path:
    return Path(path) if Path(path).is_absolute() else base / path


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    service_variables = take_service_variables(os.environ)  # workers never see them
    try:
        loaded = load_config(args.config)
        config, paths = resolve(loaded, args.config, os.environ)
        logs.configure(
            config.log.level,
            config.log.file,
            service=True,
            max_mb=config.log.max_mb,
            keep=config.log.keep,
        )
        paths.state_dir.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as exc:
        print(f"timeshared: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    activated = listen_sockets(service_variables)
    try:
        control = next(iter(activated.values())) if activated else bind_control_socket(paths.socket)
    except (SocketInUse, OSError) as exc:
        print(f"timeshared: control socket {paths.socket}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    notifier = Notifier.from_environment(service_variables)
    try:
        watchdog_s = watchdog_interval_s(service_variables)
        serve = partial(
            _serve,
            notifier=notifier,
            control=control,
            watchdog_s=watchdog_s,
            activated=bool(activated),
        )
        return anyio.run(serve, loaded, config, paths)
    finally:
        notifier.close()
        control.close()
        if not activated:  # a socket unit's socket stays for the next start
            with suppress(FileNotFoundError):
                paths.socket.unlink()


async def _serve(
    loaded: LoadedConfig,
    config: Config,
    paths: ServicePaths,
    *,
    notifier: Notifier,
    control: socket.socket,
    watchdog_s: float | None,
    activated: bool,
) -> int:
    try:  # a follower node waits for its leader's store (ready_s), then fails, naming it
        store = await AsyncJobStore.for_job(config.cluster, ready_s=config.deadlines.ready_s)
    except StoreError as exc:
        print(f"timeshared: {exc}", file=sys.stderr)
        return EXIT_FAILED
    metrics = Metrics(node=config.cluster.node_rank)
    async with AsyncExitStack() as opened:  # each closed on every way out, the last first
        try:
            writers = await open_writers(config.log, opened)
            metrics_server = await _start_metrics(config, metrics)
            if metrics_server is not None:
                opened.push_async_callback(close_off_loop, metrics_server.close)
        except ConfigError as exc:
            print(f"timeshared: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        parts = ServiceParts(
            notifier,
            metrics,
            store,
            metrics_port=None if metrics_server is None else metrics_server.port,
            activated=activated,
            scalars=writers.scalars,
            trace=writers.trace,
        )
        saved = await anyio.to_thread.run_sync(load_saved_progress, paths.state_dir)
        service = Service(loaded, config, paths, parts, saved)
        await _run_service(service, control, watchdog_s, activated)
    log.info("service.stop", exit_code=service.exit_code, reason=service.reason)
    return service.exit_code


async def _run_service(
    service: Service, control: socket.socket, watchdog_s: float | None, activated: bool
) -> None:
    """The service answering its socket and running cycles, until it stops."""
    log.info(
        "service.start",
        config=str(service.paths.config_file),
        state_dir=str(service.paths.state_dir),
        socket=str(service.paths.socket),
        socket_activated=activated,
        committed_step=service.progress.committed_step,
    )
    await service.open()  # before the first request can be answered
    requests = OperatorRequests(service)
    server = ControlServer(service, requests, service.config.daemon)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(service.records.run)
            group.start_soon(server.serve, control)
            group.start_soon(_signals, requests)
            group.start_soon(_extend_timeouts, service)
            if watchdog_s is not None:
                group.start_soon(_watchdog, service, watchdog_s)
            group.start_soon(_drain_deadline, service)
            group.start_soon(service.loop_lag.measure, service.parts.metrics.loop_lag.set)
            group.start_soon(service.watch_idle_nodes)
            await service.run_cycles()
            await service.let_nodes_hear_stop()  # the store goes with this daemon
            await server.wait_answered(timeout_s=ANSWER_GRACE_S)
            group.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            service.parts.notifier.stopping(f"stopped: {service.reason or 'requested'}")
            await service.records.close()


async def _start_metrics(config: Config, metrics: Metrics) -> MetricsServer | None:
    """The metrics endpoint ([daemon].metrics); a port it cannot bind is a ConfigError."""
    if not config.daemon.metrics:
        return None
    port = config.daemon.metrics_port
    try:
        return await anyio.to_thread.run_sync(serve_metrics, metrics, port)
    except OSError as exc:
        raise ConfigError(f"daemon.metrics_port {port}: {exc}") from exc


async def _signals(requests: OperatorRequests) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                try:
                    await requests.reload()
                except ControlError as exc:
                    log.warning("service.reload.refused", error=str(exc))
            else:
                await requests.stop(name)


async def _drain_deadline(service: Service) -> None:
    """Once the service stops (or failed), the cycle has `drain_s` to end; then it is cut short."""
    await service.wait_stopping()
    await anyio.sleep(service.config.daemon.drain_s)
    service.cancel_cycle()


async def _extend_timeouts(service: Service) -> None:
    """systemd's start and stop timeouts must not end a long start-up or a drain."""
    notifier = service.parts.notifier
    while True:
        starting = not notifier.ready_sent and service.state is ServiceLifecycle.STARTING
        if starting or service.state in EXTENDED:
            notifier.extend_timeout(2 * EXTEND_EVERY_S)
        with anyio.move_on_after(EXTEND_EVERY_S):
            await service.wait_changed()  # a drain that starts is extended at once


async def _watchdog(service: Service, every_s: float) -> None:
    """WATCHDOG=1 at half systemd's interval, only while the cycle makes progress."""
    while True:
        if service.healthy():
            service.parts.notifier.watchdog()
        else:
            log.error("service.watchdog.withheld", state=service.state.value)
        await anyio.sleep(every_s)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="timeshared", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="the job's TOML config")
    return parser


if __name__ == "__main__":
    sys.exit(main())
