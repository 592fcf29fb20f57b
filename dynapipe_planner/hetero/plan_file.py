"""HexiScale plans on disk and on screen (seed hexiscale.txt §3.2: what the asymmetric runtime
needs to build its groups: per pipeline its stages, device ids, TP degree, layer range,
micro-batches and batch size), and the one reader of the static layouts `--hetero-plan` takes.

The JSON carries a `"replicas"` list in the ExecutionPlan contract's heterogeneous form
(`plan.ReplicaLayout`: `{"id", "num_stages", "stages": [{"devices", "tp", "layers"}]}`), each
replica extended with its `micro_batches` and `batch_size`, so a runtime reading replicas reads
this file too. Files are written atomically: a failed write leaves no partial file behind.

`--hetero-plan` fixes, before training, each stage's devices (its TP group), its layer range,
and each pipeline's share of the global batch (`static_hetero`). It reads two documents into one
`HeteroPlanFile`, checked against the model (`parse_hetero_layout`):

* a plan of this module (`"format": "hexiscale-plan"`), through `plan_from_dict` (there is no
  second reader of these files): each pipeline's share its `batch_size` over the sum of them,
  each stage's mode its `stats.recompute` (the modes the planner priced, e.g. per stage under
  `--recompute auto`);
* a layout written by hand (device indices are global ranks; `layers` is [first, end) of the
  transformer layers; `batch_fraction` is the pipeline's share of each global batch's tokens,
  the shares summing to 1; a stage may name its `"recompute": "none" | "selective" | "full"`,
  all stages or none, which the planner then keeps instead of choosing a mode per pipeline and
  iteration):

      {"replicas": [
          {"stages": [{"devices": [0, 1], "tp": 2, "layers": [0, 2]},
                      {"devices": [2], "tp": 1, "layers": [2, 4]}],
           "batch_fraction": 0.5},
          {"stages": [{"devices": [3], "tp": 1, "layers": [0, 4]}], "batch_fraction": 0.5}]}

Each error names the item (`replicas[1].stages[0].tp`, `replica 1 stage 0`), so a wrong file
fails on every rank with the same message. Whether the layouts fit the job's ranks (each rank in
one stage, a pipeline's stages on increasing ranks) is the runtime's check
(`megatron.dynapipe.layouts.plan_file`), which owns the rank bookkeeping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from ..cost.analytic import RECOMPUTE_MODES
from ..errors import PlanningError
from ..input_files import load_json_file
from ..model_spec import ModelSpec
from ..plan import ReplicaLayout, StageLayout, atomic_write
from .layout import HeteroPipeline, HeteroPlan, HeteroStage

FORMAT = "hexiscale-plan"
VERSION = 1


class HeteroPlanError(PlanningError):
    """A HexiScale plan or `--hetero-plan` layout is malformed or does not fit the model or the
    job; the message names the file and the item."""


class HeteroPlanFile(NamedTuple):
    """What a `--hetero-plan` file fixes: each pipeline's layout and share of the batch, and
    (when the file names them) each stage's recomputation mode, per pipeline."""

    layouts: list[ReplicaLayout]
    fractions: list[float]
    recompute: tuple[tuple[str, ...], ...]


def plan_to_dict(plan: HeteroPlan) -> dict[str, Any]:
    replicas = []
    for layout, pipe in zip(plan.replica_layouts(), plan.pipelines, strict=True):
        entry = layout.to_dict()
        entry["micro_batches"] = pipe.micro_batches
        entry["batch_size"] = pipe.micro_batches * plan.micro_batch_size
        replicas.append(entry)
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": plan.model,
        "cluster": plan.cluster,
        "seqlen": plan.seqlen,
        "micro_batch_size": plan.micro_batch_size,
        "global_batch": plan.global_batch,
        "num_replicas": len(plan.pipelines),
        "replicas": replicas,
        "stats": plan.stats,
    }


def _field(obj: Any, key: str, where: str, kind: type | tuple = int) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise HeteroPlanError(f"{where}: missing {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HeteroPlanError(f"{where}: {key!r} has the wrong type ({value!r})")
    return value


def _ints(values: list, where: str) -> tuple[int, ...]:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise HeteroPlanError(f"{where} must list integers, got {values!r}")
    return tuple(values)


def plan_from_dict(data: Any, source: str = "plan") -> HeteroPlan:
    """Inverse of `plan_to_dict`; errors name the replica and stage. Whatever the runtime reads
    of the plan is checked here: device and layer numbers are integers, every pipeline runs a
    micro-batch, its `batch_size` is its micro-batches' (the runtime's share of the batch), and
    `stats.recompute`, when present, names a known mode for every stage."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise HeteroPlanError(f"{source}: not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise HeteroPlanError(f"{source}: version {data.get('version')!r}, expected {VERSION}")
    micro_batch_size = _field(data, "micro_batch_size", source)
    pipes = []
    replicas = _field(data, "replicas", source, list)
    if not replicas:
        raise HeteroPlanError(f"{source}: 'replicas' lists no pipeline")
    for i, rep in enumerate(replicas):
        where = f"{source}: replica {i}"
        stages = []
        raw_stages = _field(rep, "stages", where, list)
        if not raw_stages:
            raise HeteroPlanError(f"{where}: 'stages' lists no stage")
        if _field(rep, "num_stages", where) != len(raw_stages):
            raise HeteroPlanError(
                f"{where}: num_stages does not match its {len(raw_stages)} stages"
            )
        for j, st in enumerate(raw_stages):
            w = f"{where} stage {j}"
            devices = _ints(_field(st, "devices", w, list), f"{w}: devices")
            layers = _ints(_field(st, "layers", w, list), f"{w}: layers")
            if not devices or len(layers) != 2 or _field(st, "tp", w) != len(devices):
                raise HeteroPlanError(
                    f"{w}: needs devices, layers [start, end) and tp = len(devices)"
                )
            stages.append(HeteroStage(devices, (layers[0], layers[1])))
        micro_batches = _field(rep, "micro_batches", where)
        if micro_batches < 1:
            raise HeteroPlanError(f"{where}: micro_batches must be >= 1, got {micro_batches}")
        size = rep.get("batch_size", micro_batches * micro_batch_size)
        if size != micro_batches * micro_batch_size:
            raise HeteroPlanError(
                f"{where}: batch_size {size!r} is not its {micro_batches} micro-batches of "
                f"{micro_batch_size}"
            )
        pipes.append(HeteroPipeline(tuple(stages), micro_batches))
    stats = data.get("stats", {})
    if not isinstance(stats, dict):
        raise HeteroPlanError(f"{source}: 'stats' must be an object, got {stats!r}")
    _check_planned_modes(stats.get("recompute"), pipes, source)
    return HeteroPlan(
        pipes,
        micro_batch_size,
        _field(data, "seqlen", source),
        str(data.get("model", "")),
        str(data.get("cluster", "")),
        dict(stats),
    )


def _check_planned_modes(modes: Any, pipes: list[HeteroPipeline], source: str) -> None:
    """`stats.recompute` (absent, or one known mode per stage of every pipeline): the modes the
    runtime runs the stages in and `plan_table` shows."""
    if modes is None:
        return
    for k, pipe in enumerate(pipes):
        mine = modes[k] if isinstance(modes, list) and k < len(modes) else None
        if not isinstance(mine, list) or len(mine) != len(pipe.stages):
            raise HeteroPlanError(
                f"{source}: stats.recompute[{k}] must list one mode per stage of "
                f"replicas[{k}], got {mine!r}"
            )
        for j, mode in enumerate(mine):
            if mode not in RECOMPUTE_MODES:
                raise HeteroPlanError(
                    f"{source}: stats.recompute[{k}][{j}] must be one of {RECOMPUTE_MODES}, "
                    f"got {mode!r}"
                )


def save_plan(plan: HeteroPlan, path: str | Path) -> None:
    payload = json.dumps(plan_to_dict(plan), indent=1).encode()
    try:
        atomic_write(Path(path), payload)
    except OSError as e:
        raise PlanningError(f"cannot write plan {path}: {e.strerror}") from e


def load_plan(path: str | Path) -> HeteroPlan:
    return plan_from_dict(load_json_file(path, "plan", HeteroPlanError), str(path))


def parse_hetero_layout(
    data: object, spec: ModelSpec, source: str = "hetero plan"
) -> HeteroPlanFile:
    """Layouts, batch shares and stage modes of a parsed `--hetero-plan` document (either
    form), checked against the model: TP divides the heads and the FFN width, every pipeline
    holds all the layers."""
    if not isinstance(data, dict) or "replicas" not in data:
        raise HeteroPlanError(f'{source}: expected an object with a "replicas" list')
    if data.get("format") == FORMAT:
        plan = plan_from_dict(data, source)
        sizes = [p.micro_batches for p in plan.pipelines]
        modes = tuple(tuple(m) for m in (plan.stats.get("recompute") or ())[: len(sizes)])
        found = HeteroPlanFile(plan.replica_layouts(), [s / sum(sizes) for s in sizes], modes)
    else:
        found = _hand_written_layout(data, source)
    for k, layout in enumerate(found.layouts):
        for j, stage in enumerate(layout.stages):
            at = f"{source}: replicas[{k}].stages[{j}]"
            if spec.num_heads % stage.tp or spec.ffn_hidden_size % stage.tp:
                raise HeteroPlanError(
                    f"{at}.tp {stage.tp} does not divide the model's {spec.num_heads} heads "
                    f"and FFN width {spec.ffn_hidden_size}"
                )
            first, end = stage.layers
            if not 0 <= first < end <= spec.num_layers:
                raise HeteroPlanError(
                    f"{at}.layers [{first}, {end}] is not a non-empty range of the model's "
                    f"{spec.num_layers} layers"
                )
        end = layout.stages[-1].layers[1]
        if end != spec.num_layers:
            raise HeteroPlanError(
                f"{source}: replicas[{k}].stages[{len(layout.stages) - 1}].layers ends at {end}; "
                f"the pipeline must hold all {spec.num_layers} layers"
            )
    return found


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HeteroPlanError(f"{where} must be an integer, got {value!r}")
    return value


def _list(value: object, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise HeteroPlanError(f"{where} must be a non-empty list, got {value!r}")
    return value


def _hand_written_layout(data: dict, source: str) -> HeteroPlanFile:
    """The layouts, shares and stage modes a hand-written `--hetero-plan` names (the module
    docstring's form), each field checked for its type and range."""
    layouts, fractions, modes = [], [], []
    for k, rep in enumerate(_list(data["replicas"], f"{source}: replicas")):
        where = f"{source}: replicas[{k}]"
        if not isinstance(rep, dict):
            raise HeteroPlanError(f"{where} must be an object, got {rep!r}")
        unknown = sorted(set(rep) - {"stages", "batch_fraction"})
        if unknown:
            raise HeteroPlanError(f"{where} has unknown field(s) {unknown}")
        fraction = rep.get("batch_fraction")
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or fraction <= 0:
            raise HeteroPlanError(f"{where}.batch_fraction must be a number > 0, got {fraction!r}")
        stages = []
        for j, stage in enumerate(_list(rep.get("stages"), f"{where}.stages")):
            at = f"{where}.stages[{j}]"
            if not isinstance(stage, dict):
                raise HeteroPlanError(f"{at} must be an object, got {stage!r}")
            unknown = sorted(set(stage) - {"devices", "tp", "layers", "recompute"})
            if unknown:
                raise HeteroPlanError(f"{at} has unknown field(s) {unknown}")
            devices = [
                _int(d, f"{at}.devices[{i}]")
                for i, d in enumerate(_list(stage.get("devices"), f"{at}.devices"))
            ]
            tp = _int(stage.get("tp", len(devices)), f"{at}.tp")
            if tp != len(devices):
                raise HeteroPlanError(f"{at}.tp is {tp} but it lists {len(devices)} device(s)")
            layers = stage.get("layers")
            if not isinstance(layers, list) or len(layers) != 2:
                raise HeteroPlanError(f"{at}.layers must be [first, end], got {layers!r}")
            first, end = (_int(x, f"{at}.layers") for x in layers)
            stages.append(StageLayout(devices, tp, (first, end)))
            mode = stage.get("recompute")
            if mode is not None and mode not in RECOMPUTE_MODES:
                raise HeteroPlanError(
                    f"{at}.recompute must be one of {RECOMPUTE_MODES}, got {mode!r}"
                )
            modes.append((at, k, mode))
        layouts.append(ReplicaLayout(k, len(stages), stages))
        fractions.append(float(fraction))
    named = [at for at, _, mode in modes if mode is not None]
    if named and len(named) != len(modes):
        missing = next(at for at, _, mode in modes if mode is None)
        raise HeteroPlanError(
            f"{missing} names no recompute mode while {named[0]} does: name all or none"
        )
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise HeteroPlanError(
            f"{source}: the replicas' batch_fraction values sum to {sum(fractions):.6g}, not 1"
        )
    per_pipeline = tuple(
        tuple(mode for _, owner, mode in modes if owner == k) for k in range(len(layouts))
    )
    return HeteroPlanFile(layouts, fractions, per_pipeline if named else ())


def plan_table(plan: HeteroPlan, gpu_of: Any = None) -> str:
    """One row per stage: pipeline, stage, devices, GPU type, TP, layers, recomputation (as
    the plan's estimate priced it), micro-batches."""
    modes = plan.stats.get("recompute")
    header = ("pipeline", "stage", "devices", "gpu", "tp", "layers", "recompute", "micro-batches")
    rows = [(*header, "batch")]
    for i, p in enumerate(plan.pipelines):
        for j, s in enumerate(p.stages):
            devs = s.devices
            shown = f"{devs[0]}-{devs[-1]}" if len(devs) > 2 else ",".join(map(str, devs))
            rows.append(
                (
                    str(i) if j == 0 else "",
                    str(j),
                    shown,
                    gpu_of(devs[0]) if gpu_of else "",
                    str(s.tp),
                    f"{s.layers[0]}-{s.layers[1] - 1} ({s.num_layers})",
                    modes[i][j] if modes else "",
                    str(p.micro_batches) if j == 0 else "",
                    str(p.micro_batches * plan.micro_batch_size) if j == 0 else "",
                )
            )
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
