"""The Galvatron-BMW search's inputs from profiled cost tables: the search run for the machine
at hand (seed `galvatron_bmw.txt` §V: "the per-sample computation time ... could be measured by
profiling the real layer execution time on a single device"; communication time is "the size
of tensor to be transferred divided by the inter-device connection's bandwidth").

`tools/profile_costs.py` writes one table per TP degree (a TP-t table comes from t ranks under
torchrun), in the format of docs/architecture.md "Cost tables". `profiled_cost_inputs` reads the
tables' `recompute: "none"` entries at the job's sequence length, which must be one of the profiled
ones, and scales them to the §V per-sample model as follows (b_ref: the largest profiled micro-batch
size whose point was measured, per component and TP degree):

* decoder layer, per TP degree t: forward and backward times are the least-squares line
  through the measured micro-batch sizes at s, `time(b) = per_microbatch + per_sample * b`
  (`forward_s_per_microbatch[t]`, `forward_s_per_sample[t]`, and the backward's), both kept
  >= 0 (a negative intercept: the line through the origin; a negative slope: the mean, per
  micro-batch). §V scales a per-sample time, which on a CPU misses the operators' fixed cost:
  in four TP-1 profiles on the shared 2-core machine, one sample's forward took 1.5-3.9x an
  eighth of eight samples', and plans of one sample per micro-batch ran 2.5-3.6x slower than
  priced. With one measured size the line
  goes through the origin (§V). `activation_bytes_per_sample[t] = activation_bytes[b_ref][s]
  / b_ref`, `workspace_bytes_per_sample[t] = transient_bytes[b_ref][s] / b_ref`. A TP-t
  table is measured on t ranks, so its times include TP's own all-reduces:
  `tp_allreduce_bytes_per_sample` is 0 (nothing priced twice);
* model states: `param_bytes` is the layer's weight count times the dtype's bytes (what DP
  all-reduces and SDP gathers), and `model_state_factor` = the TP-1 decoder layer's measured
  `static_bytes` (weights, gradient buffer, Adam state) / `param_bytes`;
* embedding and output layer: their TP-1 `static_bytes` / `model_state_factor` as parameter
  bytes; `output_forward_s_per_sample` and `output_forward_s_per_microbatch` = the line
  (as above) of `lm_head`'s forward + backward, divided by 3, so that the estimator's forward
  + twice-forward backward of the output layer is the measured pair (per TP degree from each
  TP-t table's `lm_head`: vocabulary-parallel, its all-reduces inside; 1.5-2.5x the TP-1
  time over 2 ranks on the 2-core CPU),
  `output_activation_bytes_per_sample` = its activations / b_ref. The embedding's time is not
  priced (a lookup);
* communication: the all-reduce bus bandwidth each multi-rank table measured for its group
  size (`allreduce_bus_bandwidth`), for every stride (one machine), and between pipeline
  stages the two-rank one; the link latency is the two-rank table's `allreduce_latency_s`
  (one number's all-reduce; 0 where the table has none), which the estimator adds to every
  transfer between stages and every DP or SDP collective;
* SDP: what FSDP2 adds to a TP-1 decoder layer sharded over N ranks, its forward and its
  backward, as the N-rank table measured it (`sdp_layer_forward_s`, `sdp_layer_backward_s`),
  in place of the gathers' and reduce-scatter's bytes over the bandwidth: on gloo, FSDP2's
  copies and hooks took as long again as its collectives (a decoder layer of hidden 256 on 4
  ranks: 16 ms to gather, 12 ms to reduce-scatter, about 90 ms added per forward and backward).
  Tables without them keep §V's bytes over the bandwidth. Its memory: FSDP2's measured peak
  above the layer's sharded state during one forward and backward (`sdp_layer_transient_bytes`:
  the gathered weights and, beside them, the unsharded gradients and the reduce-scatter's
  buffers) in place of the gathered weights alone;
* CPU ranks (not in the paper, whose GPUs each run one rank): tables measured on a CPU hold
  the cores the profiler could run on (`host_cores`) and, per TP degree, the share of the
  measured passes' wall time the rank's process was on a core (`cpu_busy_fraction`: all its
  threads' CPU seconds over wall seconds), so that the estimator can bound a plan whose ranks
  outnumber the cores (`estimator.shared_host_time`). A table without them (a GPU's) turns
  the bound off; a multi-rank table also holds the share of FSDP2's added time its rank was on
  a core (`sdp_layer_cpu_busy_fraction`: its gathers and reduce-scatter wait on the others);
  the TP-1 table may hold how many more CPU seconds a layer's passes take as the first of as
  many pipeline stages as the job has ranks (`cpu_contention_factor`: {"ranks": {"b": factor}}
  at the grid's smallest and largest micro-batch; 1.28-1.39 at b=1 and 1.14-1.21 at b=8 for 4
  ranks on 2 cores), which scales the CPU seconds of the strategies whose tables' profiling
  processes each had a core (interpolated at their samples per rank), when the job's ranks
  outnumber the cores;
* the runtime's own cost per micro-batch (not in §V, which prices layers alone): the TP-1
  table's `runtime_s_per_microbatch` at s (a one-layer model through the executor's forward
  step, loss and backward, less its layer and output layer), added to every stage's
  micro-batch (0.3-1.6 ms at s = 128 in four profiles on the 2-core CPU).

Bad tables stop with a `PlanningError` naming the file and entry: another model's layer shape,
a TP degree the search needs but no table holds, negative or NaN values, the sequence length
not profiled, a bandwidth missing for a group size the strategy space uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..cost.profiled import FIELDS, FORMAT, affine_time
from ..errors import PlanningError
from ..input_files import load_json_file
from ..model_spec import ModelSpec
from .cost_inputs import CostInputs, LayerTypeCosts
from .plan_file import MODEL_SHAPE_FLAGS
from .space import pipeline_degrees, strategy_space

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_COMPONENTS = ("decoder_layer", "embedding", "lm_head")


def read_cost_tables(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Load the tables (one per TP degree, as the profiler writes them); each keeps its path
    under `"path"` for the messages."""
    tables = []
    for path in paths:
        data = load_json_file(path, "cost table", kind=None)
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != 1:
            raise PlanningError(f"cost table {path}: expected format {FORMAT!r} version 1")
        if not isinstance(data.get("entries"), list) or not data["entries"]:
            raise PlanningError(f"cost table {path}: 'entries' must be a non-empty list")
        tables.append({**data, "path": str(path)})
    if not tables:
        raise PlanningError("no cost table given")
    return tables


def _check_model(table: dict[str, Any], model: ModelSpec) -> None:
    """The table's layers have `model`'s shape (layer count and vocabulary padding aside)."""
    described = table.get("model")
    if not isinstance(described, dict):
        raise PlanningError(f"cost table {table['path']}: no 'model' description")
    try:
        profiled = ModelSpec.from_dict(described)
    except (PlanningError, TypeError, ValueError, KeyError) as e:
        raise PlanningError(f"cost table {table['path']}: bad 'model' ({e})") from None
    for name in MODEL_SHAPE_FLAGS:
        if name != "num_layers" and getattr(profiled, name) != getattr(model, name):
            raise PlanningError(
                f"cost table {table['path']} was profiled for a model with {name} "
                f"{getattr(profiled, name)}; {model.name} has {getattr(model, name)}"
            )


def _entries(tables: list[dict[str, Any]]) -> dict[tuple[int, str], tuple[dict, str]]:
    """(TP degree, component) -> (entry, where) of the `recompute: "none"` entries."""
    out: dict[tuple[int, str], tuple[dict, str]] = {}
    for table in tables:
        for i, e in enumerate(table["entries"]):
            if not isinstance(e, dict) or e.get("recompute") != "none":
                continue
            tp, component = e.get("tp"), e.get("component")
            where = f"cost table {table['path']} entry {i} (tp={tp}, {component})"
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise PlanningError(f"{where}: 'tp' must be a positive integer")
            if (tp, component) in out:
                raise PlanningError(f"{where}: a second entry for tp={tp}, {component}")
            out[tp, component] = (e, where)
    return out


def _point(
    entry: dict, where: str, seq_length: int
) -> tuple[int, dict[str, float], list[tuple[int, dict[str, float]]]]:
    """(b_ref, the four fields at (b_ref, seq_length), every measured (b, fields) at
    seq_length), after checking the whole entry."""
    seqlens, sizes = entry.get("seqlens"), entry.get("microbatch_sizes")
    if not isinstance(seqlens, list) or not isinstance(sizes, list) or not sizes:
        raise PlanningError(f"{where}: 'seqlens' and 'microbatch_sizes' must be lists")
    arrays = {}
    for name in FIELDS:
        try:
            arr = np.array(entry.get(name), dtype=np.float64)  # null -> nan
        except (TypeError, ValueError):
            raise PlanningError(f"{where}: {name} is not a numeric table") from None
        if arr.shape != (len(sizes), len(seqlens)):
            raise PlanningError(
                f"{where}: {name} has shape {arr.shape}, grid is {(len(sizes), len(seqlens))}"
            )
        for i, row in enumerate(entry[name]):
            for j, value in enumerate(row):
                if value is not None and not (math.isfinite(value) and value >= 0):
                    raise PlanningError(
                        f"{where}: {name} at micro-batch {sizes[i]}, sequence length "
                        f"{seqlens[j]} is {value} (must be finite and >= 0, or null)"
                    )
        arrays[name] = arr
    if seq_length not in seqlens:
        raise PlanningError(
            f"{where}: sequence length {seq_length} was not profiled (profiled: {seqlens})"
        )
    column = seqlens.index(seq_length)
    measured = [
        i for i in range(len(sizes)) if all(np.isfinite(arrays[n][i, column]) for n in FIELDS)
    ]
    if not measured:
        raise PlanningError(f"{where}: no micro-batch measured at sequence length {seq_length}")
    rows = [(int(sizes[i]), {n: float(arrays[n][i, column]) for n in FIELDS}) for i in measured]
    return rows[-1][0], rows[-1][1], rows


def _static(entry: dict, where: str) -> float:
    value = entry.get("static_bytes")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise PlanningError(f"{where}: static_bytes must be a number >= 0, got {value!r}")
    if not math.isfinite(value):
        raise PlanningError(f"{where}: static_bytes must be finite, got {value!r}")
    return float(value)


def _per_group(
    tables: list[dict[str, Any]], key: str, *, allow_zero: bool = False
) -> dict[int, float]:
    """Group size -> the measured positive (or, `allow_zero`, non-negative) number under `key`
    (bandwidth, latency, FSDP2's time)."""
    out: dict[int, float] = {}
    for table in tables:
        for size, bw in (table.get(key) or {}).items():
            where = f"cost table {table['path']} {key}[{size!r}]"
            try:
                n = int(size)
            except ValueError:
                raise PlanningError(f"{where}: the key must be a group size") from None
            bad = not (bw >= 0 if allow_zero else bw > 0) if isinstance(bw, int | float) else True
            if isinstance(bw, bool) or bad:
                kind = "a number >= 0" if allow_zero else "a positive number"
                raise PlanningError(f"{where} must be {kind}, got {bw!r}")
            if not math.isfinite(bw):
                raise PlanningError(f"{where} must be finite, got {bw!r}")
            out[n] = max(out.get(n, 0.0), float(bw))
    return out


def required_tp_degrees(model: ModelSpec, num_gpus: int, max_tp: int) -> list[int]:
    """TP degrees the search may use: divisors of the GPUs and the heads up to `max_tp`."""
    top = min(max_tp, num_gpus)
    return [t for t in range(1, top + 1) if num_gpus % t == 0 and not model.num_heads % t]


def profiled_cost_inputs(
    model: ModelSpec,
    tables: list[dict[str, Any]],
    num_gpus: int,
    *,
    seq_length: int,
    max_tp: int | None = None,
    overlap_slowdown: float = 1.3,
) -> CostInputs:
    """`CostInputs` of `model` on `num_gpus` ranks from profiled `tables` (`read_cost_tables`),
    scaled as the module docstring says. Every TP degree up to `max_tp` (default: the largest
    profiled) that divides the GPUs and the heads must be profiled."""
    if model.is_encoder_decoder:
        raise PlanningError("profiled search inputs cover GPT models (decoder layers) only")
    for table in tables:
        _check_model(table, model)
    dtypes = {t.get("dtype", "bf16") for t in tables}
    if len(dtypes) > 1 or not dtypes <= set(DTYPE_BYTES):
        raise PlanningError(f"cost tables: one dtype of {sorted(DTYPE_BYTES)} needed, got {dtypes}")
    dtype_bytes = DTYPE_BYTES[dtypes.pop()]
    entries = _entries(tables)
    profiled_tp = sorted({tp for tp, c in entries if c == "decoder_layer"})
    if not profiled_tp:
        raise PlanningError(
            f"cost tables {[t['path'] for t in tables]}: no decoder_layer entry at recompute none"
        )
    limit = max(profiled_tp) if max_tp is None else max_tp
    degrees = required_tp_degrees(model, num_gpus, limit)
    for tp in degrees:
        for component in _COMPONENTS if tp == 1 else ("decoder_layer",):
            if (tp, component) not in entries:
                raise PlanningError(
                    f"cost tables {[t['path'] for t in tables]}: no {component} entry for "
                    f"tp={tp} (recompute none; profiled TP degrees {profiled_tp}); profile it "
                    f"on {tp} ranks or lower --max-tp"
                )
    forward, backward, activation, workspace = {}, {}, {}, {}
    forward_fixed, backward_fixed = {}, {}
    for tp in degrees:
        entry, where = entries[tp, "decoder_layer"]
        b, point, rows = _point(entry, where, seq_length)
        forward_fixed[tp], forward[tp] = affine_time([(n, r["forward_s"]) for n, r in rows])
        backward_fixed[tp], backward[tp] = affine_time([(n, r["backward_s"]) for n, r in rows])
        activation[tp] = point["activation_bytes"] / b
        workspace[tp] = point["transient_bytes"] / b
    param_bytes = float(model.layer_params("decoder") * dtype_bytes)
    layer_entry, layer_where = entries[1, "decoder_layer"]
    state_factor = _static(layer_entry, layer_where) / param_bytes
    if state_factor <= 0:
        raise PlanningError(f"{layer_where}: static_bytes must be positive")
    head_fixed, head_per_sample = {}, {}
    for tp in degrees:
        if (tp, "lm_head") in entries:
            _, _, head_rows = _point(*entries[tp, "lm_head"], seq_length)
            head_fixed[tp], head_per_sample[tp] = affine_time(
                [(n, (r["forward_s"] + r["backward_s"]) / 3.0) for n, r in head_rows]
            )
    head_entry, head_where = entries[1, "lm_head"]
    b_head, head, _ = _point(head_entry, head_where, seq_length)
    embedding_bytes = _static(*entries[1, "embedding"]) / state_factor
    _point(*entries[1, "embedding"], seq_length)  # checked like the others, time not priced
    measured_bw = _per_group(tables, "allreduce_bus_bandwidth")
    latency = _per_group(tables, "allreduce_latency_s").get(2, 0.0)
    sdp_forward = _per_group(tables, "sdp_layer_forward_s", allow_zero=True)
    sdp_backward = _per_group(tables, "sdp_layer_backward_s", allow_zero=True)
    cores = _host_cores(tables)
    busy = _per_group(tables, "cpu_busy_fraction")
    sdp_busy = _per_group(tables, "sdp_layer_cpu_busy_fraction", allow_zero=True)
    sdp_transient = _per_group(tables, "sdp_layer_transient_bytes", allow_zero=True)
    runtime = _runtime_s(tables, seq_length)
    allreduce, p2p = _topology(measured_bw, num_gpus, tables)
    layer = LayerTypeCosts(
        name="decoder",
        forward_s_per_sample=forward,
        activation_bytes_per_sample=activation,
        workspace_bytes_per_sample=workspace,
        param_bytes=param_bytes,
        boundary_bytes_per_sample=float(dtype_bytes * seq_length * model.hidden_size),
        tp_allreduce_bytes_per_sample=0.0,
        backward_s_per_sample=backward,
        forward_s_per_microbatch=forward_fixed,
        backward_s_per_microbatch=backward_fixed,
    )
    return CostInputs(
        layer_types=(layer,),
        layer_kinds=(0,) * model.num_layers,
        allreduce_bandwidth=allreduce,
        p2p_bandwidth=p2p,
        overlap_slowdown=overlap_slowdown,
        model_state_factor=state_factor,
        link_latency_s=latency,
        embedding_param_bytes=embedding_bytes,
        output_param_bytes=_static(head_entry, head_where) / state_factor,
        output_forward_s_per_sample=head_per_sample[1],
        output_forward_s_per_microbatch=head_fixed[1],
        output_forward_s_per_sample_by_tp=head_per_sample,
        output_forward_s_per_microbatch_by_tp=head_fixed,
        sdp_forward_s=sdp_forward,
        sdp_backward_s=sdp_backward,
        host_cores=cores,
        runtime_s_per_microbatch=runtime,
        cpu_busy_fraction=busy,
        sdp_cpu_busy_fraction=sdp_busy,
        cpu_contention_factor=_contention(tables, num_gpus, cores),
        sdp_transient_bytes=sdp_transient,
        output_activation_bytes_per_sample=head["activation_bytes"] / b_head,
        seq_length=seq_length,
        description={
            "kind": "profiled",
            "tables": [t["path"] for t in tables],
            "devices": sorted({str(t.get("device")) for t in tables}),
            "model": model.name,
            "num_gpus": num_gpus,
            "seq_length": seq_length,
            "tp_degrees": degrees,
        },
    )


def _runtime_s(tables: list[dict[str, Any]], seq_length: int) -> float:
    """The TP-1 table's `runtime_s_per_microbatch` at `seq_length` (0 where not measured)."""
    for table in tables:
        if not any(e.get("tp") == 1 for e in table["entries"] if isinstance(e, dict)):
            continue
        value = (table.get("runtime_s_per_microbatch") or {}).get(str(seq_length), 0.0)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and value >= 0 and math.isfinite(value)):
            raise PlanningError(
                f"cost table {table['path']} runtime_s_per_microbatch[{str(seq_length)!r}] "
                f"must be a finite number >= 0, got {value!r}"
            )
        return float(value)
    return 0.0


def _contention(tables: list[dict[str, Any]], ranks: int, cores: int) -> dict[int, float]:
    """Micro-batch size -> the factor on the CPU seconds of the ranks whose profiling
    processes each had a core: the TP-1 table's `cpu_contention_factor` for the job's
    `ranks`, where they outnumber the `cores`; empty where they do not or nothing measured
    it (the factor is then 1)."""
    found: dict[int, dict[int, float]] = {}
    for table in tables:
        for key, per_size in (table.get("cpu_contention_factor") or {}).items():
            name = f"cpu_contention_factor[{key!r}]"
            if not isinstance(per_size, dict):
                raise PlanningError(
                    f"cost table {table['path']} {name} must map micro-batch sizes to factors "
                    f"(profile again with --cpu-contention-ranks), got {per_size!r}"
                )
            sizes = _per_group([{"path": table["path"], name: per_size}], name)
            try:
                found[int(key)] = sizes
            except ValueError:
                raise PlanningError(
                    f"cost table {table['path']} {name}: the key must be a rank count"
                ) from None
    return found.get(ranks, {}) if cores and ranks > cores else {}


def _host_cores(tables: list[dict[str, Any]]) -> int:
    """The CPU cores the profiled ranks shared (`host_cores`), when every table was measured
    on a CPU; 0 otherwise (devices of their own)."""
    cores = []
    for table in tables:
        n = table.get("host_cores")
        if n is None:
            return 0
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PlanningError(
                f"cost table {table['path']} host_cores must be a positive integer, got {n!r}"
            )
        cores.append(n)
    return min(cores)


def _topology(
    measured: dict[int, float], num_gpus: int, tables: list[dict[str, Any]]
) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """The measured bandwidth of each group size for every (size, stride) the strategy space
    uses, and the two-rank one between pipeline stages."""
    sizes = {
        s.degree(p)
        for strategies in strategy_space(num_gpus, prune=False).values()
        for s in strategies
        for p in s.order
    }
    if num_gpus > 1:
        sizes.add(2)  # pipeline neighbours, and a stage group's re-layout
    sizes |= {num_gpus // pp for pp in pipeline_degrees(num_gpus) if num_gpus // pp > 1}
    missing = sorted(n for n in sizes if n not in measured)
    if missing:
        raise PlanningError(
            f"cost tables {[t['path'] for t in tables]}: no all-reduce bandwidth measured for "
            f"groups of {missing} ranks (profile a table on that many ranks); measured: "
            f"{sorted(measured) or 'none'}"
        )
    allreduce = {
        (s.degree(p), s.stride(p)): measured[s.degree(p)]
        for strategies in strategy_space(num_gpus, prune=False).values()
        for s in strategies
        for p in s.order
    }
    for n in sizes:
        allreduce[n, 1] = measured[n]
    return allreduce, {pp: measured[2] for pp in pipeline_degrees(num_gpus) if pp > 1}
