"""Event-driven 1F1B replay of a HexiScale plan (seed hexiscale.txt §4.4: "we simulate the
execution costs for the generated parallel execution plan by our cost model").

Each stage runs its 1F1B op order (warm-up forwards, one-forward-one-backward, cool-down
backwards); an op starts when the stage is free and its input has arrived. Per-stage forward,
backward and hop times come from `HeteroCostModel.plan_stage_costs`, the same numbers the
closed form (`HeteroCostModel.estimate`, App. A Eq. 9) adds up, so the two can be compared
plan by plan. A send occupies the sending stage (the leader sends, then the receiving TP group
broadcasts, Eq. 5): half of a link's hop with the forward activations, half with the backward
gradients. Gradient sync (Eq. 7) starts when every pipeline has finished, as in Eq. 10.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import HeteroCostModel, StageCost
from .layout import HeteroPlan


@dataclass
class Simulation:
    iteration_s: float
    pipeline_s: list[float]
    dp_sync_s: float
    mfu: float


def one_f_one_b(stages: list[StageCost], micro_batches: int) -> float:
    """Makespan of one pipeline under 1F1B with the given per-stage costs."""
    depth, m = len(stages), micro_batches
    order: list[list[tuple[str, int]]] = []
    for j in range(depth):
        warm = min(depth - j - 1, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", i) for i in range(m - warm, m)]
        order.append(ops)
    fwd_done = [[-1.0] * m for _ in range(depth)]  # includes the send to the next stage
    bwd_done = [[-1.0] * m for _ in range(depth)]
    free = [0.0] * depth
    pos = [0] * depth
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for j in range(depth):
            while pos[j] < len(order[j]):
                kind, i = order[j][pos[j]]
                c = stages[j]
                if kind == "F":
                    ready = 0.0 if j == 0 else fwd_done[j - 1][i]
                    if ready < 0:
                        break
                    end = max(free[j], ready) + c.forward_s + c.send_forward_s
                    fwd_done[j][i] = end
                else:
                    ready = fwd_done[j][i] if j == depth - 1 else bwd_done[j + 1][i]
                    if ready < 0 or fwd_done[j][i] < 0:
                        break
                    end = max(free[j], ready) + c.backward_s + c.send_backward_s
                    bwd_done[j][i] = end
                free[j] = end
                pos[j] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # 1F1B cannot deadlock; this guards against a broken op order
            raise RuntimeError("1F1B replay made no progress")
    return max(free)


def simulate_plan(cost_model: HeteroCostModel, plan: HeteroPlan) -> Simulation:
    """Replay every pipeline, then the gradient sync; MFU as `HeteroCostModel.mfu`."""
    times = [
        one_f_one_b(stages, p.micro_batches)
        for stages, p in zip(cost_model.plan_stage_costs(plan), plan.pipelines, strict=True)
    ]
    dp = cost_model.dp_sync_s(plan)
    iteration = max(times) + dp
    return Simulation(iteration, times, dp, cost_model.mfu(plan, iteration))
