"""`timeshare`: the command line.

    timeshare run CONFIG [--summary PATH] [--ranks N] [--steps N] [--data-changed]
                                    run the cycle in the foreground (a dataset task is
                                    checked first, as `task check` does; --data-changed: go
                                    on from checkpoints that learnt from other data)
    timeshare task check CONFIG     the user's task before anything starts: every row loads,
                                    renders and tokenizes; prompt lengths; overlong rows; the
                                    stop set; two prompts; the reward called twice (exit 2:
                                    what failed)
    timeshare config show CONFIG    the effective config, each key with where it came from
    timeshare plan CONFIG [--nodes N] [--ranks-per-node N] [--device-gib G] [--sync-gbps R]
                   [--json PATH]    whether the job fits its cluster: the sizes that must
                                    divide, each rank's device memory per phase, the SYNC
                                    against its deadline; no engine starts (exit 2: it does
                                    not fit, each problem naming its key and numbers)
    timeshare state diagram [job|service]
                                    the job's phase machine, or the service's lifecycle,
                                    as a Mermaid diagram
    timeshare model init --arch llama|qwen2 --layers N --hidden H ... DIR
                                    a random-initialised transformers model from a seed, with
                                    the digit task's tokenizer (its chat template; config.json
                                    and generation_config.json name its BOS, EOS and PAD)
    timeshare export CHECKPOINT DIR a trainer's checkpoint (a step's directory, or the job's:
                                    its newest committed step) as a transformers model; the
                                    trainers that export are the registry's (fsdp, megatron)
    timeshare report RUN_DIR [--out PNG] [--steps N]
                                    the picture of a run: its last N steps rank by rank, each
                                    step's time by phase, reward and sync rate (RUN_DIR: where
                                    the run wrote its --summary file and keeps log.jsonl)
    timeshare report RUN_DIR --text the run's per-phase table (median, p90, max), sync GB/s and
                                    bubble, from the --summary file in RUN_DIR
    timeshare report RUN_DIR --samples [N]
                                    the last N samples of the run (samples.jsonl) as text
    timeshare trace RUN_DIR... [--out PATH]
                                    the run's timeline as a Chrome trace (Perfetto), from the
                                    log in RUN_DIR (several: the nodes of one job, in one file)

`timeshare --help` and `timeshare config show` list the registered engines (engines/registry.py),
which `[engine] trainer` and `rollout` choose from.

Exit codes: 0 done, 1 the run failed (the error names rank, role and phase), 2 bad input (an
unusable config names the key and its source), 128 + signal number when stopped by a signal.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from timeshare.capacity import plan_job
from timeshare.capacity import report as plan_report
from timeshare.config import Config, effective_lines, load_config
from timeshare.engines import registry
from timeshare.engines.model_dir import ARCHITECTURES, ModelShape, init_model_dir
from timeshare.errors import CheckpointError, ConfigError, CycleFailed, Interrupted, ReportError
from timeshare.state.diagram import DIAGRAMS

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "config":
            lines = effective_lines(load_config(args.config))
            sys.stdout.write("\n".join([*(f"# {line}" for line in _engines()), *lines]) + "\n")
        elif args.command == "plan":
            return _plan(args)
        elif args.command == "state":
            sys.stdout.write(DIAGRAMS[args.table]())
        elif args.command == "model":
            init_model_dir(args.directory, _shape(args), args.seed)
            print(f"wrote {args.directory}")
        elif args.command == "export":
            _export(args.checkpoint, args.directory)
        elif args.command == "task":
            _task_check(load_config(args.config, probe=False).config)
        elif args.command == "run":
            return _checked_run(args)
        elif args.command == "report" and args.samples is not None:
            _samples(args.run_dir, args.samples)
        elif args.command == "report":
            return _report(args.run_dir, text=args.text, out=args.out, steps=args.steps)
        elif args.command == "trace":
            return _trace(args.run_dirs, args.out)
    except (ConfigError, CheckpointError, ReportError) as exc:
        print(f"timeshare: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _plan(args: argparse.Namespace) -> int:
    file = load_config(args.config, probe=False).config
    plan = plan_job(load_config(args.config, overrides=_plan_overrides(args, file), probe=False))
    sys.stdout.write(plan_report.text(plan, str(args.config)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(plan_report.as_json(plan), indent=1) + "\n")
    for problem in plan.problems:
        print(f"timeshare plan: [{problem.rule}] {problem.message}", file=sys.stderr)
    return 0 if plan.feasible else EXIT_BAD_INPUT


def _plan_overrides(args: argparse.Namespace, file: Config) -> dict[str, tuple[object, str]]:
    """The command line's cluster shape over the file's; a new shape sets job.ranks to match."""
    given = {
        "cluster.nodes": args.nodes,
        "cluster.ranks_per_node": args.ranks_per_node,
        "cluster.device_gib": args.device_gib,
        "cluster.sync_gbps": args.sync_gbps,
    }
    overrides: dict[str, tuple[object, str]] = {
        key: (value, f"--{key.partition('.')[2].replace('_', '-')}")
        for key, value in given.items()
        if value is not None
    }
    if args.nodes is not None or args.ranks_per_node is not None:
        nodes = args.nodes or file.cluster.nodes
        per_node = args.ranks_per_node or file.job.ranks // file.cluster.nodes
        overrides["cluster.ranks_per_node"] = (per_node, "--ranks-per-node")
        overrides["job.ranks"] = (nodes * per_node, "--nodes x --ranks-per-node")
    return overrides


def _report(path: Path, *, text: bool, out: Path | None, steps: int) -> int:
    # Imported here: the summary's types come with the cycle's (torch), for this command only.
    from timeshare.report import picture  # noqa: PLC0415
    from timeshare.report.run_dir import RunDir  # noqa: PLC0415
    from timeshare.report.table import phase_table, render  # noqa: PLC0415

    run = RunDir.at(path)
    summary = run.summary()
    if text:
        sys.stdout.write(render(phase_table(summary.steps, summary.ranks), str(run.path)))
        return 0
    if steps < 1:
        raise ReportError(f"--steps must be at least 1, got {steps}")
    target = out or run.path / "report.png"
    if target.suffix != ".png":
        raise ReportError(f"--out {target}: the picture is a PNG, name it *.png")
    drawn = picture.figure(summary, run.records(), gantt_steps=steps)
    try:
        picture.save(drawn, target)
    except OSError as exc:
        raise ReportError(f"--out {target}: cannot write it: {exc}") from exc
    print(f"timeshare report: {target}")
    return 0


# Not trace.json: a run's live trace may be there, still being written.
REBUILT_TRACE = "trace-from-log.json"


def _trace(paths: list[Path], out: Path | None) -> int:
    from timeshare.report.run_dir import RunDir  # noqa: PLC0415
    from timeshare.report.trace import write_trace  # noqa: PLC0415

    runs = [RunDir.at(path) for path in paths]
    records = [record for run in runs for record in run.records()]
    target = out or runs[0].path / REBUILT_TRACE
    try:
        count = write_trace(records, target)
    except OSError as exc:
        raise ReportError(f"--out {target}: cannot write it: {exc}") from exc
    print(f"timeshare trace: {target} ({count} events; open it in ui.perfetto.dev)")
    return 0


def _export(source: Path, target: Path) -> None:
    """The checkpoint's trainer (the registry's exporters, each asked whether it is its own)
    writes it out; imported only now: torch and safetensors, for this command only."""
    exporters = registry.exporters()
    for module_name in exporters.values():
        exporter = importlib.import_module(module_name)
        if exporter.is_checkpoint(source):
            step = exporter.export_checkpoint(source, target)
            print(f"wrote {target} (from {step})")
            return
    raise ConfigError(
        f"{source}: no checkpoint of a trainer that exports ({', '.join(exporters)}): a step's "
        "directory, or a job's checkpoint directory holding such steps"
    )


def _shape(args: argparse.Namespace) -> ModelShape:
    return ModelShape(
        arch=args.arch,
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        max_positions=args.max_positions,
        tie_embeddings=args.tie_embeddings,
    )


def _checked_run(args: argparse.Namespace) -> int:
    config = _with_overrides(load_config(args.config).config, args)
    if config.engine.task.kind == "dataset":
        _check_dataset(config, data_changed=args.data_changed)
    return _run(config, args.summary, args.config.stem)


def _task_check(config: Config) -> None:
    """The report on stdout; a check that fails raises `ConfigError` (exit 2)."""
    # (imported here: the tokenizer and the data's libraries load for this command alone)
    from timeshare.daemon.task_check import check_task  # noqa: PLC0415

    found = check_task(config, out=sys.stderr)
    sys.stdout.write("\n".join(found.lines) + "\ntask check: ok\n")


def _check_dataset(config: Config, *, data_changed: bool) -> None:
    """`timeshare task check`'s checks, and the data against the checkpoints' (exit 2)."""
    from timeshare.daemon.task_check import check_task, checked_data  # noqa: PLC0415

    found = check_task(config, out=sys.stderr)
    for line in found.lines:
        print(f"timeshare run: {line}", file=sys.stderr)
    checked_data(config, found.fingerprint, data_changed=data_changed)


def _samples(run_dir: Path, count: int) -> None:
    """The last `count` samples of the run, as text."""
    from timeshare.report.samples import last_samples, render  # noqa: PLC0415

    sys.stdout.write(render(last_samples(run_dir, count)))


def _with_overrides(config: Config, args: argparse.Namespace) -> Config:
    job = config.job
    try:
        if args.ranks is not None:
            job = msgspec.structs.replace(job, ranks=args.ranks)
        if args.steps is not None:
            job = msgspec.structs.replace(job, steps=args.steps)
        # Validated as the file's values are: out of range is a ConfigError naming the flag.
        job = msgspec.convert(msgspec.to_builtins(job), type(job))
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--ranks/--steps: {exc}") from exc
    return msgspec.structs.replace(config, job=job)


def _run(config: Config, summary: Path | None, name: str) -> int:
    # Imported here, not at the top: only `timeshare run` needs the driver (torch and zmq, over
    # a second to load), anyio and structlog; `config show` and `state diagram` must stay fast.
    import anyio  # noqa: PLC0415

    from timeshare import logs  # noqa: PLC0415
    from timeshare.daemon.foreground import run_foreground  # noqa: PLC0415

    logs.configure(
        config.log.level, config.log.file, max_mb=config.log.max_mb, keep=config.log.keep
    )
    try:
        result = anyio.run(run_foreground, config, summary, name)
    except CycleFailed as failed:
        print(f"timeshare run: {failed}", file=sys.stderr)
        return EXIT_FAILED
    except Interrupted as interrupted:
        print(f"timeshare run: {interrupted}", file=sys.stderr)
        return 128 + interrupted.signum
    print(
        f"timeshare run: {result.lifecycle} at step {result.step} "
        f"({result.step - result.first_step} steps this run)"
        + (f"; summary in {summary}" if summary else "")
        + (f"; trace in {config.log.trace}" if config.log.trace else "")
    )
    return 0


def _engines() -> list[str]:
    """The registered engines, one line each, under a heading (--help, config show)."""
    return [
        "engines (engine.trainer and engine.rollout name one; [engine.<name>] is its table):",
        *(f"  {line}" for line in registry.described()),
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timeshare",
        description=__doc__.split("\n")[0],
        epilog="\n".join(_engines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the cycle in the foreground")
    run.add_argument("config", type=Path)
    run.add_argument("--summary", type=Path, help="write per-step figures to this JSON file")
    run.add_argument("--ranks", type=int, help="override job.ranks")
    run.add_argument("--steps", type=int, help="override job.steps")
    run.add_argument(
        "--data-changed",
        action="store_true",
        help="go on from checkpoints that learnt from other data (a dataset task)",
    )
    task = commands.add_parser("task", help="the job's task")
    task_commands = task.add_subparsers(dest="task_command", required=True)
    task_check = task_commands.add_parser(
        "check", help="every row, the stop set and the reward, before anything starts"
    )
    task_check.add_argument("config", type=Path)
    config = commands.add_parser("config", help="the job's configuration")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser(
        "show",
        help="print the effective config and its sources",
        epilog="\n".join(_engines()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("config", type=Path)
    plan = commands.add_parser(
        "plan", help="whether the job fits its cluster, before anything runs (a dry run)"
    )
    plan.add_argument("config", type=Path)
    plan.add_argument("--nodes", type=int, help="override cluster.nodes")
    plan.add_argument("--ranks-per-node", type=int, help="override cluster.ranks_per_node")
    plan.add_argument("--device-gib", type=float, help="one rank's accelerator memory, GiB")
    plan.add_argument("--sync-gbps", type=float, help="one rank's SYNC rate, GB/s")
    plan.add_argument("--json", type=Path, help="also write the plan to this JSON file")
    state = commands.add_parser("state", help="the tables every decision of the job comes from")
    state_commands = state.add_subparsers(dest="state_command", required=True)
    diagram = state_commands.add_parser("diagram", help="print a table as a Mermaid diagram")
    diagram.add_argument("table", nargs="?", choices=sorted(DIAGRAMS), default="job")
    model = commands.add_parser("model", help="transformers model directories")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    init = model_commands.add_parser(
        "init", help="write a random-initialised model from a seed, with the digit task's tokenizer"
    )
    init.add_argument("directory", type=Path, help="a new or empty directory")
    init.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    shape = ModelShape()
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        init.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(shape, name))
    init.add_argument("--max-positions", type=int, default=shape.max_positions)
    init.add_argument("--tie-embeddings", action="store_true")
    init.add_argument("--seed", type=int, default=0)
    report = commands.add_parser("report", help="what a run did, from its directory")
    report.add_argument(
        "run_dir", type=Path, help="where the run wrote its --summary file (and keeps log.jsonl)"
    )
    report.add_argument("--text", action="store_true", help="the per-phase table, as text")
    report.add_argument(
        "--samples",
        type=int,
        nargs="?",
        const=5,
        help="the last N samples (samples.jsonl) as text, 5 unless given",
    )
    report.add_argument("--out", type=Path, help="the PNG to write (default RUN_DIR/report.png)")
    report.add_argument(
        "--steps", type=int, default=3, help="how many of the last steps the timeline shows (3)"
    )
    trace = commands.add_parser("trace", help="a run's timeline as a Chrome trace (Perfetto)")
    trace.add_argument(
        "run_dirs",
        type=Path,
        nargs="+",
        metavar="RUN_DIR",
        help="where a run keeps its log.jsonl (several: the nodes of one job)",
    )
    trace.add_argument(
        "--out", type=Path, help=f"the file to write (default RUN_DIR/{REBUILT_TRACE})"
    )
    export = commands.add_parser(
        "export",
        help="a trainer's checkpoint as a transformers model ("
        + ", ".join(registry.exporters())
        + ")",
    )
    export.add_argument("checkpoint", type=Path, help="a step's directory or a job's checkpoints")
    export.add_argument("directory", type=Path, help="a new or empty directory")
    return parser


if __name__ == "__main__":
    sys.exit(main())
