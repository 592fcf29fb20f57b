"""Megatron-LM's own `DpBalancedScheduler` (megatron/core/datasets/data_schedule.py of a
NVIDIA/Megatron-LM checkout; not in megatron-core 0.19.2) run for `hydraulis_quality.py`'s
dp_balanced row. Nothing of it is copied here: a child interpreter imports it from the checkout
(its `megatron.core` first on the child's PYTHONPATH, so the installed megatron-core never mixes
with it) and answers one JSON line per batch; this process never edits its own import path."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys

import numpy as np

# The child's whole program: the checkout's scheduler, CP 1 and no virtual pipeline, on each
# request's (index, length) pairs; one JSON line out per JSON line in.
_CHILD = """
import json, sys
from megatron.core.datasets import data_schedule
print(json.dumps({"source": data_schedule.__file__}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    scheduler = data_schedule.DpBalancedScheduler(
        max_seqlen_per_dp_cp_rank=request["row_len"],
        cp_size=1,
        dp_size=request["num_pipelines"],
        microbatch_group_size_per_vp_stage=None,
    )
    groups = scheduler.get_groups_and_subsamples([tuple(s) for s in request["seqlens"]])
    print(json.dumps(groups), flush=True)
"""
REPLY_TIMEOUT_S = 300.0  # the child's first reply includes importing torch


class MegatronLmDpBalanced:
    """`shares(lengths, row_len, num_pipelines)` from upstream's scheduler: pipeline j's
    micro-batch i is its group [i][j] over the sequences truncated to the row length. Use as a
    context manager; the child ends when it does."""

    def __init__(self, checkout: str) -> None:
        root = os.path.abspath(checkout)
        if not os.path.isfile(os.path.join(root, "megatron/core/datasets/data_schedule.py")):
            raise SystemExit(f"--megatron-lm: no megatron/core/datasets/data_schedule.py in {root}")
        env = {**os.environ, "PYTHONPATH": root}
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=root,
            text=True,
        )
        self.source = self._reply()["source"]
        if not os.path.abspath(self.source).startswith(root + os.sep):
            self.close()
            raise SystemExit(f"--megatron-lm: megatron.core came from {self.source}")

    def _reply(self):
        with selectors.DefaultSelector() as selector:
            selector.register(self._child.stdout, selectors.EVENT_READ)
            if not selector.select(REPLY_TIMEOUT_S):
                self.close()
                raise SystemExit(f"--megatron-lm: no answer within {REPLY_TIMEOUT_S:.0f} s")
        line = self._child.stdout.readline()
        if not line:
            raise SystemExit(f"--megatron-lm: the scheduler's process ended ({self._child.wait()})")
        return json.loads(line)

    def __call__(self, lengths: np.ndarray, row_len: int, num_pipelines: int) -> list:
        seqlens = [(i, int(n)) for i, n in enumerate(np.minimum(lengths, row_len))]
        request = {"seqlens": seqlens, "row_len": int(row_len), "num_pipelines": num_pipelines}
        self._child.stdin.write(json.dumps(request) + "\n")
        self._child.stdin.flush()
        groups = self._reply()
        return [[group[j] for group in groups] for j in range(num_pipelines)]

    def close(self) -> None:
        if self._child.poll() is None:
            self._child.stdin.close()
            try:
                self._child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()

    def __enter__(self) -> MegatronLmDpBalanced:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
