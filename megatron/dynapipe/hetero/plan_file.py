"""The `--hetero-plan` file: a static asymmetric layout and each pipeline's share of the batch.

HexiScale (seed `hexiscale.txt` §3.2) fixes, before training, the pipelines of a mixed
cluster: each stage's devices (its TP group), its layer range, and each pipeline's share of the
global batch. Until that planner emits its own plan files the runtime reads this small JSON
layout (device indices are global ranks; `layers` is [first, end) of the transformer layers):

    {"replicas": [
        {"stages": [{"devices": [0, 1], "tp": 2, "layers": [0, 2]},
                    {"devices": [2], "tp": 1, "layers": [2, 4]}],
         "batch_fraction": 0.5},
        {"stages": [{"devices": [3], "tp": 1, "layers": [0, 4]}], "batch_fraction": 0.5}]}

`batch_fraction` is the pipeline's share of each global batch's tokens; the shares sum to 1.
A stage may name its activation recomputation, `"recompute": "none" | "selective" | "full"`
(all stages or none): the planner then keeps it fixed for that stage instead of choosing one
mode per pipeline and iteration. A `dynapipe-hetero --output` plan (`"format":
"hexiscale-plan"`) is read too: its replicas' stages as they are, each pipeline's share its
`batch_size` over the sum of them, each stage's mode from its `stats.recompute` (the modes the
HexiScale planner priced, e.g. per stage under `--recompute auto`). Its device ids
are taken as global ranks, so a plan whose stage order puts a later stage on a lower device
than an earlier one is refused (megatron-core numbers stages by rank order) with the replica
and stage named; `dynapipe-hetero --bind-ranks` (`hetero.rank_binding`) writes such a plan
renumbered so that it runs.
Everything is checked before any process group exists, and each error names the item
(`replicas[1].stages[0].tp`), so a wrong file fails on every rank with the same message.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from dynapipe_planner.input_files import check_input_file, json_loads
from dynapipe_planner.model_spec import ModelSpec
from dynapipe_planner.plan import ReplicaLayout, StageLayout

from ..pipeline.recompute import RECOMPUTE_MODES
from .groups import HeteroTopology, LayoutMismatch

HEXISCALE_FORMAT = "hexiscale-plan"  # dynapipe_planner.hetero.plan_file.FORMAT


class HeteroPlanError(ValueError):
    """The `--hetero-plan` file is malformed or does not fit the model or the job."""


class HeteroPlanFile(NamedTuple):
    """What a `--hetero-plan` file fixes: each pipeline's layout and share of the batch, and
    (when the file names them) each stage's recomputation mode, per pipeline."""

    layouts: list[ReplicaLayout]
    fractions: list[float]
    recompute: tuple[tuple[str, ...], ...]


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HeteroPlanError(f"{where} must be an integer, got {value!r}")
    return value


def _list(value: object, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise HeteroPlanError(f"{where} must be a non-empty list, got {value!r}")
    return value


def parse_hetero_plan(
    data: object, spec: ModelSpec, world_size: int, *, source: str = "hetero plan"
) -> HeteroPlanFile:
    """Layouts, batch fractions and stage modes of a parsed `--hetero-plan` document, checked
    against the model (`spec`: TP divides the heads and FFN width, every pipeline holds all its
    layers) and the job (`world_size`: every rank in exactly one stage)."""
    if not isinstance(data, dict) or "replicas" not in data:
        raise HeteroPlanError(f'{source}: expected an object with a "replicas" list')
    if data.get("format") == HEXISCALE_FORMAT:
        data = _from_hexiscale(data, source)
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
            if spec.num_heads % tp or spec.ffn_hidden_size % tp:
                raise HeteroPlanError(
                    f"{at}.tp {tp} does not divide the model's {spec.num_heads} heads and FFN "
                    f"width {spec.ffn_hidden_size}"
                )
            layers = stage.get("layers")
            if not isinstance(layers, list) or len(layers) != 2:
                raise HeteroPlanError(f"{at}.layers must be [first, end], got {layers!r}")
            first, end = (_int(x, f"{at}.layers") for x in layers)
            if not 0 <= first < end <= spec.num_layers:
                raise HeteroPlanError(
                    f"{at}.layers [{first}, {end}] is not a non-empty range of the model's "
                    f"{spec.num_layers} layers"
                )
            stages.append(StageLayout(devices, tp, (first, end)))
            mode = stage.get("recompute")
            if mode is not None and mode not in RECOMPUTE_MODES:
                raise HeteroPlanError(
                    f"{at}.recompute must be one of {RECOMPUTE_MODES}, got {mode!r}"
                )
            modes.append((at, k, mode))
        if stages[-1].layers[1] != spec.num_layers:
            raise HeteroPlanError(
                f"{where}.stages[{len(stages) - 1}].layers ends at {stages[-1].layers[1]}; the "
                f"pipeline must hold all {spec.num_layers} layers"
            )
        layouts.append(ReplicaLayout(k, len(stages), stages))
        fractions.append(float(fraction))
    named = [at for at, _, mode in modes if mode is not None]
    if named and len(named) != len(modes):
        missing = next(at for at, _, mode in modes if mode is None)
        raise HeteroPlanError(
            f"{missing} names no recompute mode while {named[0]} does: name all or none"
        )
    per_pipeline = tuple(
        tuple(mode for _, owner, mode in modes if owner == k) for k in range(len(layouts))
    )
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise HeteroPlanError(
            f"{source}: the replicas' batch_fraction values sum to {sum(fractions):.6g}, not 1"
        )
    try:
        HeteroTopology.from_layouts(layouts, world_size)
    except LayoutMismatch as err:
        raise HeteroPlanError(f"{source}: {err}") from err
    return HeteroPlanFile(layouts, fractions, per_pipeline if named else ())


def _from_hexiscale(data: dict, source: str) -> dict:
    """A `dynapipe-hetero` plan as this file's layout: stages kept (with the modes of its
    `stats.recompute`), batch sizes as shares."""
    replicas = _list(data["replicas"], f"{source}: replicas")
    modes = data.get("stats", {}).get("recompute")
    sizes = []
    for k, rep in enumerate(replicas):
        size = rep.get("batch_size") if isinstance(rep, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise HeteroPlanError(f"{source}: replicas[{k}].batch_size must be > 0, got {size!r}")
        sizes.append(size)
    out = []
    for k, (rep, size) in enumerate(zip(replicas, sizes, strict=True)):
        stages = rep.get("stages")
        if modes is not None:
            mine = modes[k] if isinstance(modes, list) and k < len(modes) else None
            if (
                not isinstance(mine, list)
                or not isinstance(stages, list)
                or len(mine) != len(stages)
            ):
                raise HeteroPlanError(
                    f"{source}: stats.recompute[{k}] must list one mode per stage of "
                    f"replicas[{k}], got {mine!r}"
                )
            stages = [
                {**st, "recompute": m} if isinstance(st, dict) else st
                for st, m in zip(stages, mine, strict=True)
            ]
        out.append({"stages": stages, "batch_fraction": size / sum(sizes)})
    return {"replicas": out}


def load_hetero_plan(path: str | Path, spec: ModelSpec, world_size: int) -> HeteroPlanFile:
    """`parse_hetero_plan` of the JSON file at `path` (errors name the file)."""
    path = Path(path)
    check_input_file(path, "--hetero-plan", HeteroPlanError)
    try:
        data = json_loads(path.read_text())
    except FileNotFoundError as err:
        raise HeteroPlanError(f"--hetero-plan {path} does not exist") from err
    except ValueError as err:
        raise HeteroPlanError(f"--hetero-plan {path} is not valid JSON: {err}") from err
    return parse_hetero_plan(data, spec, world_size, source=str(path))
