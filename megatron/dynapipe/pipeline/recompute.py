"""Per-iteration activation recomputation: run each plan with the mode its planner chose.

Under dynamic micro-batching the memory peak differs from one iteration to the next, so
DynaPipe picks the recomputation scheme per iteration, the cheapest one that fits, by planning
under each mode's cost model (seed `dynapipe.txt` §7, "Dynamic recomputation"). The plan names
its choice in `stats["recompute"]`; `apply_recompute` switches a megatron-core model to it
before the plan runs. The planner's modes are megatron-core's: "selective" recomputes the core
attention in the backward pass, "full" keeps only each transformer layer's input and recomputes
the whole layer (uniform method, one layer per unit), "none" keeps every activation.

A stage runs the mode the plan names for it (`stage_mode`): the plan's one mode, its own entry
when the plan lists one mode per stage (a HexiScale plan's per-stage choice, `hetero.cost`
recompute="auto"), and in a merged heterogeneous plan its pipeline's (`stats["pipelines"]`).

megatron-core reads full recomputation from the `TransformerConfig` at every forward pass, but
decides selective recomputation once, when the attention modules are built
(`checkpoint_core_attention`); so both the config and those module flags are set.
"""

from __future__ import annotations

import torch

from dynapipe_planner.cost.analytic import RECOMPUTE_MODES


def stage_mode(stats: dict, replica: int, stage: int) -> str | None:
    """The recomputation mode of stage `stage` of pipeline `replica` under a plan with these
    `stats`; None when the plan names none (the model keeps its setting)."""
    mode = stats.get("recompute")
    if mode is None and "pipelines" in stats:
        mode = stats["pipelines"][replica].get("recompute")
    if isinstance(mode, list):
        if not 0 <= stage < len(mode):
            raise ValueError(f"the plan lists {len(mode)} recompute modes, none for stage {stage}")
        mode = mode[stage]
    return mode


def apply_recompute(model: torch.nn.Module, config, mode: str) -> None:
    """Make `model` (built from `config`) recompute activations as `mode` says from its next
    forward pass on."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    full = mode == "full"
    config.recompute_granularity = None if mode == "none" else mode
    config.recompute_method = "uniform" if full else None
    config.recompute_num_layers = 1 if full else None
    for module in model.modules():
        if hasattr(module, "checkpoint_core_attention"):
            module.checkpoint_core_attention = mode == "selective"
