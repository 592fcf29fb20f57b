"""Point-to-point transfers exactly as a plan posts them: non-blocking start, blocking wait.

DynaPipe's executor (seed `dynapipe.txt` §3, §6) posts each transfer at the position the
communication plan chose and carries its shape in the instruction, so nothing is exchanged at
run time (megatron-core's `variable_seq_lengths` path sends a shape tensor before every
transfer instead). Plans describe boundary tensors as [micro-batch, sequence, hidden]; megatron-core
keeps activations as [sequence, micro-batch, hidden], so buffers take that layout.

Each Start maps to one `isend`/`irecv`. Both torch backends match point-to-point operations
between two ranks first-in-first-out, and the plan posts them in the same order on both sides,
which is what makes it deadlock-free.

Between stages of different tensor-parallel degree (a heterogeneous plan; seed `hexiscale.txt`
§3.2) `LeaderPeerToPeer` keeps those semantics on the stages' leaders: only the sending stage's
leader sends (without sequence parallelism every TP rank holds the same boundary tensor), only
the receiving stage's leader receives, and at the Wait the leader broadcasts the tensor inside
its TP group. Every TP rank of a stage runs the same instruction list, so the broadcasts are
posted in one order in each group, and the leaders' point-to-point order is the plan's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..data.microbatches import row_length

PLAN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TransferError(RuntimeError):
    """A transfer's tensor disagrees with its instruction, or its peer never completed it."""


def megatron_shape(plan_shape: Sequence[int]) -> tuple[int, ...]:
    """[b, s, h] of a plan instruction as megatron-core's [s, b, h]."""
    if len(plan_shape) != 3:
        raise TransferError(f"boundary shape {list(plan_shape)} is not [batch, sequence, hidden]")
    b, s, h = plan_shape
    return (s, b, h)


def packed_shape(plan_shape: Sequence[int], sequence_shards: int = 1) -> list[int]:
    """The boundary [b, s, h] of a packed micro-batch as it travels: its rows laid end to end as
    one THD sequence (`data.microbatches`), [1, b * s, h]. Under sequence parallelism over
    `sequence_shards` TP ranks each rank sends and receives its own part of that sequence, as
    megatron-core's schedules do: [1, b * s' / shards, h], each row padded to s', a multiple of
    the shards (`data.microbatches.row_length`)."""
    if len(plan_shape) != 3:
        raise TransferError(f"boundary shape {list(plan_shape)} is not [batch, sequence, hidden]")
    b, s, h = plan_shape
    return [1, b * row_length(s, sequence_shards) // sequence_shards, h]


@dataclass
class Transfer:
    """One posted transfer: the tensor sent or being filled, and its pending request."""

    tensor: torch.Tensor
    request: dist.Work | None  # None: nothing posted here (a TP rank that is not the leader)
    peer_rank: int
    what: str
    broadcast: bool = False  # at the Wait, the leader broadcasts the tensor to its TP group


class PeerToPeer:
    """Posts a rank's transfers to the ranks of its pipeline neighbours.

    `peer_rank(stage)` names the global rank of a stage in this rank's pipeline (same replica,
    same tensor-parallel shard); `timeout_s` bounds every Wait, so a dead peer surfaces as an
    error naming it instead of a hang.
    """

    def __init__(
        self, peer_rank: Callable[[int], int], device: torch.device, timeout_s: float = 600.0
    ) -> None:
        self.peer_rank = peer_rank
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)

    def start_send(
        self, tensor: torch.Tensor, peer_stage: int, shape: Sequence[int], dtype: str, what: str
    ) -> Transfer:
        self._check(tensor, shape, dtype, what)
        tensor = tensor.detach().contiguous()
        rank = self.peer_rank(peer_stage)
        return Transfer(tensor, dist.isend(tensor, rank), rank, what)

    @staticmethod
    def _check(tensor: torch.Tensor, shape: Sequence[int], dtype: str, what: str) -> None:
        expected = megatron_shape(shape)
        if tuple(tensor.shape) != expected or tensor.dtype != PLAN_DTYPES[dtype]:
            raise TransferError(
                f"{what}: the plan sends {list(expected)} {dtype} (as [s, b, h]) but the tensor "
                f"is {list(tensor.shape)} {tensor.dtype}"
            )

    def start_recv(self, peer_stage: int, shape: Sequence[int], dtype: str, what: str) -> Transfer:
        buffer = torch.empty(megatron_shape(shape), dtype=PLAN_DTYPES[dtype], device=self.device)
        rank = self.peer_rank(peer_stage)
        return Transfer(buffer, dist.irecv(buffer, rank), rank, what)

    def wait(self, transfer: Transfer) -> torch.Tensor:
        """Block until the transfer completes; return its tensor."""
        if transfer.request is None:
            return transfer.tensor
        try:
            transfer.request.wait(self.timeout)
        except RuntimeError as err:
            raise TransferError(
                f"{transfer.what}: rank {transfer.peer_rank} did not complete the transfer within "
                f"{self.timeout.total_seconds():g} s, or it failed: {err}"
            ) from err
        return transfer.tensor


class LeaderPeerToPeer(PeerToPeer):
    """Boundary transfers between stages whose TP groups differ in size: leader to leader, then
    a broadcast inside the receiving TP group (HexiScale §3.2), for activations and, in the
    reverse direction, for their gradients.

    `peer_rank(stage)` names the leader of a stage of this rank's pipeline; `tp_group` and
    `leader` are this rank's stage's TP group and the global rank of its leader.
    """

    def __init__(
        self,
        peer_rank: Callable[[int], int],
        device: torch.device,
        timeout_s: float = 600.0,
        *,
        tp_group: dist.ProcessGroup,
        leader: int,
    ) -> None:
        super().__init__(peer_rank, device, timeout_s)
        self.tp_group, self.leader = tp_group, leader
        self.is_leader = dist.get_rank() == leader
        self.tp_size = dist.get_world_size(tp_group)

    def start_send(
        self, tensor: torch.Tensor, peer_stage: int, shape: Sequence[int], dtype: str, what: str
    ) -> Transfer:
        if self.is_leader:
            return super().start_send(tensor, peer_stage, shape, dtype, what)
        super()._check(tensor, shape, dtype, what)  # every TP rank holds the same tensor
        return Transfer(tensor, None, self.peer_rank(peer_stage), what)

    def start_recv(self, peer_stage: int, shape: Sequence[int], dtype: str, what: str) -> Transfer:
        if self.is_leader:
            transfer = super().start_recv(peer_stage, shape, dtype, what)
        else:
            buffer = torch.empty(
                megatron_shape(shape), dtype=PLAN_DTYPES[dtype], device=self.device
            )
            transfer = Transfer(buffer, None, self.peer_rank(peer_stage), what)
        transfer.broadcast = self.tp_size > 1
        return transfer

    def wait(self, transfer: Transfer) -> torch.Tensor:
        tensor = super().wait(transfer)
        if transfer.broadcast:
            try:
                dist.broadcast(tensor, src=self.leader, group=self.tp_group)
            except RuntimeError as err:
                raise TransferError(
                    f"{transfer.what}: the broadcast from TP leader rank {self.leader} failed: "
                    f"{err}"
                ) from err
        return tensor
