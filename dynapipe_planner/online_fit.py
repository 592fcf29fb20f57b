"""What a plan's iteration really takes on this job, learnt from the iterations it has run.

The planner prices a plan with profiled or analytic tables (seed `dynapipe.txt` §3 "Cost
models"), measured offline, layer by layer. A job's iteration also holds what the tables leave
out: each micro-batch's fixed cost in the runtime (the program's `forward_step`, its batch, the
transfers it posts), the gradient sync and optimiser step, and the device running faster or
slower than when it was profiled. `IterationTimeFit` learns, as training runs,

    measured ~= a x predicted + b x micro-batches + c

(`predicted`: the plan's predicted iteration time; `micro-batches`: the most any replica runs,
each one adding its fixed cost to that replica's critical path; `c`: the per-iteration work
outside the passes), with a, b, c >= 0, by Huber-weighted least squares over the latest
`window` iterations, so an iteration slowed by something else on the machine weighs little.
The fit starts from the planner's own word (a = 1, b = c = 0), held as `prior_weight`
iterations' worth of evidence: few noisy iterations cannot pull three coefficients far (on the
shared 2-core CPU one plan's iterations spread +-20%), many can. It predicts each next plan
before the plan runs (never from its own measurement), which is what the iteration line shows
beside the planner's prediction.

Plans themselves do not read the fit: a plan stays a function of the seed, the batch and the
cost table, so a resumed run plans the batches the uninterrupted run planned.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

from .plan import ExecutionPlan

# Huber's constant for 95% efficiency under Gaussian noise, in units of the residuals' scale.
HUBER_K = 1.345
# Where the fit starts: the planner's prediction as it is.
PRIOR = np.array([1.0, 0.0, 0.0])


@dataclass(frozen=True)
class PlanFeatures:
    """What the fit reads of a plan: its predicted seconds and the most micro-batches one
    replica runs."""

    predicted_s: float
    microbatches: int

    @classmethod
    def of(cls, plan: ExecutionPlan) -> PlanFeatures:
        per_replica: dict[int, int] = {}
        for mb in plan.microbatches:
            per_replica[mb.replica] = per_replica.get(mb.replica, 0) + 1
        return cls(float(plan.stats["predicted_iteration_s"]), max(per_replica.values()))

    def row(self) -> np.ndarray:
        return np.array([self.predicted_s, float(self.microbatches), 1.0])


class IterationTimeFit:
    """Measured iteration seconds as a robust, non-negative linear function of `PlanFeatures`
    (module docstring). `predict` answers None until `min_iterations` were observed."""

    def __init__(
        self, window: int = 50, min_iterations: int = 2, prior_weight: float = 3.0
    ) -> None:
        self.min_iterations = min_iterations
        self.prior_weight = prior_weight
        self._rows: deque[np.ndarray] = deque(maxlen=window)
        self._measured: deque[float] = deque(maxlen=window)
        self._coef: np.ndarray | None = None
        self.observed = 0  # iterations seen in all (the window keeps the latest)
        self.errors: list[float] = []  # |predicted - measured| / measured of each prediction

    def predict(self, features: PlanFeatures) -> float | None:
        """The fitted seconds of a plan with `features`, or None before `min_iterations`."""
        if self._coef is None:
            return None
        return float(features.row() @ self._coef)

    def observe(self, features: PlanFeatures, measured_s: float, predicted_s: float | None) -> None:
        """Learn one iteration: `measured_s` for a plan with `features`, which the fit had
        predicted as `predicted_s` (None if it had not predicted it yet)."""
        if predicted_s is not None and measured_s > 0:
            self.errors.append(abs(predicted_s - measured_s) / measured_s)
        self._rows.append(features.row())
        self._measured.append(measured_s)
        self.observed += 1
        if len(self._rows) >= self.min_iterations:
            self._coef = huber_nonnegative(
                np.array(self._rows), np.array(self._measured), PRIOR, self.prior_weight
            )

    def median_error(self) -> float | None:
        """Median relative error of the predictions made so far (None before the first)."""
        return statistics.median(self.errors) if self.errors else None

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) of the latest fit: per predicted second, per micro-batch, per iteration."""
        return None if self._coef is None else tuple(float(x) for x in self._coef)


def huber_nonnegative(
    x: np.ndarray,
    y: np.ndarray,
    prior: np.ndarray | None = None,
    prior_weight: float = 0.0,
    rounds: int = 20,
) -> np.ndarray:
    """Coefficients w >= 0 minimising Huber's loss of y - x @ w, plus, with a `prior`, the
    squared distance of each coefficient from it as `prior_weight` points of that column's
    root-mean-square size would weigh; by iteratively reweighted least squares, the residuals'
    scale their median absolute deviation."""
    if prior is not None and prior_weight > 0:
        size = np.sqrt(np.mean(x**2, axis=0))
        pseudo_x = np.diag(size) * np.sqrt(prior_weight)
        pseudo_y = pseudo_x @ prior
    else:
        pseudo_x, pseudo_y = np.zeros((0, x.shape[1])), np.zeros(0)
    ax, ay = np.vstack([x, pseudo_x]), np.concatenate([y, pseudo_y])

    def solve(weights: np.ndarray) -> np.ndarray:
        return nonnegative_least_squares(ax, ay, np.concatenate([weights, np.ones(len(pseudo_y))]))

    weights = np.ones(len(y))
    coef = solve(weights)
    for _ in range(rounds):
        residual = y - x @ coef
        scale = 1.4826 * float(np.median(np.abs(residual - np.median(residual))))
        if scale <= 1e-12 * max(1.0, float(np.abs(y).max())):
            break  # the fit is exact on at least half the points
        ratio = np.abs(residual) / (HUBER_K * scale)
        new_weights = np.where(ratio <= 1.0, 1.0, 1.0 / np.maximum(ratio, 1.0))
        if np.allclose(new_weights, weights, rtol=1e-6, atol=1e-9):
            break
        weights = new_weights
        coef = solve(weights)
    return coef


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares coefficients >= 0 over few columns, exactly: the best of the
    unconstrained fits on every subset of columns (the others held at 0) whose coefficients
    are all >= 0. Columns the points cannot tell apart share the minimum-norm solution."""
    root = np.sqrt(weights)[:, None]
    xw, yw = x * root, y * root[:, 0]
    norms = np.linalg.norm(xw, axis=0)
    norms[norms == 0] = 1.0
    best, best_sse = np.zeros(x.shape[1]), float(yw @ yw)
    for size in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), size):
            scaled = xw[:, cols] / norms[list(cols)]
            solution = np.linalg.lstsq(scaled, yw, rcond=None)[0] / norms[list(cols)]
            if np.any(solution < 0):
                continue
            coef = np.zeros(x.shape[1])
            coef[list(cols)] = solution
            residual = yw - xw @ coef
            sse = float(residual @ residual)
            if sse < best_sse - 1e-12 * max(1.0, best_sse):
                best, best_sse = coef, sse
    return best
