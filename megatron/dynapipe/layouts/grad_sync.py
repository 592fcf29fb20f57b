"""Asymmetric gradient synchronisation: one layer held with different TP shardings.

In a heterogeneous plan (seed `hexiscale.txt` §3.2, "Asymmetric gradient synchronization") the
pipelines hold the same layers with different tensor-parallel degrees, so a parameter's shard on
one rank may be half of another rank's shard. Megatron's DDP reduces equal buffers over one
data-parallel group and cannot do this. Here every TP-sharded parameter is cut along its
partition dim into lcm(TP degrees of its holders) chunks, the granularity of the smallest shard;
each chunk is held by exactly one rank of every holding stage and is summed over those ranks.
A parameter TP does not shard is held whole by every rank of every holding stage; one rank per
stage (its TP leader) contributes, every holder receives the sum. The word embeddings tied to
the output layer are one part held by first and last stages, so a pipeline's two copies and the
other pipelines' copies are all summed at once.

Which chunks exist and who holds them follows from the plan's layouts alone
(`HeteroTopology.chunk_holders`), so every rank created the same groups (`HeteroGroups.shared`)
and reduces them in the same order, the order the groups were created in: blocking collectives
over overlapping groups then cannot wait on each other in a cycle. How a shard maps onto the full
tensor is megatron-core's partitioning: the `tensor_model_parallel` and `partition_dim`
attributes its parallel layers set, TP rank r holding the r-th contiguous slice; a gated MLP's
first linear (SwiGLU) holds the r-th slice of each of its two halves.

Loss normalisation: every pipeline back-propagates the sum of its real tokens' losses (the
executor's per-token loss form), and `finalize` divides the summed gradients by the real tokens
of the whole global batch, counted once per pipeline (its last stage's TP leader). Each pipeline
is thereby weighted by its own token count, and the result is the gradient of the mean loss over
the global batch, however unevenly the batch was split over pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from ..layout_groups import EMBEDDING, FINAL_NORM, OUTPUT, POSITION, HeteroGroups, StagePlace


class GradSyncError(ValueError):
    """A parameter cannot be mapped onto the plan's layouts."""


@dataclass(frozen=True)
class _Slot:
    """One piece of a local parameter reduced in one group."""

    param: torch.nn.Parameter
    name: str
    dim: int
    start: int
    length: int
    contributes: bool  # its gradient enters the sum (one rank per holding stage)
    is_source: bool  # holds the canonical initial value (first holding stage)

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)


def model_part(name: str, layer_offset: int, tied_embeddings: bool) -> str | int:
    """The part of the model a stage-local GPTModel parameter belongs to: a global transformer
    layer index or one of EMBEDDING, POSITION, FINAL_NORM, OUTPUT."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        return layer_offset + int(parts[2])
    if parts[:2] == ["embedding", "word_embeddings"]:
        return EMBEDDING
    if parts[:2] == ["embedding", "position_embeddings"]:
        return POSITION
    if parts[:2] == ["decoder", "final_layernorm"]:
        return FINAL_NORM
    if parts[0] == "output_layer":
        return EMBEDDING if tied_embeddings else OUTPUT
    raise GradSyncError(f"parameter {name!r} belongs to no part of a GPT model this sync knows")


def logical_name(name: str, layer_offset: int, tied_embeddings: bool) -> str:
    """A stage-local parameter's name in the whole (unpipelined) model: global layer index, and
    a tied output layer named as the word embeddings it shares."""
    if tied_embeddings and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(layer_offset + int(parts[2]))
    return ".".join(parts)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    """Megatron DDP accumulates into `main_grad`; a bare module into `.grad`."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
    return grad


class AsymmetricGradSync:
    """Reduces the gradients of this rank's stage with every other holder of the same layers.

    `finalize` has the signature of megatron's `finalize_model_grads`, so it stands in
    `config.finalize_model_grads_func` and the executor calls it after the last backward.
    """

    def __init__(
        self, model: torch.nn.Module, groups: HeteroGroups, *, tied_embeddings: bool = True
    ) -> None:
        self.groups = groups
        topology = groups.topology
        self.place: StagePlace = topology.place(groups.rank)
        me = (self.place.replica, self.place.stage)
        self.gated_mlp = bool(
            getattr(getattr(unwrap(model), "config", None), "gated_linear_unit", False)
        )
        order = {ranks: k for k, ranks in enumerate(groups.shared)}
        buckets: dict[tuple[int, ...], list[_Slot]] = {}
        local_only: list[torch.nn.Parameter] = []
        for name, param in unwrap(model).named_parameters():
            part = model_part(name, self.place.layers[0], tied_embeddings)
            holders = topology.holders(part, tied_embeddings)
            if me not in holders:
                raise GradSyncError(
                    f"rank {groups.rank} (replica {me[0]} stage {me[1]}) has parameter {name!r} "
                    f"of part {part!r}, which the layouts do not place on its stage"
                )
            for ranks, slot in self._slots(name, param, part, holders, me):
                if len(ranks) == 1:
                    local_only.append(param)
                    continue
                if ranks not in order:
                    raise GradSyncError(f"no group was created for ranks {ranks} ({name})")
                buckets.setdefault(ranks, []).append(slot)
        self.buckets = sorted(buckets.items(), key=lambda item: order[item[0]])
        self.local_only = local_only
        self.params = [p for _, p in unwrap(model).named_parameters()]

    def _slots(self, name, param, part, holders, me):
        topology, place = self.groups.topology, self.place
        source = me == holders[0]
        if not getattr(param, "tensor_model_parallel", False):
            ranks = topology.replicated_holders(holders)
            leader = place.tp_rank == 0
            yield ranks, _Slot(param, name, 0, 0, param.shape[0], leader, source and leader)
            return
        dim = param.partition_dim
        chunk_ranks = topology.chunk_holders(holders)
        chunks = len(chunk_ranks)
        mine = chunks // place.tp  # chunks in this rank's shard
        # A gated MLP's first linear (SwiGLU) stores each shard as [gate_r; up_r]: each half
        # is chunked on its own, chunk c of either half being the same rows at any TP degree.
        halves = 2 if self.gated_mlp and ".mlp.linear_fc1." in name else 1
        half = param.shape[dim] // halves
        if half % mine:
            raise GradSyncError(
                f"{name} on rank {self.groups.rank}: its shard of {param.shape[dim]} along dim "
                f"{dim} does not split into the {mine} chunk(s) that TP degrees "
                f"{[topology.layouts[r].stages[s].tp for r, s in holders]} need"
            )
        length = half // mine
        for h in range(halves):
            for j in range(mine):
                c = place.tp_rank * mine + j
                start = h * half + j * length
                yield chunk_ranks[c], _Slot(param, name, dim, start, length, True, source)

    def finalize(self, model_chunks=None, num_tokens: torch.Tensor | None = None, **_) -> None:
        """Sum every gradient chunk over its holders and divide by the global batch's real
        tokens (`num_tokens`: this rank's count, nonzero on last stages only)."""
        counts = self.place.is_last and self.place.tp_rank == 0 and num_tokens is not None
        total = torch.zeros((), dtype=torch.float64, device=ps.device())
        if counts:
            total += num_tokens.detach().to(total.device, torch.float64)
        dist.all_reduce(total)
        if float(total) <= 0:
            raise GradSyncError("the global batch has no real tokens; nothing to normalise by")
        self._reduce(_grad, lambda slot: slot.contributes)
        scale = 1.0 / float(total)
        for param in self.params:
            _grad(param).mul_(scale)

    def broadcast_weights(self) -> None:
        """Make every holder's weights those of the first stage holding them (in replica,
        stage order): pipelines built with different TP degrees initialise differently, and a
        tied output layer starts as zeros on a last stage."""
        with torch.no_grad():
            self._reduce(lambda p: p.data, lambda slot: slot.is_source)

    def _reduce(self, tensor_of, keep) -> None:
        for ranks, slots in self.buckets:
            pieces = [slot.of(tensor_of(slot.param)) for slot in slots]
            flat = torch.cat(
                [
                    (piece if keep(slot) else torch.zeros_like(piece)).reshape(-1)
                    for slot, piece in zip(slots, pieces, strict=True)
                ]
            )
            dist.all_reduce(flat, group=self.groups.shared[ranks])
            offset = 0
            for piece in pieces:
                piece.copy_(flat[offset : offset + piece.numel()].view_as(piece))
                offset += piece.numel()
