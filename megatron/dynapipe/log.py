"""The job's log: the lines every Megatron user reads, and DynaPipe's iteration line.

`iteration_line` is the per-iteration line of `pretrain_gpt.py`'s loop and, under
`import megatron.dynapipe.enable`, of megatron.training's own loop (beside Megatron's line);
`benchmarks/torchrun_runs.iteration_rows` parses it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynapipe_planner.online_fit import IterationTimeFit

    from .iterations import Iteration


def log_rank0(rank: int, message: str) -> None:
    """Print `message` on rank 0 only (the log every Megatron user reads)."""
    if rank == 0:
        print(message, file=sys.stdout, flush=True)


def iteration_line(
    iteration: int,
    train_iters: int,
    work: Iteration,
    loss: float,
    tokens: int,
    measured_s: float,
    checkpointed: tuple[int, ...] = (),
    searched: tuple[float, str | None] | None = None,
    fit: IterationTimeFit | None = None,
) -> str:
    """Iteration `iteration` (counted from 1) of `train_iters`: the loss per real token,
    `tokens` real tokens over the measured `measured_s` (the whole step: passes, gradient sync
    and optimiser). `recompute`: the recomputation mode, or the layers a searched plan
    checkpoints (`checkpointed`); with a planner, `predicted` is the plan's iteration time
    under the cost model it was planned with (`priced_with`), or for a searched plan file the
    search's (`searched`: seconds and the devices it priced), `planning` the planner's time
    for this plan (spent ahead of training when planner workers run) and `waited` how long
    the printing rank waited for the plan; `fitted` the plan's time as the job's online `fit`
    predicted it before it ran, with the median error of its predictions so far
    (`online_fit`); "planner budget exhausted" follows only when the micro-batch DP ran out of
    its wall-clock budget (the plan is then the best partition found, not the optimum)."""
    stats = work.stats
    recompute = f"layers {list(checkpointed)}" if checkpointed else stats["recompute"]
    width = len(str(train_iters))
    done = iteration / train_iters
    bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
    line = (
        f"[{bar}] iteration {iteration:>{width}}/{train_iters} | lm loss {loss:.4f} | "
        f"tokens/s {tokens / measured_s:,.0f} | padding eff {stats['padding_efficiency']:.3f} | "
        f"micro-batches {stats['num_microbatches']} | recompute {recompute} | "
        f"iteration {measured_s * 1e3:,.0f} ms"
    )
    if work.plan is not None:
        if searched is not None:
            seconds, device = searched
            predicted = f"search predicted {seconds * 1e3:,.1f} ms" + (
                f" on {device}" if device else ""
            )
        else:
            predicted = (
                f"predicted {stats['predicted_iteration_s'] * 1e3:,.1f} ms "
                f"{priced_with(work.plan.meta)}"
            )
        if work.fitted_s is not None and fit is not None:
            predicted += f"; fitted {work.fitted_s * 1e3:,.1f} ms" + fit_error(fit)
        line += (
            f" ({predicted}) | planning {stats['planning_time_s'] * 1e3:,.1f} ms "
            f"(waited {work.waited_s * 1e3:,.1f} ms)"
        )
        if stats.get("budget_exhausted"):
            line += " | planner budget exhausted"
    return line


def iteration_scalars(work: Iteration, tokens: int, measured_s: float) -> dict[str, float]:
    """The iteration line's metrics as scalars for Megatron's TensorBoard and W&B writers
    (under "dynapipe/"): real tokens/s, padding efficiency, micro-batches, the planned global
    batch's samples, and the measured, predicted and fitted iteration times (ms)."""
    stats = work.stats
    scalars = {
        "dynapipe/real-tokens-per-second": tokens / measured_s,
        "dynapipe/padding-efficiency": float(stats["padding_efficiency"]),
        "dynapipe/micro-batches": float(stats["num_microbatches"]),
        "dynapipe/global-batch-samples": float(work.samples),
        "dynapipe/iteration-ms": measured_s * 1e3,
    }
    if work.plan is not None:
        scalars["dynapipe/predicted-iteration-ms"] = stats["predicted_iteration_s"] * 1e3
    if work.fitted_s is not None:
        scalars["dynapipe/fitted-iteration-ms"] = work.fitted_s * 1e3
    return scalars


def fit_error(fit: IterationTimeFit) -> str:
    """How far the online fit's predictions were from the measured times so far, as the
    line's ", median error 6.2% over 12 iterations"."""
    error = fit.median_error()
    if error is None:
        return ""
    count = len(fit.errors)
    return f", median error {error:.1%} over {count} iteration{'s' if count != 1 else ''}"


def priced_with(meta: dict) -> str:
    """What a plan was priced with, from its `meta["cost_model"]`: "on cpu, profiled" (a cost
    table, named by the device it measured), "on A100-80GB, analytic"."""
    model = meta.get("cost_model", {})
    if model.get("kind") == "profiled":
        return f"on {model.get('device', 'unknown device')}, profiled"
    return f"on {model.get('cluster', {}).get('gpu', 'an unknown device')}, analytic"


def peak_memory_field(peaks: list[int]) -> str:
    """The line's field for `--log-peak-memory`: every rank's traced peak (bytes, rank order)."""
    return (
        f" | peak memory {max(peaks) / 2**20:,.2f} MiB (per rank "
        f"{', '.join(f'{p / 2**20:.2f}' for p in peaks)}; traced tensors, "
        "this iteration slowed by the trace)"
    )
