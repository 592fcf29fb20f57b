"""SDP layers of a searched plan: ZeRO-3 per TransformerLayer beside replicated DP layers.

Galvatron-BMW (seed `galvatron_bmw.txt` §III-B) gives every layer its own data-parallel
paradigm: DP keeps the layer's parameters, gradients and optimiser states on every rank of the
data-parallel group and all-reduces its gradients; SDP (ZeRO-3) keeps 1/N of each on every rank,
gathers the parameters for the layer's forward and backward pass and reduce-scatters its
gradients. A plan mixes both inside one pipeline stage, with CKPT on either.

**Why torch FSDP2 and not megatron-core's FSDP.** megatron-core's FSDP (`--use-megatron-fsdp`,
`FullyShardedDataParallel`) wraps the whole model with one `data_parallel_sharding_strategy`
for every parameter (one bucketing policy per model; `fsdp_unit_modules` sets the units'
granularity, not their strategy), so it cannot shard one layer and replicate the next. It is
also CUDA-only: built over a stage on two CPU gloo ranks (megatron-core 0.19, with
`fsdp_unit_modules=[TransformerLayer]` and `device=cpu`), its constructor fails comparing the
device with `cuda:{torch.cuda.current_device()}`, and it creates CUDA streams after that.
torch's FSDP2 (`fully_shard`) shards per module and runs on gloo: each SDP TransformerLayer
becomes its own FSDP unit over the stage's data-parallel group, under one FSDP2 root (the
stage's decoder, whose other parameters FSDP2 ignores), everything else stays in Megatron's
DDP, which this module's `MixedDataParallel` is. FSDP2 is told to sum gradients
(divide factor 1, sum reductions), as Megatron's DDP does under a per-token loss, so
`finalize_model_grads` scales both kinds once by the global token count.

What the mix needs beyond the two wrappers, and where it is done:

- gradients: SDP layers reduce-scatter after every backward pass (their gradients stay sharded
  between micro-batches, as ZeRO-3's do); DDP's no-sync rule applies to the replicated part
  only. `MixedDataParallel.scale_gradients` and `zero_grad_buffer` cover both parts.
- the optimiser: Megatron's, over replicated tensors and the SDP layers' sharded DTensors (its
  torch Adam updates each rank's shard, so the SDP layers' optimiser states are sharded too).
- the gradient norm for clipping (`fit_optimizer_to_mix`): every rank adds the squares of
  its SDP shards, and the replicated gradients on data-parallel rank 0 only; the sum over all
  ranks counts each gradient element once. Megatron's own rule (the model-parallel group, or
  the DTensor's data-parallel group for every gradient once any is a DTensor) counts either the
  shards or the replicas wrongly in a mix. Its overflow check (fp16), run on the shards as
  local tensors, then reduces over all ranks too, so every rank skips the same steps.
- checkpoints: Megatron's checkpoint format does not hold FSDP2's sharded parameters, so a plan
  with SDP layers refuses --save/--load (`parallel_plan.apply_parallel_plan`).
"""

from __future__ import annotations

import types
from collections.abc import Collection

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from . import parallel_state as ps


def shard_layers(model: torch.nn.Module, layers: Collection[int]) -> list[int]:
    """Shard the parameters of this stage's TransformerLayers whose 0-based index over the
    whole model is in `layers` over the data-parallel group (FSDP2, one unit per layer,
    resharded after the forward pass); returns the indices sharded on this stage."""
    mesh = DeviceMesh.from_group(mpu.get_data_parallel_group(), ps.device().type)
    sharded = []
    for module in model.modules():
        if isinstance(module, TransformerLayer) and module.layer_number - 1 in layers:
            # FSDP2's sharded parameters are new objects; megatron-core reads its attributes
            # (tensor_model_parallel, partition_dim ...) from them to count TP shards once
            attributes = {name: dict(vars(p)) for name, p in module.named_parameters()}
            shard_unit(module, mesh)
            for name, p in module.named_parameters():
                for key, value in attributes[name].items():
                    setattr(p, key, value)
            sharded.append(module.layer_number - 1)
    if sharded:
        _share_one_root(model, mesh)
    return sorted(sharded)


def shard_unit(module: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Shard `module` as one FSDP2 unit of an SDP layer: resharded after the forward pass,
    gradients summed over the group (as Megatron's DDP under a per-token loss), not averaged.
    The cost profiler measures FSDP2 on units sharded by this same call."""
    fully_shard(module, mesh=mesh, reshard_after_forward=True)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def _share_one_root(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Make the stage's decoder the FSDP2 root of its SDP layers, its other parameters
    ignored (they stay in Megatron's DDP). Each layer alone would be its own root, and a root
    keeps its last reduce-scatter input (the layer's unsharded gradient) until its
    end-of-backward callback: every SDP layer's would be alive when a backward pass ends
    (traced: 7 layers' 3 MiB buffers at SDP4+CKPT's peak on 4 CPU ranks). Under one root they
    share one communication context, which keeps one such buffer at a time."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return
    ignored = {p for p in decoder.parameters() if not isinstance(p, DTensor)}
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)


def _sharded_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if isinstance(p, DTensor)]


class MixedDataParallel(DistributedDataParallel):
    """Megatron's DDP over the replicated parameters of a stage whose SDP layers FSDP2 shards
    (`shard_layers`, applied before): DDP leaves the sharded parameters to FSDP2, and scaling
    and zeroing gradients reach both kinds."""

    def __init__(self, config, ddp_config, module: torch.nn.Module) -> None:
        sharded = _sharded_params(module)
        for p in sharded:  # DDP buffers and hooks only what requires a gradient when built
            p.requires_grad_(False)
        try:
            super().__init__(config, ddp_config, module)
        finally:
            for p in sharded:
                p.requires_grad_(True)
        self.sharded_params = sharded

    def scale_gradients(self, scaling_factor: float) -> None:
        super().scale_gradients(scaling_factor)
        for p in self.sharded_params:
            if p.grad is not None:
                p.grad.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        super().zero_grad_buffer()
        for p in self.sharded_params:
            p.grad = None


def fit_optimizer_to_mix(optimizer) -> None:
    """Make a Megatron optimizer over a `MixedDataParallel` stage reduce its gradient
    statistics over all ranks: the norm counts each gradient element once (SDP shards on every
    rank, replicated gradients on data-parallel rank 0 only), and fp16's overflow check, run on
    the SDP shards as local tensors, skips a step on every rank or on none."""
    chained = getattr(optimizer, "chained_optimizers", None)
    for inner in chained if chained is not None else [optimizer]:
        inner.grad_stats_parallel_group = dist.group.WORLD
        inner.get_grads_for_grad_norm = types.MethodType(_grads_counted_once, inner)
        if hasattr(inner, "_collect_main_grad_data_for_unscaling"):
            inner._collect_main_grad_data_for_unscaling = types.MethodType(_local_grads, inner)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _grads_counted_once(self, grad_norm_group: str | None = None) -> list[torch.Tensor]:
    grads = type(self).get_grads_for_grad_norm(self, grad_norm_group)
    first = mpu.get_data_parallel_rank() == 0
    return [_local(g) for g in grads if first or isinstance(g, DTensor)]


def _local_grads(self) -> list[torch.Tensor]:
    """The gradients fp16 unscales in place, SDP shards as their local tensors (torch's
    unscale-and-check kernel takes no mix of tensors and DTensors)."""
    return [_local(g) for g in type(self)._collect_main_grad_data_for_unscaling(self) or []]


def state_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes this rank holds for the stage's parameters and optimiser states (sharded ones
    counted by their local shard)."""

    total = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    chained = getattr(optimizer, "chained_optimizers", None)
    for inner in chained if chained is not None else [optimizer]:
        for state in inner.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += _local(value).numel() * value.element_size()
    return total
