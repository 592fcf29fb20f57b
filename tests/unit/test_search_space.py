"""Galvatron-BMW strategy space (seed galvatron_bmw.txt §III-B) and its topology."""

from __future__ import annotations

import pytest

from dynapipe_planner.errors import PlanningError
from dynapipe_planner.search.space import (
    decision_trees,
    group_crosses_nodes,
    pipeline_degrees,
    strategy_space,
)


def test_eight_gpus_give_the_papers_68_and_44_strategies():
    """The paper's count (§III-B, Fig. 3), reproduced exactly.

    PP is applied first with degrees 1/2/4/8, leaving groups of 8/4/2/1 GPUs (Takeaways #1,
    #2). A decision tree over a group is an ordered sequence of distinct paradigms from
    {DP, SDP, TP} (no paradigm twice, every degree >= 2) whose degrees multiply to the group
    size; the order matters because it decides which groups are consecutive. Counting trees:
    group 1: 1 (nothing left to split); group 2: 3; group 4: 3 one-level + 3*2 ordered pairs
    of 2x2 = 9; group 8: 3 one-level + 6 ordered pairs * 2 degree orders (2x4, 4x2) + 3! = 6
    three-level 2x2x2 trees = 21. 1+3+9+21 = 34 trees, each with and without CKPT: 68.
    Takeaway #3 removes every tree holding both DP and SDP: group 4 keeps 3 + 4 = 7, group 8
    keeps 3 + 8 = 11 (no three-level tree survives), so 1+3+7+11 = 22 trees (the "22
    candidates" of Galvatron without CKPT in §VII-E) and 44 with CKPT.
    """
    full = strategy_space(8, prune=False)
    pruned = strategy_space(8)
    assert sorted(full) == [1, 2, 4, 8]
    assert {pp: len(s) for pp, s in full.items()} == {1: 42, 2: 18, 4: 6, 8: 2}
    assert sum(len(s) for s in full.values()) == 68
    assert {pp: len(s) for pp, s in pruned.items()} == {1: 22, 2: 14, 4: 6, 8: 2}
    assert sum(len(s) for s in pruned.values()) == 44
    for strategies in pruned.values():
        assert not any(s.dp > 1 and s.sdp > 1 for s in strategies)
        assert len(set(strategies)) == len(strategies)
        for s in strategies:
            assert s.group_size * s.pp == 8


def test_degrees_need_not_be_powers_of_two():
    assert pipeline_degrees(12) == [1, 2, 3, 4, 6, 12]
    trees = decision_trees(6, prune=True)
    names = {str(s) for s in trees if not s.ckpt}
    assert {"DP6", "SDP6", "TP6", "DP2+TP3", "TP3+DP2", "TP2+SDP3"} <= names
    assert all(s.group_size == 6 for s in trees)
    assert decision_trees(1) and all(s.group_size == 1 for s in decision_trees(1))


def test_tree_order_decides_strides_and_node_crossing():
    (tp_inner,) = [s for s in decision_trees(16) if str(s) == "DP2+TP8"]
    (tp_outer,) = [s for s in decision_trees(16) if str(s) == "TP8+DP2"]
    assert (tp_inner.stride("tp"), tp_inner.stride("dp")) == (1, 8)
    assert (tp_outer.stride("tp"), tp_outer.stride("dp")) == (2, 1)
    # Two nodes of 8: consecutive TP8 stays on NVLink, strided TP8 crosses the network.
    assert not group_crosses_nodes(tp_inner, "tp", 0, 8)
    assert group_crosses_nodes(tp_inner, "dp", 0, 8)
    assert group_crosses_nodes(tp_outer, "tp", 0, 8)
    assert not group_crosses_nodes(tp_outer, "dp", 0, 8)


def test_bad_sizes_are_named():
    with pytest.raises(PlanningError, match="group size"):
        decision_trees(0)
    with pytest.raises(PlanningError, match="num_gpus"):
        pipeline_degrees(0)
