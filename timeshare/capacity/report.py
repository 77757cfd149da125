"""A plan as the table `timeshare plan` prints, and as JSON (`--json`)."""

from __future__ import annotations

from timeshare.capacity import Plan
from timeshare.capacity.memory import GIB, PHASES

KIND_MARK = {"exact": "", "bound": "<=", "estimate": "~"}


def text(plan: Plan, name: str) -> str:
    model, sync = plan.model, plan.sync
    verdict = "feasible" if plan.feasible else f"NOT feasible ({len(plan.problems)} problems)"
    lines = [
        f"timeshare plan {name}: {verdict}",
        f"cluster   {plan.nodes} nodes x {plan.ranks_per_node} ranks = {plan.ranks} ranks; "
        f"{plan.device_bytes / GIB:g} GiB per rank's device; SYNC at {plan.sync_gbps:g} GB/s",
        f"model     {model.architecture}: {model.parameters / 1e9:.2f} B parameters "
        f"({model.active_parameters / 1e9:.2f} B active per token), {model.layers} layers",
        f"trainer   tensor parallel {plan.trainer.tensor_parallel}, parameters and gradients "
        f"1/{plan.trainer.parameter_shards} per rank, AdamW 1/{plan.trainer.optimizer_shards}",
        f"rollout   tensor parallel {plan.rollout.tensor_parallel}; KV cache "
        f"{plan.kv_tokens} tokens per rank, longest sequence {plan.longest_sequence}",
        "",
        _memory_table(plan),
        "",
        f"OFFLOAD moves {plan.moved['offload'] / GIB:.2f} GiB per rank to the host (gradients, "
        f"AdamW); after SYNC the parameters follow ({plan.moved['sync'] / GIB:.2f} GiB)",
        f"SYNC      {sync.bytes / GIB:.2f} GiB per rank: {sync.seconds:.2f} s at "
        f"{plan.sync_gbps:g} GB/s, within {sync.deadline_key} ({sync.deadline_s:g} s); "
        f"a bucket {sync.bucket_seconds:.3f} s of transfer.ack_timeout_s "
        f"({sync.ack_timeout_s:g} s)",
        "(exact: from sizes; <= an upper bound; ~ an estimate; see docs/planning.md)",
        *(f"note: {note}" for note in plan.notes),
        *(f"PROBLEM [{p.rule}] {p.key}: {p.message}" for p in plan.problems),
    ]
    return "\n".join(lines) + "\n"


def _memory_table(plan: Plan) -> str:
    width = max(len(p.name) for p in plan.parts) + 3
    header = f"{'GiB on each rank':<{width}}" + "".join(f"{p.upper():>9}" for p in PHASES)
    rows = [header]
    for part in plan.parts:
        cells = "".join(
            f"{_gib(part.bytes, KIND_MARK[part.kind]) if phase in part.phases else '-':>9}"
            for phase in PHASES
        )
        rows.append(f"{part.name:<{width}}{cells}")
    rows.append(f"{'total':<{width}}" + "".join(f"{_gib(plan.totals[p]):>9}" for p in PHASES))
    if plan.device_bytes > 0:
        rows.append(
            f"{'of the device':<{width}}"
            + "".join(f"{plan.totals[p] / plan.device_bytes:>9.0%}" for p in PHASES)
        )
    return "\n".join(rows)


def _gib(value: float, mark: str = "") -> str:
    return f"{mark}{value / GIB:.2f}"


def as_json(plan: Plan) -> dict[str, object]:
    return {
        "feasible": plan.feasible,
        "cluster": {
            "nodes": plan.nodes,
            "ranks_per_node": plan.ranks_per_node,
            "ranks": plan.ranks,
            "device_gib": plan.device_bytes / GIB,
            "sync_gbps": plan.sync_gbps,
        },
        "model": plan.model._asdict(),
        "trainer": plan.trainer._asdict(),
        "rollout": plan.rollout._asdict(),
        "device_gib": {
            "parts": [
                {
                    "name": p.name,
                    "gib": p.bytes / GIB,
                    "kind": p.kind,
                    "phases": [phase for phase in PHASES if phase in p.phases],
                }
                for p in plan.parts
            ],
            "totals": {phase: plan.totals[phase] / GIB for phase in PHASES},
        },
        "to_host_gib": {phase: moved / GIB for phase, moved in plan.moved.items()},
        "kv_cache_tokens": plan.kv_tokens,
        "longest_sequence": plan.longest_sequence,
        "sync": plan.sync._asdict(),
        "problems": [p._asdict() for p in plan.problems],
        "notes": plan.notes,
    }
