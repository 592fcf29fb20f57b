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
    # Every finished op that produces a tensor for a neighbour, in global time order.
    produced = sorted(
        (float(end[code >> 1, j, code & 1]), j, code)
        for j in range(num_stages)
        for code in orders[j]
        if (code & 1 == FORWARD and j < last) or (code & 1 == BACKWARD and j > 0)
    )
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


def _first_begin_from(begins: np.ndarray, t: float) -> float:
    """The first of the sorted `begins` at or after t (inf if none)."""
    k = int(np.searchsorted(begins, t, side="left"))
    return float(begins[k]) if k < len(begins) else np.inf


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
    # (time the neighbour posts the receive, wait instruction), for sent gradients
    pending_grad_sends: list[tuple[float, Instruction]] = []
    upstream = _begin_times(orders[j - 1], start, j - 1) if j > 0 else np.empty(0)
    p = 0
    for code in orders[j]:
        m, kind = code >> 1, code & 1
        mb = mb_ids[m]
        begins = float(start[m, j, kind])
        while p < len(posts) and posts[p][0] <= begins:
            program.append(posts[p][1])
            p += 1
        due = [w for w in pending_grad_sends if w[0] <= begins]
        program.extend(ins for _, ins in due)
        pending_grad_sends = [w for w in pending_grad_sends if w[0] > begins]
        if kind == FORWARD:
            if j == 0 or j == last:
                program.append(Instruction("LoadBatch", mb))
            if j > 0:
                program.append(Instruction("WaitRecvAct", mb, j - 1))
            program.append(Instruction("ForwardPass", mb))
        else:
            if j < last:
                program.append(Instruction("WaitSendAct", mb, j + 1))
                program.append(Instruction("WaitRecvGrad", mb, j + 1))
            program.append(Instruction("BackwardPass", mb))
            program.append(Instruction("FreeBuffer", mb))
            if j > 0:
                sent = float(end[m, j, BACKWARD])
                posted = _first_begin_from(upstream, sent)
                pending_grad_sends.append((posted, Instruction("WaitSendGrad", mb, j - 1)))
    program.extend(ins for _, ins in posts[p:])
    program.extend(ins for _, ins in pending_grad_sends)
    return program
