"""Per-iteration strategy switching over disaggregated optimiser states.

Hydraulis (seed `hydraulis.txt` §5.2, "Optimization-propagation disaggregation") keeps the fp32
master weights and the optimiser states in one fixed partition over all GPUs, whatever parallel
strategy the next iteration propagates with. Each iteration *pulls* the working weights of its
strategy's layout from their owners and *pushes* the gradients back, reduced, to the owners,
which then step the optimiser on their shards. Switching strategy between iterations therefore
moves no optimiser state and rebuilds nothing: the next pull simply fills another layout.

Here the fixed partition cuts every parameter of the whole model along one dim (its TP
partition dim, 0 for parameters TP does not shard) into one contiguous range per rank. A
strategy's layout (`groups.HeteroTopology`) puts TP shards of the same parameter on its
ranks, ranges along the same dim. The "mutual slices" of §5.2 (there at LCM granularity) are
the intersections of a TP shard's range with an owner's range; `link_pieces` lists them, the
same list on every rank since it follows from the layouts and the parameter catalogue alone.
Pull sends each piece from its owner to every rank holding it (a local copy when they are the
same rank); push sends each piece of gradient from one holder per stage (every TP shard, or the
TP leader for an unsharded parameter; both tied-embedding copies) to its owner, which sums the
pieces, the sync of `grad_sync` and the reduce-scatter of §5.2 in one step. All pieces between
two ranks travel as one message per direction, posted non-blocking on both sides before any
wait, so an exchange cannot deadlock. Pull/push run on their own process group, so their
messages never match the executor's stage-to-stage transfers between the same two ranks.

With `overlap=True` (`--overlap-pull-push`) pull/push hide behind propagation, as Hydraulis'
subgraph scheduling does (§5.3, Fig. 8, Table 1 "w/ Overlap") at the granularity this runtime
has, the stage: `pull` only posts the messages, and a rank waits for its working weights at its
stage's first forward, so later stages receive theirs while earlier stages already compute (the
pipeline fill); the owners' gradient receives are posted at the same time, and a rank sends its
gradients as soon as its own last backward is done, so the pushes of the stages and pipelines
that finish early travel while the slowest still computes. Without overlap every rank waits for
its weights before the iteration starts and for every pipeline before any gradient moves.

The owners divide the summed gradients by the global batch's real tokens (counted once per
pipeline, as `grad_sync` does), so every strategy computes the gradient of the same mean loss.

Not yet here: finer overlap than the stage (layer by layer inside the first forward and the
last backward); bf16 working weights from fp32 masters is only a cast in `pull`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from ..layout_groups import HeteroTopology
from .grad_sync import logical_name, model_part, unwrap


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the whole model: full shape, and the dim its TP shards (and the
    optimiser's owners) split; `sharded` says whether TP splits it at all."""

    shape: tuple[int, ...]
    dim: int
    sharded: bool
    gated: bool = False  # a gated MLP's first linear (SwiGLU): [gate; up] along `dim`


@dataclass(frozen=True)
class Piece:
    """A mutual slice: rows [lo, hi) along `info.dim` of parameter `name` (its whole-model
    layout), held by `holder` (whose local row r holds whole-model row r + `holder_lo`) and
    owned by `owner`."""

    name: str
    lo: int
    hi: int
    holder: int
    holder_lo: int
    owner: int
    contributes: bool  # its gradient enters the sum (one holder per stage)
    source: bool  # the first holding stage's copy: what `load_from` takes


def owner_ranges(length: int, world_size: int) -> list[tuple[int, int]]:
    """Rank k owns rows [k*L//N, (k+1)*L//N) of a parameter L rows long along its dim."""
    return [(k * length // world_size, (k + 1) * length // world_size) for k in range(world_size)]


def local_catalogue(
    model: torch.nn.Module, layer_offset: int, tp: int, tied_embeddings: bool
) -> dict[str, ParamInfo]:
    """What this rank's stage model says about the whole model's parameters."""
    found = {}
    gated_mlp = bool(getattr(getattr(unwrap(model), "config", None), "gated_linear_unit", False))
    for name, param in unwrap(model).named_parameters():
        sharded = bool(getattr(param, "tensor_model_parallel", False))
        dim = param.partition_dim if sharded else 0
        shape = list(param.shape)
        shape[dim] *= tp if sharded else 1
        gated = gated_mlp and sharded and ".mlp.linear_fc1." in name
        found[logical_name(name, layer_offset, tied_embeddings)] = ParamInfo(
            tuple(shape), dim, sharded, gated
        )
    return found


def shard_rows(info: ParamInfo, tp: int, tp_rank: int) -> list[tuple[int, int]]:
    """The rows [lo, hi) along `info.dim` of the whole-model tensor (its TP=1 layout) that TP
    shard `tp_rank` of `tp` holds, in the order its local tensor stores them. A TP shard is one
    contiguous slice, except for a gated MLP's first linear: megatron-core stores each shard as
    [gate_r; up_r], slices of both halves of the whole [gate; up]."""
    rows = info.shape[info.dim]
    if not info.sharded:
        return [(0, rows)]
    if not info.gated:
        step = rows // tp
        return [(tp_rank * step, (tp_rank + 1) * step)]
    half = rows // 2
    step = half // tp
    return [
        (tp_rank * step, (tp_rank + 1) * step),
        (half + tp_rank * step, half + (tp_rank + 1) * step),
    ]


def link_pieces(
    topology: HeteroTopology, catalogue: dict[str, ParamInfo], tied_embeddings: bool
) -> list[Piece]:
    """Every mutual slice of a strategy's layout with the fixed owner partition, in one order
    (catalogue, holding stage, TP rank, owner) that every rank computes alike."""
    pieces = []
    for name, info in catalogue.items():
        holders = topology.holders(model_part(name, 0, tied_embeddings), tied_embeddings)
        owners = owner_ranges(info.shape[info.dim], topology.world_size)
        for replica, stage in holders:
            first = (replica, stage) == holders[0]
            layout = topology.layouts[replica].stages[stage]
            for tp_rank, rank in enumerate(layout.devices):
                contributes = info.sharded or tp_rank == 0
                local_row = 0
                for lo, hi in shard_rows(info, layout.tp, tp_rank):
                    for owner, (a, b) in enumerate(owners):
                        start, end = max(lo, a), min(hi, b)
                        if start < end:
                            pieces.append(
                                Piece(
                                    name,
                                    start,
                                    end,
                                    rank,
                                    lo - local_row,
                                    owner,
                                    contributes,
                                    first and contributes,
                                )
                            )
                    local_row += hi - lo
    return pieces


class DisaggregatedOptimizer:
    """This rank's share of the fp32 master weights and Adam states, fixed for the whole job,
    and the pull/push links to every strategy's working weights.

    `topologies[k]` is strategy k's layout; `models` maps strategies to this rank's stage model
    of each (built while `use_strategy(k)` was in force). The models given at construction
    must hold the whole model between them over all ranks (one strategy's do); more can be
    `attach`ed later and `detach`ed to free them: the working weights are refilled by every pull,
    so a stage model is only a buffer. Construct it on every rank together: it gathers the
    parameter catalogue from all ranks.
    """

    def __init__(
        self,
        models: Mapping[int, torch.nn.Module],
        topologies: Sequence[HeteroTopology],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        tied_embeddings: bool = True,
        overlap: bool = False,
    ) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.topologies = list(topologies)
        self.tied = tied_embeddings
        self.overlap = overlap
        # Seconds of the current iteration this rank spent on pull and push (posting, local
        # copies and the waits it could not hide), and waiting in push for the slowest pipeline.
        self.times = {"pull": 0.0, "push": 0.0, "push_wait": 0.0}
        self._pulling: _Posted | None = None  # a posted pull not yet waited for
        self._receipts: _Posted | None = None  # gradient receives posted ahead of the push
        self._group = dist.new_group(list(range(self.world)))  # pull/push traffic only
        self.local_params: dict[int, dict[str, torch.nn.Parameter]] = {}
        self._hooks: dict[int, object] = {}
        local: dict[str, ParamInfo] = {}
        for k, model in models.items():
            place = self.topologies[k].place(self.rank)
            local.update(local_catalogue(model, place.layers[0], place.tp, self.tied))
        gathered: list[dict[str, ParamInfo]] = [{} for _ in range(self.world)]
        dist.all_gather_object(gathered, local)
        self.catalogue = self._merge(gathered)
        self.links = [link_pieces(t, self.catalogue, self.tied) for t in self.topologies]
        self.master: dict[str, torch.nn.Parameter] = {}
        for name, info in self.catalogue.items():
            a, b = owner_ranges(info.shape[info.dim], self.world)[self.rank]
            shape = list(info.shape)
            shape[info.dim] = b - a
            self.master[name] = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float32))
        # Decoupled weight decay, as Megatron's "adam" optimiser does (plain Adam when 0), and
        # as Megatron none on biases and other 1-D parameters (norms).
        decay, no_decay = [], []
        for name, master in self.master.items():
            if master.numel():
                flat = master.dim() == 1 or name.endswith(".bias")
                (no_decay if flat else decay).append(master)
        # wd_mult: Megatron's LR/weight-decay scheduler scales each group's decay by it.
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        for k, model in models.items():
            self.attach(k, model)

    def attach(self, strategy: int, model: torch.nn.Module) -> None:
        """Make `model` (this rank's stage of strategy `strategy`) the one its pulls fill and
        its pushes read; it must agree with the catalogue (same parameters, shapes, TP dims)."""
        place = self.topologies[strategy].place(self.rank)
        for name, info in local_catalogue(model, place.layers[0], place.tp, self.tied).items():
            if self.catalogue.get(name) != info:
                raise ValueError(
                    f"strategy {strategy}'s stage model on rank {self.rank} has parameter "
                    f"{name} as {info}, the job's catalogue as {self.catalogue.get(name)}"
                )
        self.detach(strategy)
        self.local_params[strategy] = {
            logical_name(n, place.layers[0], self.tied): p
            for n, p in unwrap(model).named_parameters()
        }
        if self.overlap:  # the stage waits for its working weights at its first forward
            self._hooks[strategy] = model.register_forward_pre_hook(lambda *_: self._finish_pull())

    def detach(self, strategy: int) -> None:
        """Forget strategy `strategy`'s stage model (no-op when none is attached)."""
        self._finish_pull()
        self.local_params.pop(strategy, None)
        hook = self._hooks.pop(strategy, None)
        if hook is not None:
            hook.remove()

    def _params(self, strategy: int) -> dict[str, torch.nn.Parameter]:
        try:
            return self.local_params[strategy]
        except KeyError:
            raise KeyError(
                f"strategy {strategy} has no stage model attached on rank {self.rank}"
            ) from None

    @staticmethod
    def _merge(gathered: list[dict[str, ParamInfo]]) -> dict[str, ParamInfo]:
        catalogue: dict[str, ParamInfo] = {}
        for rank, found in enumerate(gathered):
            for name, info in found.items():
                if catalogue.setdefault(name, info) != info:
                    raise ValueError(
                        f"parameter {name}: rank {rank} sees {info}, another rank "
                        f"{catalogue[name]}; the strategies disagree about the model"
                    )
        return dict(sorted(catalogue.items()))

    # ---- the fixed partition ------------------------------------------------------------

    def load_full(self, weights: dict[str, torch.Tensor]) -> None:
        """Set the master weights from full tensors by whole-model name (a checkpoint or a
        reference); each rank keeps its own rows."""
        with torch.no_grad():
            for name, info in self.catalogue.items():
                a, b = owner_ranges(info.shape[info.dim], self.world)[self.rank]
                full = torch.as_tensor(weights[name], dtype=torch.float32)
                if tuple(full.shape) != tuple(info.shape):
                    raise ValueError(
                        f"parameter {name}: given shape {tuple(full.shape)}, this job's model "
                        f"has {tuple(info.shape)} (another vocabulary padding or model size?)"
                    )
                self.master[name].copy_(full.narrow(info.dim, a, b - a))

    def load_from(self, strategy: int) -> None:
        """Set the master weights from strategy `strategy`'s models (the first stage holding
        each parameter): how a job starts from freshly initialised layers."""
        self._finish_pull()
        sources = [p for p in self.links[strategy] if p.source]
        params = self._params(strategy)
        self._start(
            sources,
            send=lambda p: self._holder_slice(params[p.name], p),
            recv=lambda p, t: self._owner_slice(p).copy_(t),
            sender=lambda p: p.holder,
        ).wait()

    def full_state_dict(self, dst: int = 0) -> dict[str, dict[str, torch.Tensor]] | None:
        """Every parameter's full fp32 master weight and AdamW states, gathered on rank `dst`
        (None elsewhere; a collective): what a checkpoint independent of any propagation
        strategy, and of this job's rank count, holds. `step` is 0 before the first step."""
        local = {}
        for name, master in self.master.items():
            state = self.optimizer.state.get(master, {})
            zeros = torch.zeros_like(master.data)
            local[name] = {
                "param": master.data.clone(),
                "exp_avg": state.get("exp_avg", zeros).clone(),
                "exp_avg_sq": state.get("exp_avg_sq", zeros).clone(),
                "step": float(state.get("step", 0.0)),
            }
        gathered = [None] * self.world if self.rank == dst else None
        dist.gather_object(local, gathered, dst=dst)
        if gathered is None:
            return None
        full = {}
        for name, info in self.catalogue.items():
            shards = [g[name] for g in gathered]
            full[name] = {
                key: torch.cat([s[key] for s in shards], dim=info.dim)
                for key in ("param", "exp_avg", "exp_avg_sq")
            }
            full[name]["step"] = torch.tensor(max(s["step"] for s in shards))
        return full

    def load_full_state_dict(self, full: dict[str, dict[str, torch.Tensor]]) -> list[str]:
        """Take this rank's rows of `full_state_dict`'s output (saved by any job layout).
        The vocabulary's padding rows follow this job's padding (`fit_vocab_rows`); returns
        a line for each parameter whose padding changed."""
        missing = sorted(set(self.catalogue) - set(full))
        if missing:
            raise KeyError(f"the saved optimiser state lacks parameter(s) {missing[:5]}")
        notes = fit_vocab_rows(full, {n: i.shape for n, i in self.catalogue.items()})
        self.load_full({name: entry["param"] for name, entry in full.items()})
        for name, info in self.catalogue.items():
            master = self.master[name]
            step = float(full[name]["step"])
            if not master.numel() or step == 0:
                continue
            a, b = owner_ranges(info.shape[info.dim], self.world)[self.rank]
            self.optimizer.state[master] = {
                "step": torch.tensor(step),
                "exp_avg": full[name]["exp_avg"].narrow(info.dim, a, b - a).clone().float(),
                "exp_avg_sq": full[name]["exp_avg_sq"].narrow(info.dim, a, b - a).clone().float(),
            }
        return notes

    # ---- pull, push, step -------------------------------------------------------------

    def pull(self, strategy: int) -> None:
        """Fill strategy `strategy`'s working weights on every rank from the owners; with
        overlap, post the messages (and the owners' gradient receives of the coming push) and
        return: the stage's first forward, or at the latest the push, waits for them."""
        self._finish_pull()
        started = time.perf_counter()
        params = self._params(strategy)
        posted = self._start(
            self.links[strategy],
            send=lambda p: self._owner_slice(p),
            recv=lambda p, t: self._holder_slice(params[p.name], p).copy_(t),
            sender=lambda p: p.owner,
        )
        self.times = {"pull": time.perf_counter() - started, "push": 0.0, "push_wait": 0.0}
        self._pulling = posted
        if self.overlap:
            self._receipts = self._post_receives(
                self._routes(self._contributions(strategy), sender=lambda p: p.holder)[2],
                recv=lambda p, t: self._owner_slice(p, grad=True).add_(t),
            )
        else:
            self._finish_pull()

    def push(self, strategy: int, num_tokens: torch.Tensor | None) -> None:
        """Send strategy `strategy`'s gradients to their owners, summed over holders and
        divided by the global batch's real tokens (`num_tokens`: this rank's count, from the
        last stages' TP leaders)."""
        self._finish_pull()  # a stage that ran no forward this iteration
        started = time.perf_counter()
        for master in self.master.values():
            master.grad = torch.zeros_like(master)
        params = self._params(strategy)
        send = lambda p: self._holder_slice(_grad(params[p.name]), p)  # noqa: E731
        recv = lambda p, t: self._owner_slice(p, grad=True).add_(t)  # noqa: E731
        pieces = self._contributions(strategy)
        receipts, self._receipts = self._receipts, None
        if receipts is None:  # no overlap: every pipeline done before any gradient moves
            total = self._global_tokens(strategy, num_tokens)
            self._start(pieces, send=send, recv=recv, sender=lambda p: p.holder).wait()
        else:  # receives were posted at the pull: send now, while slower stages still compute
            local, outgoing, _ = self._routes(pieces, sender=lambda p: p.holder)
            for piece in local:
                recv(piece, send(piece))
            sends = self._post_sends(outgoing, send)
            total = self._global_tokens(strategy, num_tokens)
            receipts.wait()
            sends.wait()
        for master in self.master.values():
            master.grad.div_(total)
        self.times["push"] = time.perf_counter() - started - self.times["push_wait"]

    def _contributions(self, strategy: int) -> list[Piece]:
        return [p for p in self.links[strategy] if p.contributes]

    def _global_tokens(self, strategy: int, num_tokens: torch.Tensor | None) -> float:
        """The global batch's real tokens (a collective: also where every rank waits for the
        slowest pipeline, timed as `times["push_wait"]`)."""
        place = self.topologies[strategy].place(self.rank)
        total = torch.zeros((), dtype=torch.float64, device=ps.device())
        if place.is_last and place.tp_rank == 0 and num_tokens is not None:
            total += num_tokens.detach().to(total.device, torch.float64)
        started = time.perf_counter()
        dist.all_reduce(total)
        self.times["push_wait"] = time.perf_counter() - started
        if float(total) <= 0:
            raise ValueError("the global batch has no real tokens; nothing to normalise by")
        return float(total)

    def _finish_pull(self) -> None:
        """Wait for a posted pull (no-op when none is in flight); counted as pull time."""
        posted, self._pulling = self._pulling, None
        if posted is not None:
            started = time.perf_counter()
            posted.wait()
            self.times["pull"] += time.perf_counter() - started

    def step(self) -> None:
        """One Adam step of the owned shards."""
        self.optimizer.step()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the pushed gradients so their global L2 norm is at most `max_norm`; returns
        the norm before clipping. Every gradient element has exactly one owner after the push,
        so the owners' sums of squares add up to the whole model's (a collective)."""
        squares = torch.zeros((), dtype=torch.float64, device=ps.device())
        for master in self.master.values():
            if master.grad is not None:
                squares += master.grad.double().pow(2).sum().to(squares.device)
        dist.all_reduce(squares)
        norm = float(squares.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for master in self.master.values():
                if master.grad is not None:
                    master.grad.mul_(scale)
        return norm

    def finalize_func(self, strategy: int) -> Callable[..., None]:
        """A `finalize_model_grads_func` for strategy `strategy`'s executor: the push."""

        def finalize(model_chunks=None, num_tokens: torch.Tensor | None = None, **_) -> None:
            self.push(strategy, num_tokens)

        return finalize

    # ---- plumbing ---------------------------------------------------------------------

    def _owner_slice(self, piece: Piece, grad: bool = False) -> torch.Tensor:
        info = self.catalogue[piece.name]
        a, _ = owner_ranges(info.shape[info.dim], self.world)[self.rank]
        tensor = self.master[piece.name].grad if grad else self.master[piece.name].data
        return tensor.narrow(info.dim, piece.lo - a, piece.hi - piece.lo)

    def _holder_slice(self, tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
        dim = self.catalogue[piece.name].dim
        return tensor.narrow(dim, piece.lo - piece.holder_lo, piece.hi - piece.lo)

    def _routes(
        self, pieces: list[Piece], sender: Callable[[Piece], int]
    ) -> tuple[list[Piece], dict[int, list[Piece]], dict[int, list[Piece]]]:
        """Split the pieces moving from `sender(piece)` to the other end (holder or owner)
        into this rank's local ones, what it sends (by destination) and receives (by source)."""
        local: list[Piece] = []
        outgoing: dict[int, list[Piece]] = {}
        incoming: dict[int, list[Piece]] = {}
        for piece in pieces:
            src = sender(piece)
            dst = piece.owner if src == piece.holder else piece.holder
            if src == self.rank and dst == self.rank:
                local.append(piece)
            elif src == self.rank:
                outgoing.setdefault(dst, []).append(piece)
            elif dst == self.rank:
                incoming.setdefault(src, []).append(piece)
        return local, outgoing, incoming

    def _start(
        self,
        pieces: list[Piece],
        *,
        send: Callable[[Piece], torch.Tensor],
        recv: Callable[[Piece, torch.Tensor], object],
        sender: Callable[[Piece], int],
    ) -> _Posted:
        """Copy this rank's local pieces and post every message of the exchange: one per pair
        of ranks and direction, receives before sends; `wait()` completes it."""
        local, outgoing, incoming = self._routes(pieces, sender)
        with torch.no_grad():
            for piece in local:
                recv(piece, send(piece).clone())
        receives = self._post_receives(incoming, recv)
        sends = self._post_sends(outgoing, send)
        return _Posted(sends.requests + receives.requests, receives.unpack)

    def _post_receives(
        self, incoming: dict[int, list[Piece]], recv: Callable[[Piece, torch.Tensor], object]
    ) -> _Posted:
        buffers, requests = {}, []
        for src, group in sorted(incoming.items()):
            buffers[src] = torch.empty(sum(self._numel(p) for p in group), dtype=torch.float32)
            requests.append(dist.irecv(buffers[src], src, group=self._group))

        def unpack() -> None:
            for src, group in incoming.items():
                offset = 0
                for piece in group:
                    n = self._numel(piece)
                    recv(piece, buffers[src][offset : offset + n].view(self._piece_shape(piece)))
                    offset += n

        return _Posted(requests, unpack)

    def _post_sends(
        self, outgoing: dict[int, list[Piece]], send: Callable[[Piece], torch.Tensor]
    ) -> _Posted:
        requests = []
        for dst, group in sorted(outgoing.items()):
            flat = torch.cat([send(p).detach().float().reshape(-1) for p in group])
            requests.append(dist.isend(flat, dst, group=self._group))
        return _Posted(requests)

    def _piece_shape(self, piece: Piece) -> tuple[int, ...]:
        info = self.catalogue[piece.name]
        shape = list(info.shape)
        shape[info.dim] = piece.hi - piece.lo
        return tuple(shape)

    def _numel(self, piece: Piece) -> int:
        n = 1
        for size in self._piece_shape(piece):
            n *= size
        return n


# Parameters whose first dim is the (padded) vocabulary: Megatron pads it for the job's TP
# degrees, so jobs of other layouts hold other numbers of padding rows.
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def fit_vocab_rows(
    full: dict[str, dict[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]
) -> list[str]:
    """Give the vocabulary parameters of a saved full state (weights and Adam moments) the
    padding rows of `shapes`: extra padding rows dropped, missing ones added as zeros (no
    token uses a padding row; their logits only join the softmax, so the first losses after
    such a resume differ slightly from an uninterrupted run). Returns a line per change."""
    notes = []
    for name in VOCAB_PARAMS:
        if name not in full or name not in shapes:
            continue
        saved, want = tuple(full[name]["param"].shape), tuple(shapes[name])
        if saved == want or saved[1:] != want[1:]:
            continue  # same, or not a padding difference (load_full names the mismatch)
        rows = min(saved[0], want[0])
        for key in ("param", "exp_avg", "exp_avg_sq"):
            fitted = torch.zeros(want, dtype=full[name][key].dtype)
            fitted[:rows] = full[name][key][:rows]
            full[name][key] = fitted
        notes.append(
            f"{name}: the checkpoint pads the vocabulary to {saved[0]} rows, this job to "
            f"{want[0]}; padding rows {'dropped' if saved[0] > want[0] else 'added as zeros'}"
        )
    return notes


class _Posted:
    """The messages of one exchange in flight; `wait` completes them and then unpacks what
    arrived (without autograd: the receivers are parameters and their gradients)."""

    def __init__(self, requests: list, unpack: Callable[[], None] | None = None) -> None:
        self.requests, self.unpack = requests, unpack

    def wait(self) -> None:
        for request in self.requests:
            request.wait()
        if self.unpack is not None:
            with torch.no_grad():
                self.unpack()


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
    return grad
