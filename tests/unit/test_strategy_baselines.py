"""Hydraulis' comparison baselines (dynapipe_planner.strategy.baselines): our re-implementation
of Megatron-LM's dp_balanced on hand-worked examples (arrival-order packs, split to a multiple
of the DP size, dealt round-robin), and each baseline's latency made of its pipelines' shares."""

from __future__ import annotations

import numpy as np

from dynapipe_planner.strategy.baselines import (
    arrival_order_packs,
    megatron_dp_balanced_iteration,
    megatron_dp_balanced_shares,
    split_to_multiple,
)
from dynapipe_planner.strategy.schemes import ParallelScheme

# Row length 8: 5+3 fills the first pack; 4+2 = 6 leaves no room for 6; 6+1 = 7.
LENGTHS = np.array([5, 3, 4, 2, 6, 1])


def test_packs_follow_arrival_order() -> None:
    assert arrival_order_packs(LENGTHS, 8) == [[0, 1], [2, 3], [4, 5]]
    # never looks back: the last 2 opens a third pack although the first has room for it
    assert arrival_order_packs(np.array([5, 6, 2, 2]), 8) == [[0], [1, 2], [3]]
    # a sequence longer than the row is truncated to it and fills a pack alone
    assert arrival_order_packs(np.array([10, 3, 3, 1]), 8) == [[0], [1, 2, 3]]


def test_hand_worked_shares() -> None:
    # DP 3: three packs already, one each
    assert megatron_dp_balanced_shares(LENGTHS, 8, 3) == [[[0, 1]], [[2, 3]], [[4, 5]]]
    # DP 2 and 4: four packs needed; the fullest pack [5, 3] (8 tokens) splits in place
    assert megatron_dp_balanced_shares(LENGTHS, 8, 2) == [[[0], [2, 3]], [[1], [4, 5]]]
    assert megatron_dp_balanced_shares(LENGTHS, 8, 4) == [[[0]], [[1]], [[2, 3]], [[4, 5]]]


def test_split_cuts_nearest_half_of_the_tokens() -> None:
    lengths = np.array([8, 3, 3, 1])
    # [3, 3, 1] has 7 tokens: cutting after 3 leaves 3 | 4, after 3 + 3 leaves 6 | 1
    assert split_to_multiple([[0], [1, 2, 3]], lengths, 3) == [[0], [1], [2, 3]]
    # to reach 4 packs the 8-token pack cannot split, so the 4-token [3, 1] does
    assert split_to_multiple([[0], [1], [2, 3]], lengths, 4) == [[0], [1], [2], [3]]
    # [2, 2, 2, 2] cuts after the second sequence; [2, 2, 2] ties and cuts at the earlier one
    assert split_to_multiple([[0, 1, 2, 3]], np.full(4, 2), 2) == [[0, 1], [2, 3]]
    assert split_to_multiple([[0, 1, 2]], np.full(3, 2), 2) == [[0], [1, 2]]


def test_unsplittable_packs_leave_a_pipeline_short() -> None:
    assert megatron_dp_balanced_shares(np.array([8, 8, 8]), 8, 2) == [[[0], [2]], [[1]]]


class RowCounter:
    """A planner stand-in: a pipeline's latency is its number of micro-batches (rows)."""

    def of(self, scheme: ParallelScheme, inside: str) -> RowCounter:
        assert inside == "packing"
        return self

    def predict(self, lengths: np.ndarray, groups: list) -> float:
        assert all(g.seqlen == 8 and g.num_rows == 1 for g in groups)
        return float(len(groups))


def test_iteration_prices_each_pipelines_share() -> None:
    # 4 GPUs as two TP2 pipelines: two rows each; the GPUs of a pipeline share its latency
    two = megatron_dp_balanced_iteration(LENGTHS, ParallelScheme(2, 1), 4, 8, RowCounter())
    assert (two.latency, two.gpu_busy) == (2.0, (2.0, 2.0, 2.0, 2.0))
    # 3 GPUs as three pipelines, one pack each
    three = megatron_dp_balanced_iteration(LENGTHS, ParallelScheme(1, 1), 3, 8, RowCounter())
    assert (three.latency, three.imbalance) == (1.0, 0.0)
    # unsplittable: the second of two pipelines runs one row fewer
    short = megatron_dp_balanced_iteration(
        np.array([8, 8, 8]), ParallelScheme(1, 1), 2, 8, RowCounter()
    )
    assert short.gpu_busy == (2.0, 1.0) and short.imbalance == 0.5


def test_iteration_takes_another_split() -> None:
    # `shares_of` replaces the re-implemented split (e.g. upstream's DpBalancedScheduler)
    def all_on_first(lengths, row_len, num_pipelines):
        return [[[i] for i in range(len(lengths))]] + [[] for _ in range(num_pipelines - 1)]

    run = megatron_dp_balanced_iteration(
        LENGTHS, ParallelScheme(1, 1), 2, 8, RowCounter(), shares_of=all_on_first
    )
    assert run.gpu_busy == (6.0, 0.0) and run.imbalance == 1.0
