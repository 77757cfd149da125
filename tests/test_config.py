"""Configuration: TOML plus TIMESHARE_* overrides; every bad input is one error naming the key
and where its value came from; deadlines must nest; `timeshare config show` and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.configs import TINY, merged, toml_file
from timeshare.config import Config, effective_lines, load_config
from timeshare.engines.simulated.spec import SimulatedSpec
from timeshare.errors import ConfigError
from timeshare.task import digit_tokenizer
from timeshare.task.files import TokenizerSource

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "simulated.toml"
TINY_GRPO = ROOT / "examples" / "tiny-grpo.toml"  # the torch_ref engine: its settings in full


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_the_example_loads_with_its_sources() -> None:
    loaded = load_config(EXAMPLE, environ={})
    assert loaded.config.job.steps == 30
    assert loaded.config.engine.settings("simulated", SimulatedSpec).account_memory is False
    assert loaded.source_of("job.steps") == f"file {EXAMPLE}"
    assert loaded.source_of("transfer.linger_s") == "default"


def test_environment_overrides_win_and_are_named(tmp_path: Path) -> None:
    path = write(tmp_path, "[job]\nranks = 3\n")
    env = {
        "TIMESHARE_JOB__RANKS": "5",
        "TIMESHARE_JOB__RUNTIME_DIR": "/tmp/ts-env",
        "TIMESHARE_ENGINE__SIMULATED__ENGINE_SPAN": "5",
        "UNRELATED": "x",
    }
    loaded = load_config(path, environ=env)
    assert loaded.config.job.ranks == 5
    assert loaded.config.job.runtime_dir == "/tmp/ts-env"  # a bare word is a string
    assert loaded.config.engine.settings("simulated", SimulatedSpec).engine_span == 5
    lines = effective_lines(loaded)
    assert "job.ranks = 5  # env TIMESHARE_JOB__RANKS" in lines
    assert 'job.runtime_dir = "/tmp/ts-env"  # env TIMESHARE_JOB__RUNTIME_DIR' in lines
    assert "deadlines.phase_s = 30.0  # default" in lines


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("[job]\nrnks = 2\n", {}, r"job.rnks: Object contains unknown field `rnks` \(from file "),
        ("[jobs]\nranks = 2\n", {}, r"jobs: Object contains unknown field `jobs` \(from file "),
        ("[job]\nranks = 0\n", {}, r"job.ranks: Expected `int` >= 1 \(from file "),
        ('[job]\nranks = "two"\n', {}, r"job.ranks: Expected `int`, got `str` \(from file "),
        ("[engine.simulated]\nspan = 2\n", {}, r"engine.simulated.span: Object contains unknown"),
        ("[transfer]\nbucket_mb = -1\n", {}, r"transfer: bucket_mb must be positive"),
        ("", {"TIMESHARE_JOB__STEPS": "many"}, r"job.steps: .* \(from env TIMESHARE_JOB__STEPS\)"),
        ("", {"TIMESHARE_JOB__NOPE": "1"}, r"job.nope: .*unknown field .*TIMESHARE_JOB__NOPE"),
        ("", {"TIMESHARE_JOB": "1"}, r"TIMESHARE_JOB: expected TIMESHARE_<SECTION>__<KEY>"),
        ("[job\n", {}, r"is not valid TOML"),
    ],
)
def test_bad_input_is_one_error_naming_key_and_source(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), environ=env)


def test_deadlines_must_nest(tmp_path: Path) -> None:
    path = write(tmp_path, "[deadlines]\nphase_s = 5.0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"TIMESHARE_DEADLINES__STALL_S": "8"})
    assert str(info.value) == (
        "deadlines.stall_s (8 s, from env TIMESHARE_DEADLINES__STALL_S) must be shorter than "
        f"deadlines.phase_s (5 s, from file {path}), which it runs inside"
    )


def test_per_command_deadlines(tmp_path: Path) -> None:
    path = write(tmp_path, "[deadlines.commands]\nsync = 25.0\n")
    deadlines = load_config(path, environ={}).config.deadlines
    assert (deadlines.for_command("sync"), deadlines.for_command("train")) == (25.0, 30.0)
    with pytest.raises(ConfigError, match=r"deadlines.commands.synch: no such command \(from env"):
        load_config(path, environ={"TIMESHARE_DEADLINES__COMMANDS__SYNCH": "5"})
    with pytest.raises(
        ConfigError,
        match=r"transfer.ack_timeout_s \(10 s, from default\) must be "
        r"shorter than deadlines.commands.sync \(8 s, from env",
    ):
        load_config(
            path,
            environ={
                "TIMESHARE_DEADLINES__COMMANDS__SYNC": "8",
                "TIMESHARE_DEADLINES__STALL_S": "5",
            },
        )


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})


def test_config_show_prints_and_bad_config_exits_2(tmp_path: Path) -> None:
    show = [sys.executable, "-m", "timeshare", "config", "show"]
    good = subprocess.run(
        [*show, str(EXAMPLE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert good.returncode == 0
    assert f"job.steps = 30  # file {EXAMPLE}" in good.stdout.splitlines()
    bad = subprocess.run(
        [*show, str(write(tmp_path, "[job]\nrnks = 1\n"))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.startswith("timeshare: job.rnks: Object contains unknown field")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_section_given_in_part_keeps_the_job_defaults_for_the_rest(tmp_path: Path) -> None:
    transfer = load_config(write(tmp_path, "[transfer]\nbucket_mb = 2.0\n"), environ={})
    assert transfer.config.transfer == msgspec.structs.replace(Config().transfer, bucket_mb=2.0)
    assert transfer.source_of("transfer.bucket_mb").startswith("file ")
    assert transfer.source_of("transfer.begin_timeout_s") == "default"


def heavy_modules_imported_by(statements: str) -> list[str]:
    """Which of torch and zmq a fresh interpreter has imported after running `statements`."""
    heavy = "{'torch', 'zmq', 'vllm', 'transformers', 'safetensors'}"
    report = f"import json, sys\nprint(json.dumps(sorted({heavy} & set(sys.modules))))"
    script = f"{statements}\n{report}"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return msgspec.json.decode(done.stdout.splitlines()[-1], type=list[str])


def test_loading_a_config_imports_neither_torch_nor_an_engines_library() -> None:
    # Reading a config (`timeshare config show`, a tool that checks one) must not pay the second
    # or more that loading torch takes: every settings module (each registered engine's spec
    # module included) stays free of torch, zmq and the engines' libraries.
    load = (
        "from pathlib import Path\n"
        "from timeshare.config import load_config\n"
        f"load_config(Path({str(TINY_GRPO)!r}), environ={{}})"
    )
    assert heavy_modules_imported_by(load) == []


def test_config_show_imports_neither_torch_nor_zmq() -> None:
    show = (
        "import contextlib, io\n"
        "from timeshare.daemon.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['config', 'show', {str(TINY_GRPO)!r}]) == 0"
    )
    assert heavy_modules_imported_by(show) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[engine]\ntrainer = "deepspeed"\n',
            r"engine.trainer = 'deepspeed': no such engine; trainer engines are "
            r"simulated, torch_ref, fsdp, megatron",
        ),
        (
            '[engine]\nrollout = "fsdp"\n',
            r"engine.rollout = 'fsdp': fsdp is not a rollout engine; rollout engines are "
            r"simulated, torch_ref, vllm",
        ),
        (
            '[engine]\ntrainer = "torch_ref"\n',  # the rollout stays simulated
            r"engine.trainer = 'torch_ref' \(from file .*\) and engine.rollout = 'simulated' "
            r"\(from default\) do not pair",
        ),
        (
            '[engine]\ntrainer = "torch_ref"\nrollout = "torch_ref"\n[engine.vllm]\nseed = 3\n',
            r"engine.vllm.seed is set \(from file .*\), but this job runs no vllm engine",
        ),
        ("[engine.deepspeed]\nseed = 3\n", r"engine.deepspeed: Object contains unknown field"),
    ],
)
def test_engines_come_from_the_registry_and_a_bad_choice_is_named(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), environ={})


def test_a_rollout_engines_generate_deadline_runs_inside_rollouts(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\ntrainer = "torch_ref"\nrollout = "torch_ref"\n')
    assert load_config(path, environ={}).config.engine.rollout == "torch_ref"  # derived: fine
    env = {"TIMESHARE_ENGINE__TORCH_REF__GENERATE_TIMEOUT_S": "45"}
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=env)
    assert str(info.value) == (
        "engine.torch_ref.generate_timeout_s (45 s, from env "
        "TIMESHARE_ENGINE__TORCH_REF__GENERATE_TIMEOUT_S) must be shorter than "
        "deadlines.phase_s (30 s, from default), which it runs inside"
    )
    env["TIMESHARE_DEADLINES__COMMANDS__ROLLOUT"] = "50"
    assert load_config(path, environ=env).config.deadlines.for_command("rollout") == 50


def test_a_bad_engine_choice_names_the_key_and_where_it_came_from(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\nrollout = "torch_ref"\n')
    with pytest.raises(ConfigError) as unknown:
        load_config(path, environ={"TIMESHARE_ENGINE__TRAINER": "deepspeed"})
    assert str(unknown.value) == (
        "engine.trainer = 'deepspeed': no such engine; trainer engines are simulated, torch_ref, "
        "fsdp, megatron (from env TIMESHARE_ENGINE__TRAINER)"
    )
    env = {"TIMESHARE_ENGINE__TRAINER": "torch_ref", "TIMESHARE_ENGINE__VLLM__SEED": "3"}
    with pytest.raises(ConfigError, match=r"^engine.vllm.seed is set \(from env TIMESHARE_EN"):
        load_config(path, environ=env)


def test_an_unknown_engine_exits_2_and_help_lists_the_registered_ones(tmp_path: Path) -> None:
    timeshare = [sys.executable, "-m", "timeshare"]
    bad = subprocess.run(
        [*timeshare, "config", "show", str(write(tmp_path, '[engine]\nrollout = "nope"\n'))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert "rollout engines are simulated, torch_ref, vllm" in bad.stderr
    helped = subprocess.run(
        [*timeshare, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    shown = subprocess.run(
        [*timeshare, "config", "show", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    for output in (helped.stdout, shown.stdout):
        lines = [line.lstrip("# ") for line in output.splitlines()]
        assert [line.split()[0] for line in lines if "trainer+rollout" in line] == [
            "simulated",
            "torch_ref",
        ]
    assert "vllm       rollout" in helped.stdout and "fsdp       trainer" in shown.stdout


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (  # one rank per node: a TP 2 engine would need the devices of two
            {"job": {"ranks": 1}, "engine": {"vllm": {"tensor_parallel_size": 2}}},
            r"engine.vllm.tensor_parallel_size \(2, from file .*\) must divide the ranks of a "
            r"node \(1\)",
        ),
        (  # 4 attention heads over 3 workers
            {"job": {"ranks": 3}, "engine": {"vllm": {"tensor_parallel_size": 3}}},
            r"engine.vllm.tensor_parallel_size \(3\) does not divide the model's attention "
            r"heads \(4\)",
        ),
        (  # 6 heads split over 3 workers, but their 2 key/value heads neither split nor repeat
            {
                "job": {"ranks": 3},
                "engine": {
                    "rollout": "sglang",
                    "sglang": {"tp_size": 3},
                    "torch_ref": {"model": {"hidden_size": 192, "num_attention_heads": 6}},
                },
            },
            r"engine.sglang.tp_size \(3\) neither divides the model's key/value heads \(2\)",
        ),
    ],
)
def test_a_rollout_tp_size_the_engine_cannot_take_is_refused_naming_the_key(
    tmp_path: Path, sections: dict[str, Any], message: str
) -> None:
    model = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    base = merged(TINY, {"engine": {"rollout": "vllm", "torch_ref": {"model": model}}})
    job = merged(base, sections)
    with pytest.raises(ConfigError, match=message):
        load_config(toml_file(tmp_path, job), probe=False)


def torch_ref_job(tmp_path: Path, *, model: str = "", task: str = "", stop: str = "") -> Path:
    """A torch_ref job: its model from `model` (a directory) or inline, `[engine.task]` keys."""
    lines = ['[engine]\ntrainer = "torch_ref"\nrollout = "torch_ref"\n']
    lines.append(f"[engine.task]\n{task}{stop}\n")
    lines.append(f'[engine.torch_ref]\nmodel_dir = "{model}"\n' if model else "")
    return write(tmp_path, "".join(lines))


def checkpoint_dir(root: Path, vocab_size: int = 16, **generation: object) -> Path:
    """A torch_ref model directory's config.json (no tokenizer), and a generation config."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(f'{{"vocab_size": {vocab_size}}}')
    if generation:
        (root / "generation_config.json").write_text(msgspec.json.encode(generation).decode())
    return root


def test_a_model_directory_without_a_tokenizer_exits_2_naming_the_key(tmp_path: Path) -> None:
    model = checkpoint_dir(tmp_path / "model")
    show = [sys.executable, "-m", "timeshare", "config", "show"]
    bad = subprocess.run(
        [*show, str(torch_ref_job(tmp_path, model=str(model)))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith(f"timeshare: engine.torch_ref.model_dir {model}/config.json")
    assert "holds no tokenizer" in bad.stderr and "set engine.task.tokenizer" in bad.stderr
    digit_tokenizer.save(tmp_path / "tokenizer")  # the `tokenizer` key mends it
    job = torch_ref_job(tmp_path, model=str(model), task=f'tokenizer = "{tmp_path}/tokenizer"\n')
    good = subprocess.run(
        [*show, str(job)], capture_output=True, text=True, timeout=60, check=False
    )
    assert good.returncode == 0, good.stderr


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "empty tokenizer dir",
            r"^engine\.task\.tokenizer \(.*, from file .*\) holds no tokenizer",
        ),
        ("inline vocab 14", r"^engine\.torch_ref\.model: vocab_size \(14\) is smaller than the "),
        ("tokenizer key, vocab 14", r"vocab_size \(14\) .* 15 tokens \(engine\.task\.tokenizer"),
        ("stop id beyond", r"^engine\.task\.stop_token_ids \[16\] \(from file .*\): beyond"),
        ("generation eos beyond", r"EOS \[40\] \(the tokenizer's and generation_config"),
        ("no chat template", r"the tokenizer has no chat template"),
    ],
)
def test_a_tokenizer_the_model_cannot_take_is_refused_at_load(
    tmp_path: Path, case: str, message: str
) -> None:
    tokenizer = tmp_path / "tokenizer"
    digit_tokenizer.save(tokenizer)
    key = f'tokenizer = "{tokenizer}"\n'
    if case == "empty tokenizer dir":
        (tmp_path / "empty").mkdir()
        job = torch_ref_job(tmp_path, task=f'tokenizer = "{tmp_path}/empty"\n')
    elif case == "inline vocab 14":
        job = write(tmp_path, f"{TORCH_REF}[engine.torch_ref.model]\nvocab_size = 14\n")
    elif case == "tokenizer key, vocab 14":
        model = checkpoint_dir(tmp_path / "model", vocab_size=14)
        job = torch_ref_job(tmp_path, model=str(model), task=key)
    elif case == "stop id beyond":
        job = torch_ref_job(tmp_path, stop="stop_token_ids = [3, 16]\n")
    elif case == "generation eos beyond":
        model = checkpoint_dir(tmp_path / "model", eos_token_id=[12, 40])
        job = torch_ref_job(tmp_path, model=str(model), task=key)
    else:
        config = tokenizer / "tokenizer_config.json"
        config.write_text(config.read_text().replace('"chat_template"', '"no_template"'))
        job = torch_ref_job(tmp_path, task=key)
    with pytest.raises(ConfigError, match=message):
        load_config(job, environ={})


TORCH_REF = '[engine]\ntrainer = "torch_ref"\nrollout = "torch_ref"\n'


def test_a_model_directory_with_its_tokenizer_loads_without_transformers(tmp_path: Path) -> None:
    model = checkpoint_dir(tmp_path / "model", eos_token_id=12)
    digit_tokenizer.save(model)
    job = torch_ref_job(tmp_path, model=str(model))
    loaded = load_config(job, environ={})
    assert loaded.config.engine.tokenizer_source() == TokenizerSource(
        str(model), f"engine.torch_ref.model_dir {model}/config.json", str(model)
    )
    load = (
        "from pathlib import Path\n"
        "from timeshare.config import load_config\n"
        f"load_config(Path({str(job)!r}), environ={{}})"
    )
    assert heavy_modules_imported_by(load) == []


def test_the_renamed_completion_tokens_is_refused_by_its_new_name(tmp_path: Path) -> None:
    old = write(tmp_path, "[engine.task]\ncompletion_tokens = 6\n")
    with pytest.raises(ConfigError, match=r"completion_tokens is now max_completion_tokens"):
        load_config(old, environ={})
    new = write(tmp_path, "[engine.task]\nmax_prompt_tokens = 5\nmax_completion_tokens = 6\n")
    task = load_config(new, environ={}).config.engine.task
    assert (task.max_prompt_tokens, task.max_completion_tokens, task.sequence_tokens) == (5, 6, 11)
