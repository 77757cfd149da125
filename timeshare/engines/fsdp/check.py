"""Is `[engine.fsdp] model_dir` a model transformers can load? Asked before any worker starts.

`check_model_dir` runs this module in a child process (child_check.py says why):

    python -m timeshare.engines.fsdp.check '{"model_dir": ..., "cpu_only": ...}'

The child reads the config with transformers, builds the model on the meta device (no memory, no
weights read) and compares its state dict with the names and shapes in the safetensors headers.
The first problem found is the answer, naming the path: no config.json, a config transformers
cannot read, an architecture it does not know or that is not a causal LM, no weights, tensors
missing, unexpected or of the wrong shape. With `cpu_only` (`[engine] batch_invariant`, device
"auto") it first asks torch whether "auto" is CUDA here: the project's batch-invariant mode is a
CPU mode (engines/invariance.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from timeshare.engines.child_check import answer, ask_child
from timeshare.engines.fsdp.spec import FsdpSpec
from timeshare.engines.model_dir import weights_problem
from timeshare.errors import ConfigError

if TYPE_CHECKING:
    from timeshare.engines.registry import Role
    from timeshare.engines.spec import EngineChoice

CHECK_TIMEOUT_S = 120.0  # importing transformers and torch on a loaded machine


class ProbeRequest(msgspec.Struct, frozen=True):
    model_dir: str
    cpu_only: bool = False  # the switch on, device "auto": refused where that is CUDA


def check(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The registry's check (registry.py): a model directory named, and micro-batches that
    divide a minibatch. (What the directory holds is read by `trained_model`, which names
    what is missing, and asked of transformers by the probe.)"""
    fsdp = spec.settings("fsdp", FsdpSpec)
    fsdp.check_named()
    micro = fsdp.micro_batch_size
    minibatch = spec.task.batch_size // spec.grpo.minibatches
    if micro and minibatch % micro:
        raise ConfigError(
            f"engine.fsdp.micro_batch_size ({micro}) does not divide a minibatch of "
            f"{minibatch} samples (engine.task: prompts_per_rank x group_size, over "
            "engine.grpo.minibatches)"
        )


def probe(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The registry's probe (registry.py): transformers loads the model directory; under
    `[engine] batch_invariant`, device "auto" is not CUDA here ("cuda" itself is refused by
    spec.py's check)."""
    fsdp = spec.settings("fsdp", FsdpSpec)
    check_model_dir(fsdp.model_dir, cpu_only=spec.batch_invariant and fsdp.device == "auto")


def check_model_dir(model_dir: str, *, cpu_only: bool = False) -> None:
    """A `ConfigError` naming the path if transformers cannot load `model_dir` as a causal LM
    (`cpu_only`: naming engine.fsdp.device if "auto" is CUDA here)."""
    ask_child(
        "timeshare.engines.fsdp.check",
        msgspec.json.encode(ProbeRequest(model_dir, cpu_only)).decode(),
        f"engine.fsdp.model_dir {model_dir}",
        CHECK_TIMEOUT_S,
    )


def model_dir_problem(directory: Path) -> str:
    """What stops transformers loading `directory` as a causal LM ("": nothing)."""
    where = f"engine.fsdp.model_dir: {directory}"
    if not directory.is_dir():
        return f"{where} is not a directory"
    if not (directory / "config.json").is_file():
        return (
            f"{where} has no config.json (a transformers model directory holds config.json "
            "and *.safetensors)"
        )
    # Imported here, in the checking child only: the config is read without them.
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        return f"{where}/config.json: transformers cannot read it: {_first_line(exc)}"
    for name in getattr(config, "architectures", None) or []:
        if not hasattr(transformers, name):
            return f"{where}/config.json: transformers has no architecture {name!r}"
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # transformers' from_config is unannotated
    except (ValueError, KeyError) as exc:
        return f"{where}: not a causal LM transformers knows: {_first_line(exc)}"
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)  # the embedding's, loaded from there
    return weights_problem(directory, where, expected)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _verdict(request: ProbeRequest) -> dict[str, Any]:
    problem = ""
    if request.cpu_only:  # (imported in the checking child only: it imports torch)
        from timeshare.engines.invariance import auto_device_problem  # noqa: PLC0415

        problem = auto_device_problem("engine.fsdp.device")
    problem = problem or model_dir_problem(Path(request.model_dir))
    return {"ok": not problem, "error": problem}


def main() -> None:
    answer(_verdict(msgspec.json.decode(sys.argv[1], type=ProbeRequest)))


if __name__ == "__main__":
    main()
