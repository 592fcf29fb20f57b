"""What a Galvatron-BMW search hands to a training job (seed `galvatron_bmw.txt` §VI: the
searched plan is what the runtime executes).

`plan_dict` / `write_plan` give the plan file: every layer's strategy, the pipeline
partition, micro-batch count, global batch and the predictions. `megatron_flags` turns a plan
that plain Megatron-LM can run into its exact flags (TP, PP, uneven first/last stage, recompute
method and count, micro and global batch, distributed optimizer for SDP) and says plainly what
it cannot express (layer-varying TP or data degree, strided TP, recomputation that is not a
per-stage prefix of equal length, middle stages of unequal size, encoder-decoder splits).
`runtime_flags` does the same for our own `pretrain_gpt.py`'s flags.

`load_plan` reads the file back for `pretrain_gpt.py --parallel-plan` (a `SearchedPlan`),
`check_job` holds it against the job it is given to (GPU count, model, sequence length), and
`parallel_plan_refusal` says which layer the runtime cannot run yet and why: the runtime builds
the plan's pipeline partition (§IV-B: any layer counts per stage), its micro-batch count and
global batch, the DP, SDP (ZeRO-3 over the whole data-parallel group) and TP layers of the
decision trees (§III-B) and CKPT of exactly the layers the plan names; hybrid DP x SDP layers,
TP changing between layers or stages, and strided TP groups come later. `parallel_plan_flags`
gives the `pretrain_gpt.py` command for such a plan.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..cost.table import split_layers
from ..errors import PlanningError
from ..input_files import load_json_file
from ..megatron_model import model_flags
from ..model_spec import ModelSpec
from ..plan import atomic_write
from .optimizer import GiB, SearchResult
from .space import PARADIGMS, LayerStrategy

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
    """Flags for our `pretrain_gpt.py` (even layer split, one recompute mode; SDP needs the
    plan file, `parallel_plan_flags`)."""
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
        notes.append("the runtime shards SDP layers (ZeRO-3) under --parallel-plan only")
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
            f"--dynapipe-memory-limit-gib {result.memory_budget_bytes / GiB:.2f}",
            "--batching padding",
        ],
    )


def runtime_command(
    result: SearchResult, model: ModelSpec, seq_length: int, path: str | None
) -> Flags:
    """How `pretrain_gpt.py` runs the plan: its flags where they say it
    (`runtime_flags`), else the plan file at `path` (`parallel_plan_flags`), else why not."""
    flags = runtime_flags(result, model, seq_length)
    return flags if flags.expressible else parallel_plan_flags(result, model, seq_length, path)


def plan_dict(
    result: SearchResult, model: ModelSpec, *, seq_length: int, path: str | None = None, **job
) -> dict:
    """The plan file's JSON object (to be written at `path`); `job` adds free-form job facts
    (GPU, GPUs per node ...)."""
    layers, start = [], 0
    for stage, stage_strategies in enumerate(result.stage_strategies()):
        for offset, s in enumerate(stage_strategies):
            layers.append({"layer": start + offset, "stage": stage, **s.to_dict()})
        start += len(stage_strategies)
    megatron = megatron_flags(result, model)
    runtime = runtime_command(result, model, seq_length, path)
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
    data = plan_dict(result, model, seq_length=seq_length, path=str(path), **job)
    atomic_write(Path(path), (json.dumps(data, indent=1) + "\n").encode())
    return data


class PlanFileError(PlanningError):
    """A plan file that is malformed, or that does not fit the job it is given to."""


@dataclass(frozen=True)
class SearchedPlan:
    """A plan file as a training job reads it: the model it was searched for, the pipeline
    partition, every layer's strategy, and the batch (`microbatch_size` samples per
    micro-batch over all data-parallel ranks together, as the search counts them); the
    search's predicted iteration time and the devices it priced (None where not recorded)."""

    path: str
    model: ModelSpec
    seq_length: int
    num_gpus: int
    partition: tuple[int, ...]
    strategies: tuple[LayerStrategy, ...]
    global_batch_size: int
    num_microbatches: int
    microbatch_size: int
    predicted_iteration_s: float | None = None
    priced_on: str | None = None

    @property
    def pp(self) -> int:
        return len(self.partition)

    @property
    def tp(self) -> int:
        return self.strategies[0].tp

    @property
    def data_degree(self) -> int:
        """Data-parallel replicas of the job (every layer's, once `parallel_plan_refusal` is
        None)."""
        return self.strategies[0].data_degree

    @property
    def checkpointed_layers(self) -> tuple[int, ...]:
        """The layers (0-based, over the whole model) whose activations are recomputed."""
        return tuple(i for i, s in enumerate(self.strategies) if s.ckpt)

    @property
    def sharded_layers(self) -> tuple[int, ...]:
        """The SDP layers (0-based, over the whole model): parameters, gradients and optimiser
        states sharded over the data-parallel group (ZeRO-3)."""
        return tuple(i for i, s in enumerate(self.strategies) if s.sdp > 1)


def _field(data: dict, key: str, kind: type, where: str) -> object:
    value = data.get(key)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise PlanFileError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    if not isinstance(value, kind):
        raise PlanFileError(f"{where}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _prediction(data: dict, where: str) -> tuple[float | None, str | None]:
    """The file's predicted iteration time (s) and the devices it was priced for."""
    predicted = data.get("predicted")
    seconds = predicted.get("iteration_time_s") if isinstance(predicted, dict) else None
    if seconds is not None and (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise PlanFileError(
            f"{where}: predicted iteration_time_s must be a positive number, got {seconds!r}"
        )
    device = data.get("gpu")
    return (
        None if seconds is None else float(seconds),
        device if isinstance(device, str) else None,
    )


def _layer_strategy(entry: object, pp: int, where: str) -> LayerStrategy:
    """One entry of the file's "layers" list (`LayerStrategy.to_dict` plus its place)."""
    if not isinstance(entry, dict):
        raise PlanFileError(f"{where} must be an object, got {entry!r}")
    order = _field(entry, "order", list, where)
    if len(set(order)) != len(order) or not set(order) <= set(PARADIGMS):
        raise PlanFileError(f"{where}: order must name distinct paradigms of {PARADIGMS}")
    degrees = tuple(_field(entry, p, int, where) for p in order)
    if not isinstance(entry.get("ckpt"), bool):
        raise PlanFileError(f"{where}: 'ckpt' must be true or false, got {entry.get('ckpt')!r}")
    strategy = LayerStrategy(pp, tuple(order), degrees, entry["ckpt"])
    for p in PARADIGMS:
        if entry.get(p, 1) != strategy.degree(p):
            raise PlanFileError(f"{where}: {p} {entry.get(p)!r} disagrees with its order {order}")
    return strategy


def load_plan(path: str | Path) -> SearchedPlan:
    """Read a plan file `write_plan` wrote; `PlanFileError` names what is wrong with it."""
    where = f"plan {path}"
    data = load_json_file(path, "plan", PlanFileError)
    if data.get("version") != PLAN_VERSION:
        raise PlanFileError(f"{where}: not a dynapipe-search plan of version {PLAN_VERSION}")
    model = ModelSpec.from_dict(_field(data, "model", dict, where))
    partition = tuple(_field(data, "partition", list, where))
    if not partition or not all(isinstance(n, int) and n >= 1 for n in partition):
        raise PlanFileError(f"{where}: partition must list positive layer counts: {partition}")
    if _field(data, "pp", int, where) != len(partition):
        raise PlanFileError(f"{where}: pp {data['pp']} but {len(partition)} stages {partition}")
    layers = _field(data, "layers", list, where)
    if len(layers) != model.num_layers or sum(partition) != model.num_layers:
        raise PlanFileError(
            f"{where}: {len(layers)} layer strategies and partition {list(partition)} for a "
            f"model of {model.num_layers} layers"
        )
    stages = [j for j, n in enumerate(partition) for _ in range(n)]
    strategies = []
    for i, entry in enumerate(layers):
        at = f"{where}: layers[{i}]"
        strategies.append(_layer_strategy(entry, len(partition), at))
        if entry.get("layer") != i or entry.get("stage") != stages[i]:
            raise PlanFileError(f"{at} must be layer {i} of stage {stages[i]} (the partition)")
    plan = SearchedPlan(
        str(path),
        model,
        _field(data, "seq_length", int, where),
        _field(data, "num_gpus", int, where),
        partition,
        tuple(strategies),
        _field(data, "global_batch_size", int, where),
        _field(data, "num_microbatches", int, where),
        _field(data, "microbatch_size", int, where),
        *_prediction(data, where),
    )
    for i, s in enumerate(plan.strategies):
        if s.group_size * plan.pp != plan.num_gpus:
            raise PlanFileError(
                f"{where}: layer {i} ({s}) uses {s.group_size} GPU(s) per stage, but "
                f"{plan.num_gpus} GPUs in {plan.pp} stage(s) give {plan.num_gpus / plan.pp:g}"
            )
    if plan.global_batch_size != plan.num_microbatches * plan.microbatch_size:
        raise PlanFileError(
            f"{where}: global batch {plan.global_batch_size} is not {plan.num_microbatches} "
            f"micro-batches of {plan.microbatch_size}"
        )
    return plan


# ModelSpec fields a layer's shape depends on, with the flag that sets each. The vocabulary is
# left out: the runtime's comes from its tokenizer (padded), a search preset's from the paper.
MODEL_SHAPE_FLAGS = {
    "arch": "the architecture",
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size",
    "kv_channels": "--kv-channels",
    "num_query_groups": "--num-query-groups",
    "gated_linear_unit": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "normalization": "--normalization",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "position_embedding_type": "--position-embedding-type",
}


def check_job(plan: SearchedPlan, model: ModelSpec, world_size: int, seq_length: int) -> None:
    """`PlanFileError` unless `plan` was searched for this job (`world_size` GPUs, `model`'s
    layers, sequences of `seq_length`) and the runtime can run it (`parallel_plan_refusal`)."""
    where = f"plan {plan.path}"
    if plan.num_gpus != world_size:
        raise PlanFileError(f"{where} is for {plan.num_gpus} GPUs; this job has {world_size}")
    for name, flag in MODEL_SHAPE_FLAGS.items():
        planned, given = getattr(plan.model, name), getattr(model, name)
        if planned != given:
            raise PlanFileError(
                f"{where} was searched for a model with {name} {planned}; the flags ({flag}) "
                f"give {given}"
            )
    if plan.seq_length != seq_length:
        raise PlanFileError(
            f"{where} was searched for sequences of {plan.seq_length} tokens; --seq-length "
            f"is {seq_length}"
        )
    refusal = parallel_plan_refusal(plan.strategies, plan.partition)
    if refusal is not None:
        raise PlanFileError(f"{where}: {refusal}")
    if model.num_heads % plan.tp:
        raise PlanFileError(f"{where}: TP {plan.tp} does not divide {model.num_heads} heads")
    if plan.microbatch_size % plan.data_degree:
        raise PlanFileError(
            f"{where}: micro-batches of {plan.microbatch_size} samples do not split over "
            f"{plan.data_degree} data-parallel ranks"
        )


def parallel_plan_refusal(
    strategies: Sequence[LayerStrategy], partition: Sequence[int]
) -> str | None:
    """Why `pretrain_gpt.py --parallel-plan` cannot run these per-layer strategies yet, naming
    the first layer it cannot run; None when it can."""
    start = 0
    for stage, count in enumerate(partition):
        for layer in range(start, start + count):
            s = strategies[layer]
            if s.sdp > 1 and s.dp > 1:
                return (
                    f"layer {layer} ({s}): SDP over {s.sdp} of its {s.data_degree} data-"
                    "parallel ranks (hybrid DP x SDP) does not run yet; the runtime shards a "
                    "layer over its whole data-parallel group"
                )
            if s.tp != strategies[start].tp:
                return (
                    f"layer {layer} ({s}): TP {s.tp} in stage {stage}, whose layer {start} runs "
                    f"TP {strategies[start].tp}; TP changing inside a stage does not run yet"
                )
            if s.tp != strategies[0].tp:
                return (
                    f"layer {layer} ({s}): TP {s.tp} in stage {stage}, TP {strategies[0].tp} in "
                    "stage 0; the runtime runs one TP degree per job"
                )
            if s.tp > 1 and s.stride("tp") != 1:
                return (
                    f"layer {layer} ({s}): TP groups strided by {s.stride('tp')} GPUs; the "
                    "runtime places TP ranks consecutively"
                )
        start += count
    return None


def parallel_plan_flags(
    result: SearchResult, model: ModelSpec, seq_length: int, path: str | None
) -> Flags:
    """`pretrain_gpt.py`'s flags that run the plan file at `path` (`--parallel-plan`; FILE
    when the search writes none), or why the runtime cannot run this plan yet."""
    notes = ["the runtime trains GPT models only"] if model.is_encoder_decoder else []
    refusal = parallel_plan_refusal(result.strategies, result.partition)
    if refusal is not None:
        notes.append(refusal)
    if notes:
        return Flags(False, notes=notes)
    flags = [*_flag_items(model_flags(model)), f"--seq-length {seq_length}"]
    flags.append(f"--parallel-plan {path or 'FILE'}")
    return Flags(True, flags, notes=[] if path else ["write FILE with --output FILE"])
