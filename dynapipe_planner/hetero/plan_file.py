"""HexiScale plans on disk and on screen (seed hexiscale.txt §3.2: what the asymmetric runtime
needs to build its groups: per pipeline its stages, device ids, TP degree, layer range,
micro-batches and batch size).

The JSON carries a `"replicas"` list in the ExecutionPlan contract's heterogeneous form
(`plan.ReplicaLayout`: `{"id", "num_stages", "stages": [{"devices", "tp", "layers"}]}`), each
replica extended with its `micro_batches` and `batch_size`, so a runtime reading replicas reads
this file too. Files are written atomically: a failed write leaves no partial file behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PlanningError
from ..input_files import check_input_file, json_loads
from ..plan import atomic_write
from .layout import HeteroPipeline, HeteroPlan, HeteroStage

FORMAT = "hexiscale-plan"
VERSION = 1


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
        raise PlanningError(f"{where}: missing {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise PlanningError(f"{where}: {key!r} has the wrong type ({value!r})")
    return value


def plan_from_dict(data: Any, source: str = "plan") -> HeteroPlan:
    """Inverse of `plan_to_dict`; errors name the replica and stage."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanningError(f"{source}: not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise PlanningError(f"{source}: version {data.get('version')!r}, expected {VERSION}")
    pipes = []
    for i, rep in enumerate(_field(data, "replicas", source, list)):
        where = f"{source}: replica {i}"
        stages = []
        raw_stages = _field(rep, "stages", where, list)
        if _field(rep, "num_stages", where) != len(raw_stages):
            raise PlanningError(f"{where}: num_stages does not match its {len(raw_stages)} stages")
        for j, st in enumerate(raw_stages):
            w = f"{where} stage {j}"
            devices = tuple(_field(st, "devices", w, list))
            layers = _field(st, "layers", w, list)
            if len(layers) != 2 or _field(st, "tp", w) != len(devices):
                raise PlanningError(f"{w}: needs layers [start, end) and tp = len(devices)")
            stages.append(HeteroStage(tuple(int(d) for d in devices), (layers[0], layers[1])))
        pipes.append(HeteroPipeline(tuple(stages), _field(rep, "micro_batches", where)))
    return HeteroPlan(
        pipes,
        _field(data, "micro_batch_size", source),
        _field(data, "seqlen", source),
        str(data.get("model", "")),
        str(data.get("cluster", "")),
        dict(data.get("stats", {})),
    )


def save_plan(plan: HeteroPlan, path: str | Path) -> None:
    payload = json.dumps(plan_to_dict(plan), indent=1).encode()
    try:
        atomic_write(Path(path), payload)
    except OSError as e:
        raise PlanningError(f"cannot write plan {path}: {e.strerror}") from e


def load_plan(path: str | Path) -> HeteroPlan:
    path = Path(path)
    check_input_file(path, "plan")
    try:
        data = json_loads(path.read_text())
    except OSError as e:
        raise PlanningError(f"cannot read plan {path}: {e.strerror}") from e
    except ValueError as e:
        raise PlanningError(f"plan {path}: not valid JSON ({e})") from e
    return plan_from_dict(data, str(path))


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
