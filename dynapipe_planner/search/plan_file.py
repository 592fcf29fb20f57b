"""What a Galvatron-BMW search hands to a training job (seed `galvatron_bmw.txt` §VI: the
searched plan is what the runtime executes).

`plan_dict` / `write_plan` give the plan file: every layer's strategy, the pipeline
partition, micro-batch count, global batch and the predictions. `megatron_flags` turns a plan
that plain Megatron-LM can run into its exact flags (TP, PP, uneven first/last stage, recompute
method and count, micro and global batch, distributed optimizer for SDP) and says plainly what
it cannot express (layer-varying TP or data degree, strided TP, recomputation that is not a
per-stage prefix of equal length, middle stages of unequal size, encoder-decoder splits).
`runtime_flags` does the same for our own `pretrain_gpt.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..cost.table import split_layers
from ..megatron_model import model_flags
from ..model_spec import ModelSpec
from ..plan import atomic_write
from .optimizer import GiB, SearchResult

PLAN_VERSION = 1


@dataclass
class Flags:
    """Command-line flags for one trainer, or why the plan cannot be expressed there."""

    expressible: bool
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def command_line(self) -> str:
        return " ".join(self.flags)


def _uniform(result: SearchResult) -> list[str]:
    """Reasons the plan is not one (TP, data degree, paradigm) for every layer."""
    s0 = result.strategies[0]
    reasons = []
    if any(s.tp != s0.tp for s in result.strategies):
        reasons.append(f"TP varies over layers ({sorted({s.tp for s in result.strategies})})")
    if any(s.data_degree != s0.data_degree for s in result.strategies):
        reasons.append("the data-parallel degree varies over layers")
    if any((s.sdp > 1) != (s0.sdp > 1) for s in result.strategies):
        reasons.append("some layers shard their states (SDP) and others do not")
    if any(s.tp > 1 and s.stride("tp") != 1 for s in result.strategies):
        reasons.append("TP groups are strided (Megatron places TP ranks consecutively)")
    return reasons


def _recompute_layers(result: SearchResult) -> tuple[int | None, str]:
    """Megatron's block recompute count (same prefix of every stage; -1: every layer), or
    None and why there is none."""
    if all(s.ckpt for s in result.strategies):
        return -1, ""  # every layer: Megatron's uniform method, one layer per chunk
    counts = []
    for stage in result.stage_strategies():
        flags = [s.ckpt for s in stage]
        n = sum(flags)
        if flags[:n] != [True] * n:
            return None, "CKPT layers are not the first layers of their stage"
        counts.append(n)
    if len(set(counts)) > 1:
        return None, f"stages recompute different numbers of layers ({counts})"
    return counts[0], ""


def megatron_flags(result: SearchResult, model: ModelSpec) -> Flags:
    """Exact Megatron-LM flags for a plan uniform enough for Megatron to run."""
    notes = _uniform(result)
    if model.is_encoder_decoder:
        notes.append("encoder-decoder splits are not emitted (Megatron's T5 uses its own flags)")
    counts = result.partition
    if len(counts) > 2 and len(set(counts[1:-1])) > 1:
        notes.append(f"middle stages differ in size ({counts}); Megatron splits them evenly")
    recompute, why = _recompute_layers(result)
    if recompute is None:
        notes.append(why)
    if notes:
        return Flags(False, notes=notes)
    s0 = result.strategies[0]
    micro = result.microbatch_size // s0.data_degree
    flags = [
        f"--tensor-model-parallel-size {s0.tp}",
        f"--pipeline-model-parallel-size {result.pp}",
        f"--num-layers {model.num_layers}",
        f"--micro-batch-size {micro}",
        f"--global-batch-size {result.global_batch_size}",
    ]
    if len(set(counts)) > 1:
        flags += [
            f"--decoder-first-pipeline-num-layers {counts[0]}",
            f"--decoder-last-pipeline-num-layers {counts[-1]}",
        ]
    if recompute == -1:
        flags += ["--recompute-granularity full", "--recompute-method uniform"]
        flags += ["--recompute-num-layers 1"]
    elif recompute:
        flags += ["--recompute-granularity full", "--recompute-method block"]
        flags += [f"--recompute-num-layers {recompute}"]
    out = Flags(True, flags)
    if s0.sdp > 1:
        out.flags += [
            "--use-distributed-optimizer",
            "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy optim_grads_params",
        ]
        out.notes.append(
            "SDP is ZeRO-3: weights, gradients and optimizer states sharded over the data-"
            "parallel group (Megatron FSDP, optim_grads_params); --use-distributed-optimizer "
            "alone shards only optimizer states and needs more memory than predicted"
        )
    if recompute and recompute > 0:
        out.notes.append(f"the first {recompute} layers of every stage are recomputed")
    return out


def _flag_items(tokens: list[str]) -> list[str]:
    """Command-line tokens as this module lists flags: each flag with its value, if any."""
    items: list[str] = []
    for token in tokens:
        if token.startswith("--") or not items:
            items.append(token)
        else:
            items[-1] += f" {token}"
    return items


def runtime_flags(result: SearchResult, model: ModelSpec, seq_length: int) -> Flags:
    """Flags for our `pretrain_gpt.py` (even layer split, one recompute mode, no ZeRO-3)."""
    notes = _uniform(result)
    if model.is_encoder_decoder:
        notes.append("the runtime trains GPT models only")
    even = split_layers(sum(result.partition), result.pp)
    if result.partition != even:
        notes.append(f"the runtime splits layers {even}, the plan {result.partition}")
    ckpt = {s.ckpt for s in result.strategies}
    if len(ckpt) > 1:
        notes.append("the runtime recomputes all layers or none; the plan mixes them")
    if any(s.sdp > 1 for s in result.strategies):
        notes.append("the runtime has no ZeRO-3 parameter sharding (SDP)")
    if notes:
        return Flags(False, notes=notes)
    s0 = result.strategies[0]
    return Flags(
        True,
        [
            *_flag_items(model_flags(model)),
            f"--seq-length {seq_length}",
            f"--tensor-model-parallel-size {s0.tp}",
            f"--pipeline-model-parallel-size {result.pp}",
            f"--micro-batch-size {result.microbatch_size // s0.data_degree}",
            f"--global-batch-size {result.global_batch_size}",
            f"--dynapipe-recompute {'full' if s0.ckpt else 'none'}",
            f"--dynapipe-memory-limit {result.memory_budget_bytes / GiB:.2f}",
            "--batching padding",
        ],
    )


def plan_dict(result: SearchResult, model: ModelSpec, *, seq_length: int, **job) -> dict:
    """The plan file's JSON object; `job` adds free-form job facts (GPU, GPUs per node ...)."""
    layers, start = [], 0
    for stage, stage_strategies in enumerate(result.stage_strategies()):
        for offset, s in enumerate(stage_strategies):
            layers.append({"layer": start + offset, "stage": stage, **s.to_dict()})
        start += len(stage_strategies)
    megatron = megatron_flags(result, model)
    runtime = runtime_flags(result, model, seq_length)
    return {
        "version": PLAN_VERSION,
        "kind": "galvatron-bmw" if result.bi_objective else "galvatron-base",
        "model": model.to_dict(),
        "seq_length": seq_length,
        **job,
        "memory_budget_bytes": result.memory_budget_bytes,
        "pp": result.pp,
        "partition": list(result.partition),
        "global_batch_size": result.global_batch_size,
        "num_microbatches": result.num_microbatches,
        "microbatch_size": result.microbatch_size,
        "layers": layers,
        "predicted": {
            "throughput_samples_per_s": result.throughput,
            "iteration_time_s": result.iteration_time_s,
            "stage_memory_bytes": [float(x) for x in result.stage_memory_bytes],
            "stage_time_s": [float(x) for x in result.stage_time_s],
        },
        "megatron": {
            "expressible": megatron.expressible,
            "flags": megatron.flags,
            "notes": megatron.notes,
        },
        "runtime": {
            "expressible": runtime.expressible,
            "flags": runtime.flags,
            "notes": runtime.notes,
        },
        "search": {"evaluated": result.evaluated, "search_time_s": result.search_time_s},
    }


def write_plan(
    result: SearchResult, path: str | Path, model: ModelSpec, *, seq_length: int, **job
) -> dict:
    """Write the plan file atomically (a failed run leaves no half-written file)."""
    data = plan_dict(result, model, seq_length=seq_length, **job)
    atomic_write(Path(path), (json.dumps(data, indent=1) + "\n").encode())
    return data
