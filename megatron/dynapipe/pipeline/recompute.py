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

A searched plan (`pretrain_gpt.py --parallel-plan`) instead names the layers to checkpoint,
any set of them (Galvatron-BMW's CKPT per layer, seed `galvatron_bmw.txt` §III-B, chosen by
the layer DP of §IV-A). megatron-core's own per-layer controls cannot say an arbitrary set:
`recompute_method="block"` takes the first N layers of every stage, "uniform" chunks of N
layers, all stages alike. So `checkpoint_layers` wraps exactly the named TransformerLayers'
forward in megatron-core's checkpoint (`tensor_parallel.checkpoint`, the function its full
recomputation runs each chunk through: it restores the CPU, CUDA and tensor-parallel RNG
states, so dropout recomputes the same mask) and leaves the config at no recomputation.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer

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


def checkpoint_layers(model: torch.nn.Module, layers: Collection[int]) -> list[int]:
    """Recompute the activations of this stage's TransformerLayers whose 0-based index over
    the whole model (megatron-core's `layer_number - 1`, offset by the pipeline layout) is in
    `layers`: each keeps only its input in the forward pass and runs again in the backward
    pass. Returns the indices wrapped on this stage."""
    wrapped = []
    for module in model.modules():
        if isinstance(module, TransformerLayer) and module.layer_number - 1 in layers:
            module.forward = _checkpointed(module)
            wrapped.append(module.layer_number - 1)
    return sorted(wrapped)


def _checkpointed(layer: TransformerLayer):
    """`layer.forward` run through megatron-core's checkpoint while training.

    megatron-core's block calls its layers by keyword; the checkpoint saves only tensors, so
    tensor arguments pass through it and the others (packed-sequence parameters, None) are
    bound around it, as megatron-core's own checkpointed forward does."""
    forward = layer.forward

    def checkpointed_forward(**kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not (layer.training and torch.is_grad_enabled()):
            return forward(**kwargs)
        names = [name for name, value in kwargs.items() if torch.is_tensor(value)]
        others = {name: value for name, value in kwargs.items() if name not in names}

        def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return forward(**others, **dict(zip(names, tensors, strict=True)))

        distribute = layer.config.distribute_saved_activations
        return tensor_parallel.checkpoint(run, distribute, *(kwargs[n] for n in names))

    return checkpointed_forward
