"""The `--hetero-plan` file checked against this job's ranks.

HexiScale (seed `hexiscale.txt` §3.2) fixes, before training, the pipelines of a mixed
cluster; the file's forms, their reader and the checks against the model are the planner's
(`dynapipe_planner.hetero.plan_file.parse_hetero_layout`). What only the runtime can check is
whether the layouts fit the job: device ids are global ranks, every rank runs exactly one stage,
and a pipeline's stages run on increasing ranks (megatron-core numbers stages by rank order, so
a plan that puts a later stage on a lower rank is refused with the replica and stage named;
`dynapipe-hetero --bind-ranks` writes such a plan renumbered so that it runs). That is
`groups.HeteroTopology`'s bookkeeping, checked here before any process group exists, so a wrong
file fails on every rank with the same message.
"""

from __future__ import annotations

from pathlib import Path

from dynapipe_planner.hetero.plan_file import HeteroPlanError, HeteroPlanFile, parse_hetero_layout
from dynapipe_planner.input_files import load_json_file
from dynapipe_planner.model_spec import ModelSpec

from ..layout_groups import HeteroTopology, LayoutMismatch


def parse_hetero_plan(
    data: object, spec: ModelSpec, world_size: int, *, source: str = "hetero plan"
) -> HeteroPlanFile:
    """`parse_hetero_layout` of a parsed `--hetero-plan` document, whose layouts must also use
    each of the job's `world_size` ranks in exactly one stage, in rank order along each
    pipeline (`HeteroTopology`)."""
    found = parse_hetero_layout(data, spec, source)
    try:
        HeteroTopology.from_layouts(found.layouts, world_size)
    except LayoutMismatch as err:
        raise HeteroPlanError(f"{source}: {err}") from err
    return found


def load_hetero_plan(path: str | Path, spec: ModelSpec, world_size: int) -> HeteroPlanFile:
    """`parse_hetero_plan` of the JSON file at `path` (errors name the flag and the file)."""
    data = load_json_file(path, "--hetero-plan", HeteroPlanError)
    return parse_hetero_plan(data, spec, world_size, source=str(path))
