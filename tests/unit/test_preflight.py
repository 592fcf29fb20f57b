"""The longest sample of a dataset is tried before training (`dynapipe_planner.preflight`):
a dataset whose longest sample fits in no micro-batch under the memory limit, at any
recomputation mode, is refused up front naming that sample, where it used to stop the job
at the first iteration that drew it (issue 34)."""

from __future__ import annotations

import numpy as np
from test_planner import make_planner

from dynapipe_planner.model_spec import MODEL_PRESETS
from dynapipe_planner.preflight import longest_sample_refusal


def test_the_longest_sample_is_refused_before_training_and_the_rest_pass() -> None:
    planner = make_planner(MODEL_PRESETS["gpt-1.3b"], 2, 1, 16, max_seqlen=16384)
    refusal = longest_sample_refusal(planner, np.array([300, 8000, 1200, 16000]), 8, "d")
    assert refusal is not None
    assert refusal.startswith(
        "d: before training, a global batch of 4 copies of its longest sample, 3 (length "
        "16000), cannot be planned: no feasible plan. recompute=none: dp: sample 3 (length "
        "16000) does not fit in any micro-batch"
    ), refusal
    assert "recompute=full" in refusal  # every mode was tried
    assert longest_sample_refusal(planner, np.array([300, 1200, 2000]), 8, "d") is None


def test_the_probe_is_as_large_as_a_batch_can_hold_and_fills_every_window() -> None:
    """As many copies as one global batch holds (a token budget that holds one probes one),
    at most two per stage and replica."""
    planner = make_planner(MODEL_PRESETS["gpt-1.3b"], 2, 2, 16, max_seqlen=16384)
    lengths = np.array([1000, 16000])
    assert "a global batch of 1 copies" in longest_sample_refusal(planner, lengths, 1, "d")
    assert "a global batch of 8 copies" in longest_sample_refusal(planner, lengths, 64, "d")
