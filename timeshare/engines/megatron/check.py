"""Is `[engine.megatron]` a job megatron-core can train? Asked before any worker starts.

`check` (quick, no torch): a model directory named, micro-batches that divide a tensor-parallel
group's minibatch. `probe` runs this module in a child process (child_check.py says why):

    python -m timeshare.engines.megatron.check '{"model_dir": ..., "tp": ..., "cpu_only": ...}'

The child imports megatron-core (is the extra installed?), reads config.json (an architecture
names.py maps, no rope scaling, silu), checks that heads, KV heads, the MLP and the vocabulary
split over the tensor-parallel ranks, and compares the safetensors headers with the HF names and
shapes the mapping will read. The first problem found is the answer, naming the key or path.
With `cpu_only` (`[engine] batch_invariant`, device "auto") it first asks torch whether "auto"
is CUDA here: the project's batch-invariant mode is a CPU mode (engines/invariance.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from timeshare.engines.child_check import answer, ask_child
from timeshare.engines.megatron.spec import MegatronSpec
from timeshare.engines.model_dir import weights_problem
from timeshare.errors import ConfigError

if TYPE_CHECKING:
    from timeshare.engines.registry import Role
    from timeshare.engines.spec import EngineChoice

CHECK_TIMEOUT_S = 120.0  # importing torch and megatron-core on a loaded machine


class ProbeRequest(msgspec.Struct, frozen=True):
    model_dir: str
    tp: int
    cpu_only: bool = False  # the switch on, device "auto": refused where that is CUDA


def check(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The registry's check: a model directory named, micro-batches that divide a minibatch.

    A tensor-parallel group trains on the batches of all its ranks at once (each rank's
    rollout samples its own prompts), so a minibatch is tp x a rank's batch / minibatches."""
    megatron = spec.settings("megatron", MegatronSpec)
    megatron.check_named()
    if spec.batch_invariant and megatron.tensor_parallel_size > 1:
        raise ConfigError(
            f"engine.batch_invariant: megatron has no batch-invariant mode with "
            f"engine.megatron.tensor_parallel_size {megatron.tensor_parallel_size} (each "
            "row-parallel layer all-reduces partial sums, in another order than one GEMM)"
        )
    micro = megatron.micro_batch_size
    minibatch = megatron.tensor_parallel_size * spec.task.batch_size // spec.grpo.minibatches
    if micro and minibatch % micro:
        raise ConfigError(
            f"engine.megatron.micro_batch_size ({micro}) does not divide a minibatch of "
            f"{minibatch} samples (tensor_parallel_size x engine.task's prompts_per_rank x "
            "group_size, over engine.grpo.minibatches)"
        )


def probe(spec: EngineChoice, roles: frozenset[Role]) -> None:
    """The registry's probe: megatron-core imports, and the model directory maps and splits;
    under `[engine] batch_invariant`, device "auto" is not CUDA here (the project's mode is a
    CPU mode; "cuda" itself is refused by spec.py's check)."""
    megatron = spec.settings("megatron", MegatronSpec)
    cpu_only = spec.batch_invariant and megatron.device == "auto"
    request = ProbeRequest(megatron.model_dir, megatron.tensor_parallel_size, cpu_only)
    ask_child(
        "timeshare.engines.megatron.check",
        msgspec.json.encode(request).decode(),
        f"engine.megatron.model_dir {megatron.model_dir}",
        CHECK_TIMEOUT_S,
    )


def model_dir_problem(directory: Path, tp: int) -> str:
    """What stops the Megatron trainer from training `directory` over `tp` ranks ("": none)."""
    where = f"engine.megatron.model_dir: {directory}"
    if not (directory / "config.json").is_file():
        return f"{where} has no config.json (a transformers model directory)"
    # Imported here, in the checking child only.
    try:
        import megatron.core  # noqa: F401, PLC0415
    except ImportError as exc:
        return f'trainer = "megatron" needs megatron-core (pip install timeshare[megatron]): {exc}'
    from timeshare.engines.megatron.hf_config import HfShape  # noqa: PLC0415

    try:
        shape = HfShape.read(directory)
    except ConfigError as exc:
        return str(exc)
    split = shape.split_problem(tp)
    if split:
        return split
    return weights_problem(directory, where, shape.hf_shapes())


def _verdict(request: ProbeRequest) -> dict[str, Any]:
    problem = ""
    if request.cpu_only:  # (imported in the checking child only: it imports torch)
        from timeshare.engines.invariance import auto_device_problem  # noqa: PLC0415

        problem = auto_device_problem("engine.megatron.device")
    problem = problem or model_dir_problem(Path(request.model_dir), request.tp)
    return {"ok": not problem, "error": problem}


def main() -> None:
    answer(_verdict(msgspec.json.decode(sys.argv[1], type=ProbeRequest)))


if __name__ == "__main__":
    main()
