"""Communication planning: per-rank instruction lists that cannot deadlock (DynaPipe seed
dynapipe.txt §6, Fig. 12).

NCCL runs all point-to-point operations between two ranks in the order they were posted, so
both ranks must post them in the same order (§2.3). We walk the simulated compute timeline in
order of op end time; when a forward (backward) finishes we post the send on its stage and the
matching receive on the neighbour at that same moment. Each stage interleaves these posts with
its compute ops by time, so every pair of neighbours sees one global order. A received tensor is
waited for right before the op that consumes it, an activation send before the stage's backward
of that micro-batch (when its buffer is released). A gradient send is waited for before this
stage's first op that begins once the neighbour has posted the matching receive (in timeline
order), not at the end of the iteration: its buffer lives until the wait, and holding every
micro-batch's gradient to the end grows memory the schedule never priced (measured by
benchmarks/cost_model_accuracy.py). Deadlock-free as before: by then this stage has posted
everything the neighbour waits on before posting that receive.
"""

from __future__ import annotations

import heapq

import numpy as np

from .plan import Instruction

FORWARD, BACKWARD = 0, 1


def plan_communication(
    orders: list[list[int]],
    start: np.ndarray,
    end: np.ndarray,
    mb_ids: list[int],
    shapes: list[list[list[int]]],
    dtype: str = "bf16",
) -> list[list[Instruction]]:
    """Instruction lists, one per stage, for one pipeline.

    `orders[j]` holds op codes (2*m forward, 2*m+1 backward) over local micro-batch indices m;
    `start`/`end` are the simulated times, shaped (M, C, 2); `mb_ids[m]` is the plan-wide id;
    `shapes[m][j]` is the activation (and gradient) shape across boundary j -> j+1.
    """
    num_stages = len(orders)
    last = num_stages - 1
    # Every finished op that produces a tensor for a neighbour, in global time order (ties by
    # stage, then op code).
    codes = [np.asarray(order, dtype=np.int64) for order in orders]
    stage = np.concatenate([np.full(len(c), j) for j, c in enumerate(codes)])
    op = np.concatenate(codes)
    kind = op & 1
    sends = ((kind == FORWARD) & (stage < last)) | ((kind == BACKWARD) & (stage > 0))
    stage, op, kind = stage[sends], op[sends], kind[sends]
    time = end[op >> 1, stage, kind]
    ranked = np.lexsort((op, stage, time))
    produced = zip(*(x[ranked].tolist() for x in (time, stage, op)), strict=True)
    posts: list[list[tuple[float, Instruction]]] = [[] for _ in range(num_stages)]
    for t, j, code in produced:
        m, kind = code >> 1, code & 1
        mb = mb_ids[m]
        if kind == FORWARD:
            shape = tuple(shapes[m][j])
            posts[j].append((t, Instruction("SendActStart", mb, j + 1, shape, dtype)))
            posts[j + 1].append((t, Instruction("RecvActStart", mb, j, shape, dtype)))
        else:
            shape = tuple(shapes[m][j - 1])
            posts[j].append((t, Instruction("SendGradStart", mb, j - 1, shape, dtype)))
            posts[j - 1].append((t, Instruction("RecvGradStart", mb, j, shape, dtype)))
    return [
        _stage_program(j, num_stages, orders, start, end, posts[j], mb_ids)
        for j in range(num_stages)
    ]


def _begin_times(order: list[int], start: np.ndarray, j: int) -> np.ndarray:
    """Begin times of stage j's ops, sorted: a post made at time t lands before the first op
    that begins at or after t."""
    codes = np.asarray(order, dtype=np.int64)
    return np.sort(start[codes >> 1, j, codes & 1]) if len(codes) else np.empty(0)


def _stage_program(
    j: int,
    num_stages: int,
    orders: list[list[int]],
    start: np.ndarray,
    end: np.ndarray,
    posts: list[tuple[float, Instruction]],
    mb_ids: list[int],
) -> list[Instruction]:
    last = num_stages - 1
    program: list[Instruction] = []
    append = program.append
    codes = np.asarray(orders[j], dtype=np.int64)
    begin_of = start[codes >> 1, j, codes & 1].tolist() if len(codes) else []
    # When the upstream neighbour posts the receive of each gradient this stage sends: the
    # first of its op begin times at or after the backward's end (inf if none).
    upstream = _begin_times(orders[j - 1], start, j - 1) if j > 0 else np.empty(0)
    backward = codes[codes & 1 == BACKWARD]
    sent = end[backward >> 1, j, BACKWARD]
    found = np.searchsorted(upstream, sent, side="left")
    bounded = np.append(upstream, np.inf)
    posted_at = dict(zip(backward.tolist(), bounded[found].tolist(), strict=True))
    # Gradient-send waits not yet due, as a heap of (post time, arrival, instruction); due
    # ones are emitted in arrival order.
    pending: list[tuple[float, int, Instruction]] = []
    p, num_posts = 0, len(posts)
    for code, begins in zip(orders[j], begin_of, strict=True):
        m, kind = code >> 1, code & 1
        mb = mb_ids[m]
        while p < num_posts and posts[p][0] <= begins:
            append(posts[p][1])
            p += 1
        if pending and pending[0][0] <= begins:
            due = []
            while pending and pending[0][0] <= begins:
                due.append(heapq.heappop(pending))
            program.extend(ins for _, _, ins in sorted(due, key=lambda w: w[1]))
        if kind == FORWARD:
            if j == 0 or j == last:
                append(Instruction("LoadBatch", mb))
            if j > 0:
                append(Instruction("WaitRecvAct", mb, j - 1))
            append(Instruction("ForwardPass", mb))
        else:
            if j < last:
                append(Instruction("WaitSendAct", mb, j + 1))
                append(Instruction("WaitRecvGrad", mb, j + 1))
            append(Instruction("BackwardPass", mb))
            append(Instruction("FreeBuffer", mb))
            if j > 0:
                wait = Instruction("WaitSendGrad", mb, j - 1)
                heapq.heappush(pending, (posted_at[code], len(program), wait))
    program.extend(ins for _, ins in posts[p:])
    program.extend(ins for _, _, ins in sorted(pending, key=lambda w: w[1]))
    return program
