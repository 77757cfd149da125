"""The reward pool (timeshare/task/reward_pool.py) with real reward processes on real pipes: a
failure is an outcome's error naming the function (never a score of 0), a hang is killed at its
deadline, a crash costs its sample alone, and no process outlives the pool."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from timeshare.errors import ConfigError, RewardFunctionError
from timeshare.task.reward_function import (
    RewardCall,
    RewardOutcome,
    RewardSpec,
)
from timeshare.task.reward_pool import RewardPool

WHERE = "rewards.py:compute_score"


def a_call(completion: str, index: int = 0, **fields: Any) -> RewardCall:
    values: dict[str, Any] = {
        "sample_id": f"s{index}",
        "row_index": index,
        "completion": completion,
        "prompt": "q",
        "label": "ok",
    }
    return RewardCall(**(values | fields))


def write(tmp_path: Path, source: str) -> None:
    (tmp_path / "rewards.py").write_text(textwrap.dedent(source))


def gone(pids: list[int]) -> bool:
    """Whether none of `pids` is a process any more (a zombie still is one)."""
    return not any(psutil.pid_exists(pid) for pid in pids)


@pytest.fixture
def pools() -> Iterator[list[RewardPool]]:
    """Pools a test starts, closed at its end whatever happened; none leaves a process."""
    started: list[RewardPool] = []
    yield started
    for pool in started:
        pool.close()


def start(pools: list[RewardPool], tmp_path: Path, **spec: Any) -> RewardPool:
    values: dict[str, Any] = {"path": "rewards.py", "processes": 1, "timeout_s": 5.0}
    pool = RewardPool(RewardSpec(**(values | spec)), base_dir=tmp_path, start_timeout_s=30.0)
    pools.append(pool)
    return pool


def test_scores_come_back_in_order(pools: list[RewardPool], tmp_path: Path) -> None:
    write(
        tmp_path,
        """
        def compute_score(completion, label, step):
            return float(completion == label) + step
        """,
    )
    pool = start(pools, tmp_path, processes=2)
    calls = [a_call("ok" if i % 2 else "no", i, step=i) for i in range(6)]
    outcomes = pool.score(calls)
    assert [o.score for o in outcomes] == [0.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert all(o.error is None for o in outcomes)
    assert pool.score([]) == []


def test_a_raising_reward_is_an_error_with_its_traceback_never_zero(
    pools: list[RewardPool], tmp_path: Path
) -> None:
    write(
        tmp_path,
        """
        def helper(completion):
            raise ValueError(f"cannot parse {completion!r}")

        def compute_score(completion):
            if completion == "bad":
                return helper(completion)
            return 1.0
        """,
    )
    pool = start(pools, tmp_path)
    bad, good = pool.score([a_call("bad", 0), a_call("good", 1)])
    assert bad.score is None
    assert bad.error is not None
    assert bad.error.startswith(f"{WHERE} raised ValueError: cannot parse 'bad'")
    assert "Traceback" in bad.error and "in helper" in bad.error
    assert "reward_child.py" not in bad.error  # the user's frames only
    assert bad.error.splitlines()[-1] == "ValueError: cannot parse 'bad'"
    assert good == RewardOutcome(score=1.0, seconds=good.seconds)


def test_a_hanging_reward_times_out_and_a_fresh_process_scores_the_next(
    pools: list[RewardPool], tmp_path: Path
) -> None:
    write(
        tmp_path,
        """
        import os, time

        def compute_score(completion):
            if completion == "hang":
                time.sleep(1000)
            return {"score": 1.0, "pid": os.getpid()}
        """,
    )
    pool = start(pools, tmp_path, timeout_s=1.0)
    [first] = pool.pids
    began = time.monotonic()
    hung, fine = pool.score([a_call("hang", 0), a_call("fine", 1)])
    assert time.monotonic() - began < 8.0
    assert hung.score is None
    assert hung.error is not None
    assert f"{WHERE} timed out after 1 s on sample s0" in hung.error
    assert fine.score == 1.0 and fine.error is None
    assert fine.extras["pid"] != first
    assert gone([first])


@pytest.mark.parametrize(
    ("returned", "said"),
    [
        ("float('nan')", "nan"),
        ("'0.5'", "of type str ('0.5')"),
        ("[1.0]", "of type list"),
        ("{'acc': 1.0}", 'without "score"'),
    ],
)
def test_what_is_not_a_reward_is_an_error_naming_the_function(
    pools: list[RewardPool], tmp_path: Path, returned: str, said: str
) -> None:
    write(tmp_path, f"def compute_score(completion):\n    return {returned}\n")
    [outcome] = start(pools, tmp_path).score([a_call("x")])
    assert outcome.score is None
    assert outcome.error is not None
    assert WHERE in outcome.error and said in outcome.error


def test_a_reward_that_kills_its_process_costs_its_sample_alone(
    pools: list[RewardPool], tmp_path: Path
) -> None:
    write(
        tmp_path,
        """
        import os, signal

        def compute_score(completion):
            if completion == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if completion == "exit":
                os._exit(3)
            return 1.0
        """,
    )
    pool = start(pools, tmp_path)
    outcomes = pool.score([a_call(c, i) for i, c in enumerate(["kill", "a", "exit", "b"])])
    killed, a, exited, b = outcomes
    assert killed.score is None and exited.score is None
    assert (
        killed.error
        == f"{WHERE}: the reward process died (killed by SIGKILL) while scoring "
        + ("sample s0 (row 0)")
    )
    assert exited.error is not None and "died (exit code 3)" in exited.error
    assert (a.score, b.score) == (1.0, 1.0)


def test_printing_and_reading_stdin_do_not_touch_the_frames(
    pools: list[RewardPool], tmp_path: Path
) -> None:
    write(
        tmp_path,
        """
        import sys

        print("loading the reward file")

        def compute_score(completion):
            print("scoring", completion, "\\x00\\x00\\x00\\x10 not a frame")
            sys.stdout.flush()
            return float(sys.stdin.read() == "")
        """,
    )
    pool = start(pools, tmp_path)
    assert [o.score for o in pool.score([a_call("a", 0), a_call("b", 1)])] == [1.0, 1.0]


def test_an_async_reward_runs(pools: list[RewardPool], tmp_path: Path) -> None:
    write(
        tmp_path,
        """
        import asyncio

        async def compute_score(completion, label):
            await asyncio.sleep(0.01)
            return float(completion == label)
        """,
    )
    assert [o.score for o in start(pools, tmp_path).score([a_call("ok")])] == [1.0]


def test_a_verl_reward_file_loads_unchanged(pools: list[RewardPool], tmp_path: Path) -> None:
    write(
        tmp_path,
        """
        import re


        def extract_solution(solution_str):
            found = re.findall(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
            return found[-1].replace(",", "") if found else None


        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            assert data_source == "openai/gsm8k", data_source
            assert extra_info == {"split": "train", "index": 4}, extra_info
            answer = extract_solution(solution_str)
            return {"score": 1.0 if answer == ground_truth else 0.0, "found": answer is not None}
        """,
    )
    row = {"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": 4}}
    calls = [
        a_call("so #### 1,234", 0, label="1234", row=row),
        a_call("no idea", 1, label="1234", row=row),
    ]
    right, none = start(pools, tmp_path).score(calls)
    assert (right.score, right.extras, right.error) == (1.0, {"found": 1.0}, None)
    assert (none.score, none.extras, none.error) == (0.0, {"found": 0.0}, None)


def test_none_skips_a_sample_without_an_error(pools: list[RewardPool], tmp_path: Path) -> None:
    write(tmp_path, "def compute_score(completion):\n    return None\n")
    [outcome] = start(pools, tmp_path).score([a_call("x")])
    assert (outcome.score, outcome.error) == (None, None)


def test_a_built_in_reward_loads_by_module_name(pools: list[RewardPool], tmp_path: Path) -> None:
    pool = start(pools, tmp_path, path="timeshare.rewards", name="math")
    calls = [a_call("so \\boxed{72}", 0, label="#### 72"), a_call("it is 71", 1, label="72")]
    assert [(o.score, o.error) for o in pool.score(calls)] == [(1.0, None), (0.0, None)]


def test_a_large_call_is_written_whole(pools: list[RewardPool], tmp_path: Path) -> None:
    write(tmp_path, "def compute_score(completion, document):\n    return len(document)\n")
    pool = start(pools, tmp_path)
    document = "x" * 3_000_000  # far more than a pipe holds
    [outcome] = pool.score([a_call("x", row={"document": document})])
    assert (outcome.score, outcome.error) == (3_000_000.0, None)


@pytest.mark.parametrize(
    ("source", "spec", "said"),
    [
        (None, {}, "rewards.py:compute_score: the reward file .* does not exist"),
        ("def score(completion):\n    return 1\n", {}, "defines no 'compute_score'"),
        ("import no_such_module_here\n", {}, "No module named 'no_such_module_here'"),
        ("def compute_score(completion):\n    return 1\n", {"name": "other"}, "rewards.py:other"),
    ],
)
def test_what_cannot_load_is_a_config_error_at_start(
    tmp_path: Path, source: str | None, spec: dict[str, Any], said: str
) -> None:
    if source is not None:
        write(tmp_path, source)
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ConfigError, match=said):
        RewardPool(RewardSpec(path="rewards.py", processes=2, **spec), base_dir=tmp_path)
    assert {p.pid for p in psutil.Process().children()} <= before


def test_a_parameter_no_column_supplies_is_a_config_error_at_start(tmp_path: Path) -> None:
    write(tmp_path, "def compute_score(completion, reference):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=f"{WHERE}: nothing supplies its parameter 'reference'"):
        RewardPool(
            RewardSpec(path="rewards.py", processes=1),
            base_dir=tmp_path,
            columns=["question", "answer"],
        )
    with RewardPool(
        RewardSpec(path="rewards.py", processes=1), base_dir=tmp_path, columns=["reference"]
    ) as pool:
        [outcome] = pool.score([a_call("x", row={"reference": "r"})])
    assert outcome.score == 1.0


def test_processes_score_at_once(pools: list[RewardPool], tmp_path: Path) -> None:
    write(
        tmp_path,
        """
        import os, time

        def compute_score(completion):
            time.sleep(0.3)
            return {"score": 1.0, "pid": os.getpid()}
        """,
    )
    pool = start(pools, tmp_path, processes=2)
    outcomes = pool.score([a_call("x", i) for i in range(4)])
    pids = {int(o.extras["pid"]) for o in outcomes}
    assert pids == set(pool.pids) and len(pids) == 2


def test_progress_is_reported_while_a_slow_reward_runs(
    pools: list[RewardPool], tmp_path: Path
) -> None:
    write(tmp_path, "import time\n\ndef compute_score(completion):\n    time.sleep(1.6)\n")
    pool = start(pools, tmp_path)
    beats: list[float] = []
    pool.score([a_call("x")], progress=lambda: beats.append(time.monotonic()))
    assert len(beats) >= 2


def test_close_leaves_no_process_and_the_pool_refuses_work_after(tmp_path: Path) -> None:
    write(tmp_path, "def compute_score(completion):\n    return 1.0\n")
    pool = RewardPool(RewardSpec(path="rewards.py", processes=3), base_dir=tmp_path)
    pids = pool.pids
    assert len(pids) == 3 and not gone(pids)
    assert {p.pid for p in psutil.Process().children()} >= set(pids)
    pool.score([a_call("x")])
    began = time.monotonic()
    pool.close()
    pool.close()
    assert time.monotonic() - began < 3.0
    assert gone(pids)
    assert pool.pids == []
    with pytest.raises(RewardFunctionError, match="closed"):
        pool.score([a_call("x")])


def test_a_failing_caller_closes_the_pool_and_kills_a_busy_process(tmp_path: Path) -> None:
    write(
        tmp_path,
        """
        import time

        def compute_score(completion):
            time.sleep(1000)
        """,
    )
    pool = RewardPool(RewardSpec(path="rewards.py", processes=2), base_dir=tmp_path)
    pids = pool.pids

    def stop() -> None:
        raise RuntimeError("the worker is stopping")

    with pytest.raises(RuntimeError, match="stopping"):
        pool.score([a_call("x")], progress=stop)
    assert gone(pids)
    with pytest.raises(RewardFunctionError, match="closed"):
        pool.score([a_call("x")])


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("import os\nos._exit(4)\n", "died \\(exit code 4\\) before its function loaded"),
        ("import time\ntime.sleep(1000)\n", "did not load its function within 1 s"),
    ],
)
def test_a_process_that_cannot_start_is_an_error_at_start(
    tmp_path: Path, source: str, said: str
) -> None:
    write(tmp_path, source)
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(RewardFunctionError, match=f"{WHERE}: a reward process {said}"):
        RewardPool(
            RewardSpec(path="rewards.py", processes=2), base_dir=tmp_path, start_timeout_s=1.0
        )
    assert {p.pid for p in psutil.Process().children()} <= before


def test_a_row_value_without_a_msgpack_form_is_refused_and_the_pool_goes_on(
    pools: list[RewardPool], tmp_path: Path
) -> None:
    write(tmp_path, "def compute_score(completion):\n    return 1.0\n")
    pool = start(pools, tmp_path)
    with pytest.raises(RewardFunctionError, match=r"sample s1 \(row 1\) cannot be sent"):
        pool.score([a_call("x", 0), a_call("x", 1, row={"when": object()})])
    assert [o.score for o in pool.score([a_call("x")])] == [1.0]


def test_a_process_killed_while_idle_costs_no_sample(
    pools: list[RewardPool], tmp_path: Path
) -> None:
    write(tmp_path, "def compute_score(completion):\n    return 1.0\n")
    pool = start(pools, tmp_path, processes=2)
    killed = pool.pids
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    outcomes = pool.score([a_call("x", i) for i in range(3)])
    assert [(o.score, o.error) for o in outcomes] == [(1.0, None)] * 3
    assert gone(killed) and not set(pool.pids) & set(killed)
