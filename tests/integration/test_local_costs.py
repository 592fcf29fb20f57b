"""This machine's cost table (`megatron.dynapipe.local_costs`): profiled once in a process of
its own on the path the runtime runs (THD, per-sample attention), in CPU seconds, kept on disk
under a name that changes with what the costs depend on, reused without profiling again, and
loaded by the planner, whose plans then say they were priced with it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dynapipe_planner.cost import ProfiledCostModel
from dynapipe_planner.planner import IterationPlanner

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
JOB = [*MODEL, "--seq-length", "64", "--tokens-per-global-batch", "256", "--train-iters", "1"]


def _args(*extra: str):
    from megatron.dynapipe.arguments import parse_args

    return parse_args([*JOB, "--dynamic-micro-batching", *extra])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DYNAPIPE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow
def test_profiled_once_then_reused_and_planned_with(cache: Path, monkeypatch) -> None:
    from megatron.dynapipe import local_costs
    from megatron.dynapipe.pipeline.plan_source import planner_recipe
    from megatron.dynapipe.profile_grid import default_seqlens

    args = _args("--dynapipe-cost-model", "local")
    vocab = args.padded_vocab_size = 256
    lines: list[str] = []
    path = local_costs.local_cost_table(args, vocab, lines.append)
    assert path.parent == cache and path.is_file()
    assert lines[0].startswith("profiling this machine's costs") and str(path) in lines[-1]
    table = json.loads(path.read_text())
    assert table["profile"]["clock"] == "cpu" and table["device"].startswith("cpu")
    decoder = next(e for e in table["entries"] if e["component"] == "decoder_layer")
    assert decoder["seqlens"] == default_seqlens(64) and decoder["microbatch_sizes"] == [1, 2, 4, 8]
    forward = np.array(decoder["forward_s"], dtype=float)  # nulls beyond 256 tokens
    assert np.isnan(forward[-1, -1]) and np.all(forward[0] > 0)

    # the second run finds it: nothing is profiled (a child process would fail here)
    monkeypatch.setattr(multiprocessing, "get_context", lambda *_: pytest.fail("profiled"))
    assert local_costs.local_cost_table(args, vocab, lines.append) == path and len(lines) == 2
    # what the costs depend on names another table
    other = _args("--dynapipe-cost-model", "local", "--attention-dropout", "0")
    other.padded_vocab_size = vocab
    description = local_costs.profile_description(other, vocab)
    assert description != local_costs.profile_description(args, vocab)

    # the planner prices with it, and its plans say so
    from dynapipe_planner.megatron_model import spec_from_args

    spec = spec_from_args(args, vocab, "tiny")
    recipe = planner_recipe(args, spec, 1)
    assert isinstance(recipe.cost_model, ProfiledCostModel)
    planner = IterationPlanner(recipe.cost_model, recipe.num_stages, recipe.config)
    plan = planner.plan(np.array([60, 50, 40, 30, 20, 10, 5, 3]))
    assert plan.meta["cost_model"]["device"] == table["device"]
    assert 0 < plan.stats["predicted_iteration_s"] < 10


def test_a_cache_path_that_is_not_a_file_is_refused(cache: Path) -> None:
    from megatron.dynapipe import local_costs

    args = _args("--dynapipe-cost-model", "local")
    description = local_costs.profile_description(args, 256)
    import hashlib

    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
    (cache / f"cost-table-{digest[:20]}.json").mkdir(parents=True)
    with pytest.raises(local_costs.CostTableError, match="not a regular file"):
        local_costs.local_cost_table(args, 256, lambda _line: None)


def test_analytic_and_tensor_parallel_jobs_plan_with_the_analytic_model() -> None:
    from megatron.dynapipe.pipeline.plan_source import cost_table

    spec = None  # not read: no table is looked for
    assert cost_table(_args("--dynapipe-cost-model", "analytic"), spec) is None
    tp2 = _args("--dynapipe-cost-model", "local")
    tp2.tensor_model_parallel_size = 2  # as a job of two TP ranks parses it
    assert cost_table(tp2, spec) is None
    assert cost_table(_args("--dynapipe-cost-model", "t.json"), spec) == "t.json"


def _world_of_one(conn) -> None:
    import torch
    import torch.distributed as dist

    from megatron.dynapipe.layouts.megatron_export import one_process_group

    try:
        one_process_group()
        total = torch.ones(1)
        dist.all_reduce(total)
        conn.send((dist.get_world_size(), float(total)))
    except BaseException as error:
        conn.send(repr(error))
    finally:
        os._exit(0)


def test_worlds_of_one_start_side_by_side() -> None:
    """Four processes that each export alone (`one_process_group`: `WORLD_OF_ONE`, as the local
    profile's child) start their worlds at the same moment: none takes a port another one picked
    (each store binds what the kernel gives it)."""
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe(duplex=False) for _ in range(4)]
    children = [context.Process(target=_world_of_one, args=(send,)) for _, send in pipes]
    for child in children:
        child.start()
    try:
        results = [recv.recv() if recv.poll(60) else "no answer in 60 s" for recv, _ in pipes]
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
    assert results == [(1, 1.0)] * 4
