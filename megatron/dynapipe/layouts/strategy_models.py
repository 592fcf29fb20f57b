"""This rank's stage model and executor of each candidate strategy, built on first use and
kept up to `--max-cached-strategies`.

Under Hydraulis' optimisation-propagation disaggregation (seed `hydraulis.txt` §5.2) a
strategy's working weights are refilled from the owners by every pull and its gradients leave
with every push, so a stage model holds nothing between iterations that the
`DisaggregatedOptimizer` does not: it is a buffer. Keeping one per candidate costs a copy of the
working weights per candidate on every rank; a job with many candidates can instead keep the
most recently used few and rebuild the others when the selector picks them again (megatron-core
model construction, paid by that iteration only). Process groups are not rebuilt: all
candidates' groups exist from start-up (`parallel_state.initialize_strategies`).

Building a model reseeds the random generators (megatron's initialisation), so a build after
training has started keeps the job's random streams as they were: dropout stays the same
whether a model was cached or rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..checkpointing import rng_state, set_rng_state
from ..pipeline.executor import PlanExecutor
from .switch import DisaggregatedOptimizer


@dataclass
class StageModel:
    """One strategy's stage model on this rank and the executor that runs its plans."""

    model: torch.nn.Module
    executor: PlanExecutor


class StrategyModels:
    """Stage models by strategy, least recently used evicted beyond `capacity` (0: keep all).

    `build(k)` returns strategy k's (megatron config, stage model) while `use_strategy(k)` is in
    force; `make_executor(k, config, model)` wraps it (the optimiser's push as finalize step).
    """

    def __init__(
        self,
        optimizer: DisaggregatedOptimizer,
        build: Callable[[int], tuple[object, torch.nn.Module]],
        make_executor: Callable[[int, object, torch.nn.Module], PlanExecutor],
        capacity: int = 0,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"--max-cached-strategies must be >= 0 (0: all), got {capacity}")
        self.optimizer, self.capacity = optimizer, capacity
        self._build, self._make_executor = build, make_executor
        self._cache: OrderedDict[int, StageModel] = OrderedDict()
        self.builds = 0  # models built so far (cache misses)

    def add(self, strategy: int, config: object, model: torch.nn.Module) -> StageModel:
        """Cache a model built elsewhere (the one the optimiser was constructed with)."""
        entry = StageModel(model, self._make_executor(strategy, config, model))
        self._cache[strategy] = entry
        self._evict()
        return entry

    def get(self, strategy: int) -> StageModel:
        """Strategy `strategy`'s stage model and executor, built now if not cached; call with
        `use_strategy(strategy)` in force."""
        entry = self._cache.get(strategy)
        if entry is not None:
            self._cache.move_to_end(strategy)
            return entry
        streams = rng_state()
        config, model = self._build(strategy)
        set_rng_state(streams)
        self.builds += 1
        self.optimizer.attach(strategy, model)
        return self.add(strategy, config, model)

    def _evict(self) -> None:
        while self.capacity and len(self._cache) > self.capacity:
            strategy, _ = self._cache.popitem(last=False)
            self.optimizer.detach(strategy)

    def cached(self) -> list[int]:
        """Strategies whose models are held now, least recently used first."""
        return list(self._cache)
