"""Event-driven execution of an `ExecutionPlan`: timeline, bubbles, peak memory and plan checks.

Every rank runs its instruction list in order, as DynaPipe's executor does (seed `dynapipe.txt`
§3): a compute op occupies the rank for the cost model's time, and each communication is a
non-blocking Start plus a blocking Wait. Transfers follow NCCL: one first-in-first-out channel per
pair of neighbouring ranks, on which the k-th operation each side posts must be the same transfer.
That rule is why the naive "send when produced, receive when needed" order deadlocks in dynamic
pipelines (§2.3, Fig. 8b), and why communication planning posts both sides of a transfer when
the tensor is produced (§6). The simulator verifies a plan against these rules; its timeline is
what the planner predicts an iteration to cost.

Nothing steps through time. A rank runs until it blocks on a Wait whose transfer is not matched
yet, and the peer's post that completes the match wakes it. A transfer's times depend only on
its two post times and its channel's previous transfer, so the order in which ranks are advanced
does not change the result, and each instruction is visited once.

Replicas never talk to each other within an iteration, so each one runs against its own cost
tables: a heterogeneous plan (pipelines of different depth or TP, `hydraulis.txt` §5.1) gives
one `PipelineCosts` per replica, and each replica's own depth decides its first and last stage.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cost.table import PipelineCosts
from .errors import CommMismatchError, DeadlockError, PlanCheckError, PlanningError
from .plan import (
    START_OPS,
    WAIT_FOR_START,
    WAIT_OPS,
    ExecutionPlan,
    Instruction,
    RankPlan,
    validate_structure,
)

Rank = tuple[int, int]  # (replica, stage)

START_FOR_WAIT = {wait: start for start, wait in WAIT_FOR_START.items()}
PARTNER = {
    "SendActStart": "RecvActStart",
    "RecvActStart": "SendActStart",
    "SendGradStart": "RecvGradStart",
    "RecvGradStart": "SendGradStart",
}
_STARTS = frozenset(START_OPS)
_WAITS = frozenset(WAIT_OPS)


@dataclass(frozen=True, slots=True)
class Event:
    """One span of the timeline. `kind` is "F" or "B" for compute on `rank`, or "act" or "grad"
    for a transfer, whose `rank` is the sender and `peer` the receiving stage."""

    rank: Rank
    kind: str
    mb: int
    start: float
    end: float
    peer: int = -1


@dataclass
class SimulationResult:
    """What one iteration of a plan costs: seconds per rank, peak bytes per rank, and the
    timeline (events sorted by start time)."""

    makespan: float
    busy: dict[Rank, float]
    peak_memory: dict[Rank, float]
    compute_events: list[Event]
    transfer_events: list[Event]

    @property
    def ranks(self) -> list[Rank]:
        return sorted(self.busy)

    @property
    def idle(self) -> dict[Rank, float]:
        return {rank: self.makespan - busy for rank, busy in self.busy.items()}

    @property
    def bubble_fraction(self) -> float:
        """Share of all ranks' time spent not computing: 1 - total busy / (ranks x makespan)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)

    def summary(self) -> dict[str, Any]:
        """Plain JSON-ready numbers, for CLIs and a plan's `stats`."""
        idle = self.idle
        return {
            "makespan_s": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "num_compute_events": len(self.compute_events),
            "num_transfers": len(self.transfer_events),
            "max_peak_memory_bytes": max(self.peak_memory.values(), default=0.0),
            "ranks": [
                {
                    "replica": rank[0],
                    "stage": rank[1],
                    "busy_s": self.busy[rank],
                    "idle_s": idle[rank],
                    "peak_memory_bytes": self.peak_memory[rank],
                }
                for rank in self.ranks
            ],
        }


def simulate(
    plan: ExecutionPlan,
    costs: PipelineCosts | Sequence[PipelineCosts],
    *,
    check_memory: bool = True,
) -> SimulationResult:
    """Run every rank's instructions against `costs` and return the timeline.

    `costs` is one table set for every replica, or a sequence with one per replica (each with
    that replica's number of stages), as a heterogeneous plan needs.
    Raises a `PlanningError` subclass naming the rank, instruction and micro-batch at the first
    broken invariant of the plan contract: `PlanCheckError` (order rules, unwaited Starts, and
    with `check_memory` a rank above `costs.memory_limit`), `CommMismatchError` (two sides of a
    channel disagree), `DeadlockError` (ranks left waiting for posts that never come)."""
    _check_programs(plan)
    return _Executor(plan, _costs_per_replica(plan, costs), check_memory).run()


def verify_plan(plan: ExecutionPlan) -> None:
    """Check the plan contract with no cost model: what a runtime runs before executing a plan.

    Order rules, Start/Wait pairing, matching transfers on every channel and freedom from
    deadlock do not depend on timing (channels are first-in-first-out and Waits block), so
    the same event-driven execution with zero-length operations decides them. Raises the same
    errors as `simulate`."""
    _check_programs(plan)
    _Executor(plan, None, check_memory=False).run()


def _costs_per_replica(
    plan: ExecutionPlan, costs: PipelineCosts | Sequence[PipelineCosts]
) -> list[PipelineCosts]:
    """One table set per replica, each as deep as its replica's pipeline."""
    per_replica = [costs] * plan.num_replicas if isinstance(costs, PipelineCosts) else list(costs)
    if len(per_replica) != plan.num_replicas:
        raise PlanningError(
            f"{len(per_replica)} cost table sets for a plan of {plan.num_replicas} replicas"
        )
    for replica, tables in enumerate(per_replica):
        depth = plan.replica_num_stages(replica)
        if tables.num_stages != depth:
            raise PlanningError(
                f"replica {replica} has {depth} stage(s) but its cost tables have "
                f"{tables.num_stages}"
            )
    return per_replica


def _check_programs(plan: ExecutionPlan) -> None:
    validate_structure(plan)
    mbs_of_replica: dict[int, set[int]] = {}
    for m in plan.microbatches:
        mbs_of_replica.setdefault(m.replica, set()).add(m.id)
    for rp in plan.ranks:
        depth = plan.replica_num_stages(rp.replica)
        _check_program(rp, depth, mbs_of_replica.get(rp.replica, set()))


# ---- static checks ----------------------------------------------------------------------------


def _rank_name(rp: RankPlan) -> str:
    return f"rank (replica {rp.replica}, stage {rp.stage})"


def _at(rp: RankPlan, index: int) -> str:
    ins = rp.instructions[index]
    return f"{_rank_name(rp)} instruction {index} ({ins.op} mb {ins.mb})"


def _check_program(rp: RankPlan, num_stages: int, mb_ids: set[int]) -> None:
    """Order rules one rank's list must obey whatever the timing: each pass once, data received
    before it is used, produced before it is sent, and every Start paired with a later Wait."""
    first, last = rp.stage == 0, rp.stage == num_stages - 1
    seen: set[tuple[str, int]] = set()
    open_starts: dict[tuple[str, int], int] = {}
    for i, ins in enumerate(rp.instructions):
        problem = _order_problem(ins, seen, open_starts, first, last)
        if problem:
            raise PlanCheckError(f"{_at(rp, i)}: {problem}")
        seen.add((ins.op, ins.mb))
        if ins.op in _STARTS:
            open_starts[(ins.op, ins.mb)] = i
        elif ins.op in _WAITS:
            del open_starts[(START_FOR_WAIT[ins.op], ins.mb)]
    if open_starts:
        i = min(open_starts.values())
        raise PlanCheckError(f"{_at(rp, i)}: this Start is never waited for by the end")
    for kind in ("ForwardPass", "BackwardPass"):
        missing = sorted(mb for mb in mb_ids if (kind, mb) not in seen)
        if missing:
            raise PlanCheckError(f"{_rank_name(rp)} has no {kind} of micro-batch(es) {missing}")


def _order_problem(
    ins: Instruction,
    seen: set[tuple[str, int]],
    open_starts: dict[tuple[str, int], int],
    first: bool,
    last: bool,
) -> str | None:
    op, mb = ins.op, ins.mb
    if op in ("ForwardPass", "BackwardPass") and (op, mb) in seen:
        return f"second {op} of this micro-batch"
    if op == "ForwardPass" and not first and ("WaitRecvAct", mb) not in seen:
        return "runs before the WaitRecvAct of its input activation"
    if op == "BackwardPass" and ("ForwardPass", mb) not in seen:
        return "runs before the ForwardPass of this micro-batch"
    if op == "BackwardPass" and not last and ("WaitRecvGrad", mb) not in seen:
        return "runs before the WaitRecvGrad of its output gradient"
    if op == "SendActStart" and ("ForwardPass", mb) not in seen:
        return "sends an activation before the ForwardPass that produces it"
    if op == "SendGradStart" and ("BackwardPass", mb) not in seen:
        return "sends a gradient before the BackwardPass that produces it"
    if op in _STARTS and (op, mb) in seen:
        return "the same transfer is started twice"
    if op in _WAITS and (START_FOR_WAIT[op], mb) not in open_starts:
        return f"a Wait without an earlier {START_FOR_WAIT[op]} to wait for"
    return None


# ---- execution --------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Post:
    """One side of a transfer: a Start, when its rank posted it, and when the transfer ends
    (known once both sides have posted)."""

    owner: _RankState
    index: int
    ins: Instruction
    time: float
    end: float | None = None


@dataclass(eq=False, slots=True)
class _Channel:
    """The NCCL stream between stages `stage` and `stage + 1` of `replica`."""

    replica: int
    stage: int
    lower: list[_Post] = field(default_factory=list)
    upper: list[_Post] = field(default_factory=list)
    matched: int = 0
    last_end: float = 0.0


@dataclass(eq=False, slots=True)
class _RankState:
    plan: RankPlan
    static: float
    peak: float
    pc: int = 0
    clock: float = 0.0
    busy: float = 0.0
    stored: float = 0.0
    open: dict[tuple[str, int], _Post] = field(default_factory=dict)
    blocked_on: _Post | None = None

    @property
    def key(self) -> Rank:
        return (self.plan.replica, self.plan.stage)

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.plan.instructions)


class _Executor:
    def __init__(
        self, plan: ExecutionPlan, costs: list[PipelineCosts] | None, check_memory: bool
    ) -> None:
        """`costs` holds one table set per replica; None runs every operation in zero time
        (plan checks only)."""
        self.costs = costs
        self.check_memory = check_memory and costs is not None
        self.depths = [plan.replica_num_stages(k) for k in range(plan.num_replicas)]
        self.replica_of = {m.id: m.replica for m in plan.microbatches}
        self.shapes = {m.id: (m.num_rows, m.seqlen, m.tgt_seqlen) for m in plan.microbatches}
        self.attention_saved = {m.id: m.attention_saved for m in plan.microbatches}
        self.mb_costs: dict[int, tuple[list[float], ...]] = {}
        self.ranks: dict[Rank, _RankState] = {}
        for rp in sorted(plan.ranks, key=lambda r: (r.replica, r.stage)):
            static = float(costs[rp.replica].static[rp.stage]) if costs is not None else 0.0
            self.ranks[(rp.replica, rp.stage)] = _RankState(rp, static, static)
        self.channels: dict[Rank, _Channel] = {}
        self.compute_events: list[Event] = []
        self.transfer_events: list[Event] = []
        self.ready = deque(self.ranks.values())

    def run(self) -> SimulationResult:
        while self.ready:
            self._advance(self.ready.popleft())
        stuck = [rank for rank in self.ranks.values() if not rank.finished]
        if stuck:
            lines = [self._why_blocked(rank) for rank in stuck]
            raise DeadlockError(
                f"no rank can progress; {len(stuck)} rank(s) blocked:\n  " + "\n  ".join(lines)
            )
        return SimulationResult(
            makespan=max((rank.clock for rank in self.ranks.values()), default=0.0),
            busy={key: rank.busy for key, rank in self.ranks.items()},
            peak_memory={key: rank.peak for key, rank in self.ranks.items()},
            compute_events=sorted(self.compute_events, key=lambda e: (e.start, e.rank)),
            transfer_events=sorted(self.transfer_events, key=lambda e: (e.start, e.rank)),
        )

    def _advance(self, rank: _RankState) -> None:
        """Run `rank` until it finishes or blocks on a transfer whose peer has not posted."""
        instructions = rank.plan.instructions
        while rank.pc < len(instructions):
            ins = instructions[rank.pc]
            if ins.op in _WAITS:
                if not self._wait(rank, ins):
                    return
            elif ins.op in _STARTS:
                self._post(rank, ins)
            elif ins.op == "ForwardPass":
                self._compute(rank, ins, forward=True)
            elif ins.op == "BackwardPass":
                self._compute(rank, ins, forward=False)
            rank.pc += 1

    # ---- compute and memory --------------------------------------------------------------

    def _costs_of(self, mb: int) -> tuple[list[float], ...]:
        """(forward, backward, activation, transient) per stage of the micro-batch's replica,
        looked up once per micro-batch."""
        cached = self.mb_costs.get(mb)
        replica = self.replica_of[mb]
        if cached is None and self.costs is None:
            cached = self.mb_costs[mb] = ([0.0] * self.depths[replica],) * 4
        if cached is None:
            b, s, t = self.shapes[mb]
            c = self.costs[replica].stage_costs(b, s, t)
            if not c.feasible:
                raise PlanCheckError(
                    f"micro-batch {mb} ({b} rows, seqlen {s}, tgt_seqlen {t}) lies beyond the "
                    "cost tables"
                )
            forward, backward = c.forward, c.backward
            saved = self.attention_saved.get(mb, 0.0)
            if saved:  # packed rows: attention only inside each sample, as the planner priced it
                packed = self.costs[replica].packed_times(
                    forward[None], backward[None], np.array([b]), np.array([s]), np.array([saved])
                )
                forward, backward = packed[0][0], packed[1][0]
            cached = tuple(arr.tolist() for arr in (forward, backward, c.activation, c.transient))
            self.mb_costs[mb] = cached
        return cached

    def _compute(self, rank: _RankState, ins: Instruction, forward: bool) -> None:
        """Activations are held from the start of the forward pass to the end of the backward."""
        fwd, bwd, activation, transient = self._costs_of(ins.mb)
        stage = rank.plan.stage
        if forward:
            rank.stored += activation[stage]
        self._use_memory(rank, transient[stage])
        start = rank.clock
        duration = fwd[stage] if forward else bwd[stage]
        rank.clock = start + duration
        rank.busy += duration
        if not forward:
            rank.stored -= activation[stage]
        kind = "F" if forward else "B"
        self.compute_events.append(Event(rank.key, kind, ins.mb, start, rank.clock))

    def _use_memory(self, rank: _RankState, transient: float) -> None:
        in_use = rank.static + rank.stored + transient
        rank.peak = max(rank.peak, in_use)
        if not self.check_memory:
            return
        limit = float(self.costs[rank.plan.replica].stage_memory_limits()[rank.plan.stage])
        if in_use > limit:
            raise PlanCheckError(
                f"{_at(rank.plan, rank.pc)}: needs {in_use:.0f} bytes ({in_use / 2**30:.2f} GiB: "
                f"static {rank.static:.0f} + stored activations {rank.stored:.0f} + transient "
                f"{transient:.0f}), above the memory limit of {limit:.0f} bytes "
                f"({limit / 2**30:.2f} GiB)"
            )

    # ---- communication -------------------------------------------------------------------

    def _channel(self, replica: int, stage_a: int, stage_b: int) -> _Channel:
        key = (replica, min(stage_a, stage_b))
        channel = self.channels.get(key)
        if channel is None:
            channel = self.channels[key] = _Channel(replica, key[1])
        return channel

    def _post(self, rank: _RankState, ins: Instruction) -> None:
        """A non-blocking Start: queue it on the channel and pair it with the peer's post of the
        same position, if that exists yet."""
        post = _Post(rank, rank.pc, ins, rank.clock)
        rank.open[(ins.op, ins.mb)] = post
        stage = rank.plan.stage
        channel = self._channel(rank.plan.replica, stage, ins.peer)
        (channel.lower if stage < ins.peer else channel.upper).append(post)
        k = channel.matched
        if k < len(channel.lower) and k < len(channel.upper):
            self._transfer(channel, channel.lower[k], channel.upper[k])

    def _transfer(self, channel: _Channel, low: _Post, high: _Post) -> None:
        """Both sides have posted: the transfer runs once the channel's previous one is done."""
        _check_pair(channel, low, high)
        start = max(low.time, high.time, channel.last_end)
        duration = 0.0
        if self.costs is not None:
            duration = self.costs[channel.replica].p2p_time(channel.stage, list(low.ins.shape))
        end = start + duration
        low.end = high.end = channel.last_end = end
        channel.matched += 1
        sender, receiver = (low, high) if low.ins.op.startswith("Send") else (high, low)
        kind = "act" if sender is low else "grad"
        peer = receiver.owner.plan.stage
        self.transfer_events.append(Event(sender.owner.key, kind, low.ins.mb, start, end, peer))
        for post in (low, high):
            if post.owner.blocked_on is post:
                post.owner.blocked_on = None
                self.ready.append(post.owner)

    def _wait(self, rank: _RankState, ins: Instruction) -> bool:
        """Blocking: False (and the rank parks) while the transfer's peer has not posted."""
        key = (START_FOR_WAIT[ins.op], ins.mb)
        post = rank.open[key]
        if post.end is None:
            rank.blocked_on = post
            return False
        del rank.open[key]
        rank.clock = max(rank.clock, post.end)
        return True

    def _why_blocked(self, rank: _RankState) -> str:
        post = rank.blocked_on
        assert post is not None  # every unfinished rank parked on a Wait
        peer = self.ranks[(rank.plan.replica, post.ins.peer)]
        channel = self._channel(rank.plan.replica, rank.plan.stage, post.ins.peer)
        mine, theirs = channel.lower, channel.upper
        if rank.plan.stage > post.ins.peer:
            mine, theirs = theirs, mine
        state = "has finished" if peer.finished else f"is blocked at {_at(peer.plan, peer.pc)}"
        return (
            f"{_at(rank.plan, rank.pc)} waits for its {post.ins.op} mb {post.ins.mb} "
            f"(instruction {post.index}), communication #{mine.index(post) + 1} with stage "
            f"{peer.plan.stage}, which has posted only {len(theirs)} and {state}"
        )


def _describe(post: _Post) -> str:
    ins = post.ins
    return f"{_at(post.owner.plan, post.index)} shape {list(ins.shape)} {ins.dtype}"


def _check_pair(channel: _Channel, low: _Post, high: _Post) -> None:
    a, b = low.ins, high.ins
    if PARTNER[a.op] == b.op and a.mb == b.mb and a.shape == b.shape and a.dtype == b.dtype:
        return
    raise CommMismatchError(
        f"communication #{channel.matched + 1} between stages {channel.stage} and "
        f"{channel.stage + 1} pairs {_describe(low)} with {_describe(high)}; NCCL matches "
        "point-to-point operations by position, so both sides must post the same transfers "
        "in the same order with equal shapes and dtypes (dynapipe.txt §2.3, §6)"
    )
