"""`[engine]`: which trainer and which rollout engine a job runs, and the settings they share.

    [engine]            trainer, rollout (kinds of registry.py), torch_threads
    [engine.task]       the task the rollout serves and its sampling (task.py runs it)
    [engine.grpo]       GRPO and AdamW, as every trainer computes them (grpo.py)
    [engine.<name>]     each registered engine's own settings, typed by its spec class

`EngineSpec` is built from the registry when this module is imported: one table per registered
engine, so that adding an engine adds its table without touching this module. Every registered
engine's spec module is imported here, never an engine itself: spec modules are torch-free
(tests/test_config.py checks that reading a config loads no torch, vLLM or transformers), and
one that fails to import fails every config load, whichever engines the job runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, TypeVar, cast

import msgspec

from timeshare.engines import registry
from timeshare.engines.footprint import HasRolloutFootprint, heads_problem
from timeshare.engines.model_config import SplitsRanks, TrainedModel, TrainsModel
from timeshare.engines.registry import Role
from timeshare.errors import ConfigError
from timeshare.task.aggregation import LossAggregation
from timeshare.task.files import (
    TOKENIZER_MODELS,
    TokenizerFacts,
    TokenizerSource,
    generation_eos,
    has_chat_template,
    has_tokenizer,
    stop_set,
    tokenizer_facts,
)
from timeshare.task.reward_function import RewardSpec
from timeshare.task.vocab import EOS, PROMPT_TOKENS, TOKENIZER_SIZE

if TYPE_CHECKING:
    from timeshare.engines.model_config import ModelConfig

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
S = TypeVar("S", bound=msgspec.Struct)


TaskKind = Literal["digits", "dataset"]
Overlong = Literal["error", "drop"]


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The task the rollout serves, and how it samples it: the built-in digit task (say the
    digit back, timeshare/task/digits.py), or the user's own (`kind = "dataset"`): prompts read
    from `train_files`, scored by the user's `[engine.task.reward]` (timeshare/task/).

    A prompt holds at most `max_prompt_tokens` (a longer row is an error listing the rows, or,
    `overlong = "drop"`, left out and counted), a completion at most `max_completion_tokens`:
    it ends earlier at a stop token (the stop set: the tokenizer's EOS, generation_config.json's
    EOS and `stop_token_ids`). The prompts are read through the tokenizer of `tokenizer` (a
    directory), else of the trained model's directory; a model given inline has the digit
    task's own. Simulated engines serve fixed requests instead and read none of it."""

    kind: TaskKind = "digits"
    seed: int = 0  # the prompts and the sampling seeds of every step follow from it
    prompts_per_rank: PositiveInt = 8
    group_size: Annotated[int, msgspec.Meta(ge=2)] = 8  # GRPO needs a group to compare within
    max_prompt_tokens: PositiveInt = 8
    max_completion_tokens: PositiveInt = 6
    stop_token_ids: tuple[Annotated[int, msgspec.Meta(ge=0)], ...] = ()  # beyond the EOS
    tokenizer: str = ""  # a directory of tokenizer files; "": the model directory's
    temperature: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    # kind = "dataset": .parquet, .jsonl or .json files, concatenated in order
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"  # each row's prompt: a string, or chat messages {role, content}
    # given to the reward as `label` ("": none); a dotted key reads into a column of dicts
    # ("reward_model.ground_truth": where verl's GSM8K files keep the answer)
    label_key: str = ""
    overlong: Overlong = "error"
    shuffle: bool = True  # each epoch a seeded permutation of the rows
    reward: RewardSpec | None = None
    # every `val_every` steps the validation prompts are generated and scored, never trained
    # on (0: never); greedy unless `val_temperature` > 0; `val_prompts` of them (0: all)
    val_every: Annotated[int, msgspec.Meta(ge=0)] = 0
    val_temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    val_prompts: Annotated[int, msgspec.Meta(ge=0)] = 0
    # renamed: refused by name (a completion now ends at EOS; max_completion_tokens bounds it)
    completion_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.completion_tokens is not None:
            raise ValueError(
                "engine.task.completion_tokens is now max_completion_tokens (a completion ends "
                "at its EOS, or there): rename the key"
            )
        if self.kind == "dataset":
            self._check_dataset()
            return
        for key in ("train_files", "val_files", "reward", "val_every"):
            if getattr(self, key):
                raise ValueError(f'engine.task.{key} is read only with kind = "dataset"')
        if self.max_prompt_tokens < PROMPT_TOKENS:
            raise ValueError(
                f"engine.task.max_prompt_tokens ({self.max_prompt_tokens}) is shorter than the "
                f"task's longest prompt ({PROMPT_TOKENS} tokens)"
            )

    def _check_dataset(self) -> None:
        if not self.train_files:
            raise ValueError('engine.task.train_files: kind = "dataset" needs a file of prompts')
        if self.reward is None:
            raise ValueError(
                'engine.task.reward: kind = "dataset" needs a reward function '
                '([engine.task.reward] path = "rewards.py", name = "compute_score")'
            )
        if self.val_every and not self.val_files:
            raise ValueError("engine.task.val_every needs engine.task.val_files")

    @property
    def batch_size(self) -> int:
        """Sequences a rank's rollout generates per step (and its trainer trains on)."""
        return self.prompts_per_rank * self.group_size

    @property
    def sequence_tokens(self) -> int:
        """Tokens of the longest sampled sequence: a prompt and its completion."""
        return self.max_prompt_tokens + self.max_completion_tokens

    def check_model(self, model: ModelConfig, where: str) -> None:
        """A `ConfigError` if the task cannot run on `model` (`where`: the key naming it); the
        tokenizer's checks are `check_tokenizer`'s."""
        if self.sequence_tokens > model.max_position_embeddings:
            raise ConfigError(
                f"{where}: max_position_embeddings ({model.max_position_embeddings}) is shorter "
                f"than engine.task.max_prompt_tokens ({self.max_prompt_tokens}) plus "
                f"engine.task.max_completion_tokens ({self.max_completion_tokens})"
            )


class GrpoSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """GRPO with AdamW, the same for every trainer (grpo.py)."""

    lr: Annotated[float, msgspec.Meta(gt=0.0)] = 3e-3
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    clip_ratio_low: Fraction = 0.2
    clip_ratio_high: Annotated[float, msgspec.Meta(ge=0.0)] = 0.28
    kl_coef: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0  # 0: no reference model kept
    minibatches: PositiveInt = 2
    # How a minibatch's per-token losses make its loss: the mean over its real tokens (verl's
    # default), or the mean over sequences of each one's token mean. Padding is in neither.
    loss_aggregation: LossAggregation = "token-mean"


class EngineChoice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every job's `[engine]` holds; `EngineSpec` adds one table per registered engine
    and narrows `trainer` and `rollout` to the registered kinds. The checks that read several
    keys at once are `check_engines`', run when a config is loaded."""

    trainer: str = "simulated"
    rollout: str = "simulated"
    # intra-op threads per worker process: a trainer and a rollout share each rank's cores, and
    # spinning OpenMP pools of several processes on few cores stall each other for a second
    torch_threads: PositiveInt = 1
    # Each sequence's numbers independent of its batch, in every engine of the job: the
    # rollout's logprobs are then the trainer's to the bit (invariance.py; registry.py says how
    # each engine does it, or that it cannot)
    batch_invariant: bool = False
    task: TaskSpec = TaskSpec()
    grpo: GrpoSpec = GrpoSpec()

    def section(self, name: str) -> msgspec.Struct:
        """`[engine.<name>]`: the settings of a registered engine."""
        value = getattr(self, name)
        assert isinstance(value, msgspec.Struct)
        return value

    def settings(self, name: str, kind: type[S]) -> S:
        """`[engine.<name>]` as the engine's own spec class (what its builder reads)."""
        value = self.section(name)
        if not isinstance(value, kind):
            raise TypeError(f"engine.{name} is a {type(value).__name__}, not a {kind.__name__}")
        return value

    @property
    def names(self) -> tuple[str, str]:
        """(trainer, rollout), for logs and status."""
        return self.trainer, self.rollout

    def trained_model(self) -> TrainedModel | None:
        """The model the trainer trains (None: a simulated one), for a rollout engine that
        builds its own copy of it: no rollout needs to know which trainer it serves."""
        settings = self.section(self.trainer)
        return settings.trained_model() if isinstance(settings, TrainsModel) else None

    def tokenizer_source(self) -> TokenizerSource | None:
        """Where the job's tokenizer is (None: a simulated trainer, no model): `[engine.task]
        tokenizer`, else the trained model's directory, else (a model given inline) the digit
        task's own. Its stop set takes the EOS of the model directory's generation config."""
        trained = self.trained_model()
        if trained is None:
            return None
        if self.task.tokenizer:
            where = f"engine.task.tokenizer {self.task.tokenizer}"
            return TokenizerSource(self.task.tokenizer, where, trained.home)
        if trained.home:
            return TokenizerSource(trained.home, trained.where, trained.home)
        return TokenizerSource("", f"{trained.where} (the digit task's tokenizer)")

    def served_model(self) -> TrainedModel:
        """The trained model, for a rollout engine that serves a copy of it."""
        trained = self.trained_model()
        if trained is None:
            raise ConfigError(
                f"engine.rollout = {self.rollout!r} serves the trainer's model, but "
                f"engine.trainer = {self.trainer!r} trains none"
            )
        return trained

    def rollout_workers(self) -> int:
        """How many processes of the rollout engine load each weight version (its
        tensor-parallel size): the trainer's weight channel sends every bucket to each."""
        settings = self.section(self.rollout)
        if isinstance(settings, HasRolloutFootprint):
            return settings.rollout_footprint(1).tensor_parallel
        return 1

    def roles(self) -> dict[str, frozenset[Role]]:
        """Each engine the job runs, with the roles it takes (torch_ref may take both)."""
        roles: dict[str, set[Role]] = {self.trainer: {"trainer"}}
        roles.setdefault(self.rollout, set()).add("rollout")
        return {name: frozenset(taken) for name, taken in roles.items()}


Sources = Callable[[str], str]  # where a key's value came from ("file job.toml", "default")


def check_engines(
    spec: EngineChoice,
    source_of: Sources = lambda key: "default",
    *,
    ranks: int | None = None,
    ranks_per_node: int | None = None,
    probe: bool = True,
) -> None:
    """What the job's engines must accept, before any worker starts, quickest first: the
    choice itself, the trainer's split of the job's `ranks` (when given), each engine's own
    check, the task against the model, the job's tokenizer (its JSON files: check_tokenizer),
    and last each engine's probe (what needs its library, in a child process, or the model's
    files), the trainer's first: its library names a directory it cannot read more precisely
    than a rollout would. `source_of` names where a key's value came from, for the error.
    `probe=False` leaves the tokenizer and the probes out (`timeshare plan`: a model's
    config.json alone, no tokenizer, no weights, no engine library asked)."""
    check_choice(spec, source_of)
    trainer = spec.section(spec.trainer)
    if ranks is not None and isinstance(trainer, SplitsRanks):
        trainer.check_ranks(ranks)
    if ranks_per_node is not None:
        check_rollout_group(spec, source_of, ranks_per_node)
    if spec.batch_invariant:
        check_batch_invariant(spec, source_of)
    for name, roles in spec.roles().items():
        if check := registry.ENGINES[name].check:
            registry.load_function(check)(spec, roles)
    trained = spec.trained_model()
    if trained is not None:
        spec.task.check_model(trained.config, trained.where)
        check_rollout_holds_a_sequence(spec, trained.config, source_of, kv_cache=probe)
        if probe:  # (the tokenizer's files: `timeshare plan` reads a config.json alone)
            check_tokenizer(spec, trained, source_of)
    for name, roles in spec.roles().items():
        if probe and (probed := registry.ENGINES[name].probe):
            registry.load_function(probed)(spec, roles)


def check_rollout_holds_a_sequence(
    spec: EngineChoice, model: ModelConfig, source_of: Sources, *, kv_cache: bool = True
) -> None:
    """The rollout engine holds the longest sequence the task makes (max_prompt_tokens +
    max_completion_tokens): within its longest sequence (vLLM's max_model_len, SGLang's
    context_length, torch_ref's kv_cache_len) and, with `kv_cache`, its KV cache, where that is
    given in tokens, or in bytes and the weights' dtype says how many bytes a token takes. (A
    run would otherwise fail at its first ROLLOUT, or, where an engine cuts prompts, train on
    less.) `timeshare plan` leaves the KV cache to its own rule, which sizes it on the device."""
    settings = spec.section(spec.rollout)
    if not isinstance(settings, HasRolloutFootprint):
        return
    footprint = settings.rollout_footprint(spec.task.batch_size)
    task = spec.task
    wanted = (
        f"engine.task.max_prompt_tokens ({task.max_prompt_tokens}) plus "
        f"engine.task.max_completion_tokens ({task.max_completion_tokens})"
    )
    longest, key = footprint.longest_sequence, footprint.longest_key
    if longest and key and task.sequence_tokens > longest:
        raise ConfigError(f"{key} ({longest}, from {source_of(key)}) is shorter than {wanted}")
    if not kv_cache:
        return
    tokens = footprint.kv_cache_tokens
    if tokens is None and footprint.kv_cache_bytes is not None and footprint.weight_bytes:
        per_token = (
            (2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim)
            * footprint.weight_bytes
            // footprint.tensor_parallel
        )
        tokens = int(footprint.kv_cache_bytes // max(per_token, 1))
    if tokens is not None and task.sequence_tokens > tokens:
        kv = footprint.kv_key
        raise ConfigError(
            f"{kv} (from {source_of(kv)}): the KV cache holds {tokens} tokens, fewer than {wanted}"
        )


def check_tokenizer(spec: EngineChoice, trained: TrainedModel, source_of: Sources) -> None:
    """The job's tokenizer, read from its JSON files (transformers reads it in the rollout
    worker): there is one, with a chat template (the task's prompts are chats), no larger than
    the model's vocabulary, and a stop set within it."""
    source = spec.tokenizer_source()
    assert source is not None, "a trained model has a tokenizer source"
    where = source.where
    if spec.task.tokenizer:
        key = "engine.task.tokenizer"
        where = f"{key} ({spec.task.tokenizer}, from {source_of(key)})"
    vocab = trained.config.vocab_size
    if source.is_digit_task:
        facts = TokenizerFacts(size=TOKENIZER_SIZE, eos=(EOS,))
    else:
        directory = Path(source.directory)
        if not directory.is_dir():
            raise ConfigError(f"{where}: not a directory")
        if not has_tokenizer(directory):
            if spec.task.tokenizer:
                raise ConfigError(f"{where} holds no tokenizer ({', '.join(TOKENIZER_MODELS)})")
            raise ConfigError(
                f"{where} holds no tokenizer ({', '.join(TOKENIZER_MODELS)}): set "
                "engine.task.tokenizer to a directory holding one (`timeshare model init` "
                "writes the digit task's)"
            )
        # (a dataset's string prompts need none: `timeshare task check` renders every row)
        if spec.task.kind == "digits" and not has_chat_template(directory):
            raise ConfigError(
                f"{where}: the tokenizer has no chat template (the task's prompts are chats)"
            )
        facts = tokenizer_facts(directory)
    if facts.size is not None and facts.size > vocab:
        raise ConfigError(
            f"{trained.where}: vocab_size ({vocab}) is smaller than the tokenizer's "
            f"{facts.size} tokens ({where})"
        )
    key = "engine.task.stop_token_ids"
    beyond = [t for t in spec.task.stop_token_ids if t >= vocab]
    if beyond:
        raise ConfigError(
            f"{key} {beyond} (from {source_of(key)}): beyond the model's vocabulary "
            f"({vocab}, {trained.where})"
        )
    model_dir = Path(source.model_dir) if source.model_dir else None
    eos = stop_set(facts.eos, generation_eos(model_dir))
    if not eos and facts.size is not None:  # (the JSON holds the whole vocabulary)
        raise ConfigError(
            f"{where}: neither the tokenizer nor generation_config.json names an EOS token: "
            "a right completion ends with one"
        )
    beyond = [t for t in eos if t >= vocab]
    if beyond:
        raise ConfigError(
            f"{where}: EOS {beyond} (the tokenizer's and generation_config.json's) beyond the "
            f"model's vocabulary ({vocab}, {trained.where})"
        )


# The project's own mode is row-invariant with one intra-op thread: with two, a trainer's and a
# rollout's logprobs of the tiny demo model still differed by 6e-7 (which op rounds by thread
# count is not established).
INVARIANT_THREADS = 1


def check_batch_invariant(spec: EngineChoice, source_of: Sources) -> None:
    """Every engine of the job has a batch-invariant mode, and what it needs is set. The
    project's own mode is a CPU mode: an engine that runs it on a device it names "cuda" is
    refused here; "auto" is resolved by the engine's probe, which asks torch in a child process
    as the worker would (fsdp/check.py, megatron/check.py), and by the worker itself."""
    for name in spec.roles():
        way = registry.ENGINES[name].batch_invariant
        if not way:
            raise ConfigError(
                f"engine.batch_invariant (from {source_of('engine.batch_invariant')}): the "
                f"{name} engine has no batch-invariant mode"
            )
        if way != "own":
            continue
        if spec.torch_threads > INVARIANT_THREADS:
            raise ConfigError(
                f"engine.torch_threads ({spec.torch_threads}, from "
                f"{source_of('engine.torch_threads')}): engine.batch_invariant runs "
                f"{name} with {INVARIANT_THREADS} intra-op thread"
            )
        # (an engine's table names its device `device`: fsdp's, megatron's; torch_ref has none)
        device = getattr(spec.section(name), "device", "cpu")
        if device not in ("cpu", "auto"):
            key = f"engine.{name}.device"
            raise ConfigError(off_cpu_refusal(key, f'{key} = "{device}" (from {source_of(key)})'))


def off_cpu_refusal(key: str, stated: str) -> str:
    """Why the project's own mode is refused for an engine whose device `key` is not the CPU
    (`stated`: its value, and where it came from or what it means here)."""
    return (
        f"{stated}: engine.batch_invariant runs this engine in the project's own mode, a CPU "
        "mode (strict MKL, padded linears, row-local attention); on CUDA its GEMMs are "
        "cuBLAS's, which no rollout's kernels match to the bit. Set "
        f'{key} = "cpu", or engine.batch_invariant = false'
    )


def check_rollout_group(spec: EngineChoice, source_of: Sources, ranks_per_node: int) -> None:
    """A rollout engine with tensor parallelism N runs on the devices of N consecutive ranks
    of one node (the first of them hosts it: cluster.group_leader), so N divides a node's
    ranks, and N splits the served model's attention."""
    settings = spec.section(spec.rollout)
    if not isinstance(settings, HasRolloutFootprint):
        return
    footprint = settings.rollout_footprint(1)
    size, key = footprint.tensor_parallel, footprint.tp_key
    if size == 1:
        return
    if ranks_per_node % size:
        raise ConfigError(
            f"{key} ({size}, from {source_of(key)}) must divide the ranks of a node "
            f"({ranks_per_node}): the engine's tensor-parallel workers use the devices of "
            f"{size} consecutive ranks of one node"
        )
    trained = spec.trained_model()
    if trained is not None:
        model = trained.config
        problem = heads_problem(size, model.num_attention_heads, model.num_key_value_heads, key)
        if problem is not None:
            raise ConfigError(f"{problem} (from {source_of(key)}; the model: {trained.where})")


def check_choice(spec: EngineChoice, source_of: Sources) -> None:
    """A trainer and a rollout engine that pair, minibatches that divide a batch, and no
    table set for an engine the job does not run."""
    trainer = registry.find(spec.trainer, "trainer")
    rollout = registry.find(spec.rollout, "rollout")
    if trainer.family != rollout.family:
        raise ConfigError(
            f"engine.trainer = {spec.trainer!r} (from {source_of('engine.trainer')}) and "
            f"engine.rollout = {spec.rollout!r} (from {source_of('engine.rollout')}) do not "
            f"pair: the trainer's weights are {trainer.family}, the rollout serves "
            f"{rollout.family}"
        )
    if spec.task.batch_size % spec.grpo.minibatches:
        raise ConfigError(
            f"engine.grpo.minibatches ({spec.grpo.minibatches}, from "
            f"{source_of('engine.grpo.minibatches')}) does not divide a rank's batch of "
            f"{spec.task.batch_size} samples (engine.task: prompts_per_rank x group_size)"
        )
    for name in [n for n in registry.ENGINES if n not in (spec.trainer, spec.rollout)]:
        default = _default(name)
        if spec.section(name) == default:
            continue
        key = _first_set(spec.section(name), default, f"engine.{name}")
        raise ConfigError(
            f"{key} is set (from {source_of(key)}), but this job runs no {name} engine "
            f"(engine.trainer = {spec.trainer!r}, engine.rollout = {spec.rollout!r})"
        )


def _default(name: str) -> msgspec.Struct:
    default: msgspec.Struct = registry.ENGINES[name].spec_type()()
    return default


def _first_set(table: msgspec.Struct, default: msgspec.Struct, prefix: str) -> str:
    """The first key of `table` (nested keys joined by dots) that differs from `default`."""
    for name in table.__struct_fields__:
        value, unset = getattr(table, name), getattr(default, name)
        if value != unset:
            if isinstance(value, msgspec.Struct) and isinstance(unset, msgspec.Struct):
                return _first_set(value, unset, f"{prefix}.{name}")
            return f"{prefix}.{name}"
    return prefix


def engine_spec_type() -> type[EngineChoice]:
    """`[engine]` as the registry types it now: `trainer` and `rollout` one of the registered
    kinds (a `Literal` of them), and one table per registered engine, typed by its spec."""
    shared = set(EngineChoice.__struct_fields__) | {"section", "settings", "names", "roles"}
    clashing = sorted(shared & set(registry.ENGINES))
    if clashing:
        raise TypeError(f"engines named {clashing} would hide [engine]'s own keys: rename them")
    fields: list[tuple[str, object, object]] = [
        ("trainer", Literal[tuple(registry.kinds("trainer"))], "simulated"),
        ("rollout", Literal[tuple(registry.kinds("rollout"))], "simulated"),
        *(
            (name, entry.spec_type(), msgspec.field(default_factory=entry.spec_type()))
            for name, entry in registry.ENGINES.items()
        ),
    ]
    spec = msgspec.defstruct(
        "EngineSpec",
        fields,
        bases=(EngineChoice,),
        module=__name__,
        frozen=True,
        kw_only=True,
        forbid_unknown_fields=True,
    )
    return cast(type[EngineChoice], spec)


if TYPE_CHECKING:
    EngineSpec = EngineChoice
else:
    # The typed config of every registered engine: [engine.vllm] is a VllmSpec, and so on.
    EngineSpec = engine_spec_type()


def engine_spec(**values: object) -> EngineChoice:
    """An `EngineSpec` from keyword values (tables as spec structs or plain dicts), validated
    as the config file's `[engine]` is."""
    return msgspec.convert(msgspec.to_builtins(values), EngineSpec)
