"""A run's samples as text: what `timeshare report RUN_DIR --samples [N]` prints.

The rollout workers write the first `[log] samples_per_step` samples of each step and rank to
`RUN_DIR/samples.jsonl` (engines/task.py): prompt, completion, reward, the reward function's
extras and the finish reason, as text. The last N are read from the end of the file, whatever
its size.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

from timeshare.errors import ReportError

SAMPLES = "samples.jsonl"


def last_samples(run_dir: Path, count: int) -> list[dict[str, Any]]:
    """The last `count` samples the run wrote (a line that is not JSON is skipped: a run killed
    while writing leaves at most its last line torn)."""
    path = run_dir / SAMPLES
    if not path.is_file():
        raise ReportError(f"{path}: no samples (a run writes them with [log] samples_per_step > 0)")
    kept: deque[dict[str, Any]] = deque(maxlen=max(count, 0))
    with path.open() as lines:
        for line in lines:
            try:
                sample = json.loads(line)
            except ValueError:
                continue
            if isinstance(sample, dict):
                kept.append(sample)
    return list(kept)


def render(samples: list[dict[str, Any]]) -> str:
    """Each sample as a block of text: its step, rank, reward, finish reason, then its prompt
    and completion."""
    blocks = []
    for sample in samples:
        extras = sample.get("extras") or {}
        said = ", ".join(f"{k} {v:.4g}" for k, v in extras.items())
        head = (
            f"step {sample.get('step')}  rank {sample.get('rank')}  {sample.get('sample_id')}  "
            f"reward {sample.get('reward')}  {sample.get('finish_reason')}  "
            f"{sample.get('completion_tokens')} tokens" + (f"  ({said})" if said else "")
        )
        blocks.append(
            f"{head}\n--- prompt\n{sample.get('prompt')}\n--- completion\n"
            f"{sample.get('completion')}\n"
        )
    return "\n".join(blocks)
