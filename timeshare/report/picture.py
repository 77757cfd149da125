"""The picture of a run: what `timeshare report RUN_DIR [--out report.png]` draws (matplotlib,
the `report` extra).

    (a) the last steps, rank by rank and worker by worker: each phase a light band, the
        worker's own work in it solid; the gaps in the solid are the bubble
    (b) each step's time, stacked by phase (each phase's slowest rank, as the summary has it)
    (c) the reward of every step        (d) the sync rate of every step, GB/s

Phases have the same colour in every picture (`PHASE_COLOURS`). `figure` builds the figure and
returns it, so that a test can look at its axes before anything is saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from timeshare.cycle.records import PhaseRecord, Record
from timeshare.cycle.steps import PHASES
from timeshare.errors import ReportError
from timeshare.protocols.commands.results import ROLES
from timeshare.report.run_dir import Summary

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

GANTT_STEPS = 3  # the last steps panel (a) shows
PHASE_COLOURS = {
    "train": "#4c72b0",
    "offload": "#8c8c8c",
    "sync": "#dd8452",
    "barrier": "#c44e52",
    "resume": "#937860",
    "rollout": "#55a868",
}
assert list(PHASE_COLOURS) == PHASES
PANELS = ("timeline", "step time", "reward", "sync")


def figure(
    summary: Summary, records: Sequence[Record], *, gantt_steps: int = GANTT_STEPS
) -> Figure:
    """The four panels of a run, with its title; not yet saved."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 - the `report` extra, for this only
    except ImportError as exc:
        raise ReportError(
            f"the picture needs matplotlib: pip install 'timeshare[report]' ({exc})"
        ) from exc

    picture = Figure(figsize=(14, 10), layout="constrained")
    grid = picture.add_gridspec(3, 2, height_ratios=(1.3, 1, 1))
    gantt = picture.add_subplot(grid[0, :])
    stacked = picture.add_subplot(grid[1, :])
    reward = picture.add_subplot(grid[2, 0])
    sync = picture.add_subplot(grid[2, 1])
    for axes, label in zip((gantt, stacked, reward, sync), PANELS, strict=True):
        axes.set_label(label)
    phases = [record for record in records if isinstance(record, PhaseRecord)]
    _timeline(gantt, phases, gantt_steps)
    _step_time(stacked, summary)
    _reward(reward, summary)
    _sync(sync, summary)
    first, last = summary.steps[0].step, summary.steps[-1].step
    picture.suptitle(
        f"{summary.config}: {summary.ranks} ranks, steps {first}-{last} ({len(summary.steps)})",
        fontsize=14,
    )
    return picture


def save(picture: Figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.savefig(path, dpi=100, format="png")


def _timeline(axes: Axes, records: Sequence[PhaseRecord], steps: int) -> None:
    shown = _last_steps(records, steps)
    last = max(record.step for record in shown)
    origin = min(_wall_s(record, record.start) for record in shown)
    rows = sorted({(record.rank, role) for record in shown for role in ROLES})
    for row, (rank, role) in enumerate(rows):
        for record in (r for r in shown if r.rank == rank):
            colour = PHASE_COLOURS[record.phase]
            start = _wall_s(record, record.start) - origin
            axes.broken_barh([(start, record.seconds)], (row - 0.4, 0.8), color=colour, alpha=0.25)
            work = _command_span(record, role)
            if work is not None:
                work_start = _wall_s(record, work[0]) - origin
                axes.broken_barh(
                    [(work_start, work[1])], (row - 0.3, 0.6), color=colour, alpha=0.95
                )
    axes.set_yticks(range(len(rows)), [f"rank {rank} {role}" for rank, role in rows])
    axes.invert_yaxis()
    axes.set_xlabel("seconds since the first phase shown")
    first_shown = min(record.step for record in shown)
    axes.set_title(
        f"steps {first_shown}-{last}: phases (light) and each worker's own work in them (solid); "
        "gaps in the solid are the bubble",
        fontsize=10,
    )
    _phase_legend(axes)


def _last_steps(records: Sequence[PhaseRecord], steps: int) -> list[PhaseRecord]:
    """The records of the last `steps` steps, each (rank, phase, step) once: a run resumed in
    the same log ran its first step again, and the latest is what the summary has."""
    latest = {(r.rank, r.phase, r.step): r for r in records}
    last = max(step for _, _, step in latest)
    return [record for record in latest.values() if record.step > last - steps]


def _wall_s(record: PhaseRecord, monotonic: float) -> float:
    """A time of the record's process on the wall clock, in seconds: processes of one log may
    have run apart, or on a machine since rebooted, and their monotonic clocks do not compare."""
    return record.clock.wall_ns_of(monotonic) / 1e9


def _command_span(record: PhaseRecord, role: str) -> tuple[float, float] | None:
    """When the worker ran the phase's command (its first span, named after the command)."""
    spans = record.trainer if role == "trainer" else record.rollout
    whole = next((span for span in spans if span.name == record.phase), None)
    return None if whole is None else (whole.start, whole.seconds)


def _step_time(axes: Axes, summary: Summary) -> None:
    steps = [figures.step for figures in summary.steps]
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        seconds = [figures.phases[phase] for figures in summary.steps]
        axes.bar(steps, seconds, bottom=bottom, color=PHASE_COLOURS[phase], label=phase, width=0.8)
        bottom = [b + s for b, s in zip(bottom, seconds, strict=True)]
    axes.plot(steps, [f.step_s for f in summary.steps], "k.-", label="step (wall)", linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel("seconds")
    axes.set_title("step time by phase (each phase: its slowest rank)", fontsize=10)
    axes.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    _whole_steps(axes)


def _reward(axes: Axes, summary: Summary) -> None:
    points = [(f.step, f.reward_mean) for f in summary.steps if f.reward_mean is not None]
    val = [(f.step, f.val_reward_mean) for f in summary.steps if f.val_reward_mean is not None]
    if points:
        axes.plot([s for s, _ in points], [r for _, r in points], "o-", color="#4c72b0")
    if val:
        axes.plot([s for s, _ in val], [r for _, r in val], "s--", color="#dd8452")
        axes.legend(["train", "validation"], fontsize=8)
    if not points and not val:
        axes.text(0.5, 0.5, "this task scores nothing", ha="center", transform=axes.transAxes)
    axes.set_xlabel("step")
    axes.set_ylabel("mean reward")
    _whole_steps(axes)
    axes.set_title("reward of the samples each step trained on", fontsize=10)


def _sync(axes: Axes, summary: Summary) -> None:
    axes.plot(
        [f.step for f in summary.steps], [f.sync.gbps for f in summary.steps], "o-", color="#dd8452"
    )
    axes.set_xlabel("step")
    axes.set_ylabel("GB/s")
    axes.set_ylim(bottom=0)
    _whole_steps(axes)
    axes.set_title("weight sync rate (bytes of every rank / slowest rank's transfer)", fontsize=10)


def _phase_legend(axes: Axes) -> None:
    from matplotlib.patches import Patch  # noqa: PLC0415

    handles = [Patch(color=colour, label=phase) for phase, colour in PHASE_COLOURS.items()]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)


def _whole_steps(axes: Axes) -> None:
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
