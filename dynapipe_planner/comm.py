"""Communication planning: per-rank instruction lists that cannot deadlock (DynaPipe seed
dynapipe.txt §6, Fig. 12).

NCCL runs all point-to-point operations between two ranks in the order they were posted, so
both ranks must post them in the same order (§2.3). We walk the simulated compute timeline in
order of op end time; when a forward (backward) finishes we post the send on its stage and the
matching receive on the neighbour at that same moment. Each stage interleaves these posts with
its compute ops by time, so every pair of neighbours sees one global order. Waits go as late as
possible: a received tensor is waited for right before the op that consumes it, an activation
send before the stage's backward of that micro-batch (when its buffer is released), a gradient
send at the end of the iteration.
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
        _stage_program(j, num_stages, orders[j], start, posts[j], mb_ids) for j in range(num_stages)
    ]


def _stage_program(
    j: int,
    num_stages: int,
    order: list[int],
    start: np.ndarray,
    posts: list[tuple[float, Instruction]],
    mb_ids: list[int],
) -> list[Instruction]:
    last = num_stages - 1
    program: list[Instruction] = []
    pending_grad_sends: list[Instruction] = []
    p = 0
    for code in order:
        m, kind = code >> 1, code & 1
        mb = mb_ids[m]
        begins = float(start[m, j, kind])
        while p < len(posts) and posts[p][0] <= begins:
            program.append(posts[p][1])
            p += 1
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
                pending_grad_sends.append(Instruction("WaitSendGrad", mb, j - 1))
    program.extend(ins for _, ins in posts[p:])
    program.extend(pending_grad_sends)
    return program
