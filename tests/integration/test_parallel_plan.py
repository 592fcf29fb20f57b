"""`pretrain_gpt.py --parallel-plan`: a dynapipe-search plan file run by the runtime.

Plans with uneven pipeline partitions (PP=2 with layers [3, 1] x DP=2 or x TP=2, PP=4 with
[1, 2, 1, 2]) and activation checkpointing of some layers give the loss and every gradient of a
single-process reference; the checkpointed layers, and only they, run their forward twice.
Plans with SDP layers (ZeRO-3 per layer, torch FSDP2) beside DP layers, with CKPT on both, and
an all-SDP plan give the reference's losses, gradient norms, clipped gradients and weights
after two optimiser steps, and hold half the SDP layers' parameter and Adam bytes per rank at
DP=2; in bf16 and fp16 (dynamic loss scale) they train as the same plan with DP layers.
`pretrain` and `pretrain_gpt.py` under torchrun train such plans end to end. A plan for another
GPU count, model or sequence length, or with a layer the runtime cannot run yet (hybrid DP x
SDP, TP changing inside a stage), a flag the plan decides itself, and --save or
--use-distributed-optimizer with SDP layers end `pretrain_gpt.py` with exit status 2 and one
line naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import exit_status_before_launch, program_exit_status, run_ranks  # noqa: E402
from gpt_reference import (  # noqa: E402
    DATA,
    GPT,
    LENGTHS,
    MAX_SEQLEN,
    SPEC,
    _reference_name,
    _shard,
    assert_matches_reference,
    sample_by_sample_loss,
    stage_gradients,
    stage_model_like_reference,
    tp_slice,
)
from gpt_reference import reference as _reference  # noqa: E402

from dynapipe_planner.search.optimizer import SearchResult  # noqa: E402
from dynapipe_planner.search.plan_file import write_plan  # noqa: E402
from dynapipe_planner.search.space import LayerStrategy  # noqa: E402


def write_searched_plan(
    path: Path,
    partition: list[int],
    ckpt: set[int],
    *,
    num_gpus: int = 4,
    tp: int = 1,
    num_microbatches: int = 3,
    global_batch_size: int = len(LENGTHS),
    layer: dict[int, LayerStrategy] | None = None,
    model=SPEC,
    seq_length: int = MAX_SEQLEN,
) -> Path:
    """The file `dynapipe-search --output` writes for this plan: every layer TP `tp` (GPUs
    consecutive) and DP over the other GPUs of its stage, checkpointed where `ckpt` says,
    `layer` replacing single layers."""
    pp = len(partition)
    tree = [(p, d) for p, d in (("dp", num_gpus // pp // tp), ("tp", tp)) if d > 1]
    order, degrees = tuple(p for p, _ in tree), tuple(d for _, d in tree)
    strategies = [LayerStrategy(pp, order, degrees, i in ckpt) for i in range(sum(partition))]
    for i, strategy in (layer or {}).items():
        strategies[i] = strategy
    result = SearchResult(
        throughput=1.0,
        iteration_time_s=1.0,
        global_batch_size=global_batch_size,
        num_microbatches=num_microbatches,
        pp=pp,
        partition=partition,
        strategies=strategies,
        stage_memory_bytes=[0.0] * pp,
        stage_time_s=[0.0] * pp,
        memory_budget_bytes=2**30,
        bi_objective=True,
    )
    model = dataclasses.replace(model, num_layers=sum(partition))
    write_plan(result, path, model, seq_length=seq_length, num_gpus=num_gpus)
    return path


def _searched_run(rank: int, world: int, path: str, weights: dict, flags: tuple[str, ...]):
    """One iteration of the searched plan at `path`: the runtime's settings from the file, the
    stage with the reference's weights and the plan's checkpointed layers, the runtime
    planner's micro-batches of LENGTHS. Returns ((loss sum, tokens), gradients, the layers
    checkpointed here, forward passes per layer of this stage, micro-batches of this rank)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.model_flags import spec_args
    from megatron.dynapipe.parallel_plan import apply_parallel_plan
    from megatron.dynapipe.pipeline.executor import PlanExecutor
    from megatron.dynapipe.pipeline.plan_source import planner_recipe
    from megatron.dynapipe.pipeline.recompute import checkpoint_layers

    cpu_compat.install()
    args = spec_args(SPEC, MAX_SEQLEN, *flags, "--parallel-plan", path)
    plan = apply_parallel_plan(args, world)
    tp, pp, dp = plan.tp, plan.pp, plan.data_degree
    ps.initialize(tp, pp, dp, layer_counts=list(plan.partition))
    try:
        config, model, names = stage_model_like_reference(tp, pp, weights, flags)
        checkpointed = checkpoint_layers(model, plan.checkpointed_layers)
        forwards: dict[int, int] = {}
        for module in model.modules():
            if isinstance(module, TransformerLayer):
                index = module.layer_number - 1
                forwards[index] = 0

                def count(*_, index: int = index) -> None:
                    forwards[index] += 1

                module.mlp.register_forward_hook(count)
        iteration_plan = planner_recipe(args, SPEC, dp).build().plan(LENGTHS)
        executor = PlanExecutor.for_this_rank(
            model, config, device=torch.device("cpu"), timeout_s=30
        )
        batches = rank_microbatches(iteration_plan, ps.replica(), DATA)
        result = executor.run(iteration_plan, batches)
        return (
            (result.loss_sum, result.num_tokens),
            stage_gradients(model, names, tp),
            checkpointed,
            forwards,
            len(batches),
        )
    finally:
        ps.destroy()


@pytest.mark.parametrize(
    ("partition", "ckpt", "tp", "num_microbatches"),
    [([3, 1], {0, 2}, 1, 3), ([1, 2, 1, 2], {1, 2, 5}, 1, 4), ([3, 1], {1}, 2, 3)],
    ids=["pp2-dp2-3+1", "pp4-1+2+1+2", "tp2-pp2-3+1"],
)
def test_searched_plan_gradients_equal_reference(tmp_path, partition, ckpt, tp, num_microbatches):
    """4 ranks run the plan; its loss and every gradient equal the reference's, every layer
    the plan checkpoints runs its forward again in the backward pass, the others once."""
    flags = (*GPT, "--num-layers", str(sum(partition)))
    reference = run_ranks(_reference, 1, flags)[0]
    path = write_searched_plan(
        tmp_path / "plan.json", partition, ckpt, tp=tp, num_microbatches=num_microbatches
    )
    results = run_ranks(_searched_run, 4, str(path), reference[1], flags)
    assert_matches_reference(reference, [r[:2] for r in results], tp)
    ranks_per_stage = 4 // len(partition)
    # each checkpointed layer is wrapped on every rank of its stage
    assert sorted(i for r in results for i in r[2]) == sorted(list(ckpt) * ranks_per_stage)
    for _, _, _, forwards, microbatches in results:
        assert microbatches == num_microbatches  # the plan's count on every replica
        for index, count in forwards.items():
            assert count == microbatches * (2 if index in ckpt else 1), (index, forwards)


SDP_FLAGS = ("--lr", "1e-2", "--lr-decay-style", "constant", "--clip-grad", "0.5")
STEPS = 2


def _reference_steps(rank: int, world: int, flags: tuple[str, ...]):
    """STEPS optimiser steps of Megatron's optimiser on the PP=1 model, every sample alone
    through it each step: (initial weights, [(loss, grad norm)] per step, (final weights, the
    last step's clipped gradients))."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.model_flags import spec_args
    from megatron.dynapipe.stage import stage_in_ddp

    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        _, model, optimizer, _ = stage_in_ddp(spec_args(SPEC, MAX_SEQLEN, *flags), SPEC.vocab_size)
        weights = {n: p.detach().numpy().copy() for n, p in model.module.named_parameters()}
        steps = []
        for _ in range(STEPS):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            loss = sample_by_sample_loss(model)
            loss.backward()
            model.finish_grad_sync()
            stepped, grad_norm, _ = optimizer.step()
            assert stepped
            steps.append((float(loss), float(grad_norm)))
        final = {n: p.detach().numpy().copy() for n, p in model.module.named_parameters()}
        clipped = {n: p.main_grad.numpy().copy() for n, p in model.module.named_parameters()}
        return weights, steps, (final, clipped)
    finally:
        ps.destroy()


def _local_shard(param: torch.Tensor, name: str, full: np.ndarray, tp: int) -> torch.Tensor:
    """This rank's part of the reference's `full` weight as `param` holds it: its TP slice,
    and of that its FSDP2 shard (dim 0, split as torch.chunk splits)."""
    from torch.distributed.tensor import DTensor

    from megatron.dynapipe import parallel_state as ps

    tp_part = _shard(full, param, name, ps.tp_rank(), tp)
    if not isinstance(param, DTensor):
        return tp_part
    mesh = param.device_mesh
    return torch.chunk(tp_part, mesh.size(), dim=0)[mesh.get_local_rank()]


def _plan_steps(rank: int, world: int, path: str, weights: dict, flags: tuple[str, ...]):
    """STEPS optimiser steps of the searched plan at `path`, built as training builds it
    (`stage_in_ddp` with the plan's CKPT and SDP layers) and given the reference's weights.
    Returns ([(loss sum, tokens, grad norm)] per step, ({reference name: final weight},
    {reference name: the last step's clipped gradient}), parameter + optimiser bytes of this
    rank, {layer of this stage: (sharded here, forward passes per micro-batch)})."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.tensor import DTensor

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.data.microbatches import rank_microbatches
    from megatron.dynapipe.model_flags import spec_args
    from megatron.dynapipe.parallel_plan import apply_parallel_plan
    from megatron.dynapipe.pipeline.executor import PlanExecutor
    from megatron.dynapipe.pipeline.plan_source import planner_recipe
    from megatron.dynapipe.sharded_layers import state_bytes
    from megatron.dynapipe.stage import stage_in_ddp

    cpu_compat.install()
    args = spec_args(SPEC, MAX_SEQLEN, *flags, "--parallel-plan", path)
    plan = apply_parallel_plan(args, world)
    ps.initialize(plan.tp, plan.pp, plan.data_degree, layer_counts=list(plan.partition))
    try:
        config, model, optimizer, _ = stage_in_ddp(
            args, SPEC.vocab_size, plan.checkpointed_layers, plan.sharded_layers
        )
        offset = sum(plan.partition[: ps.stage()])
        tied = "output_layer.weight" not in weights
        names = {n: _reference_name(n, offset, tied) for n, _ in model.module.named_parameters()}
        with torch.no_grad():
            for name, param in model.module.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(_local_shard(param, names[name], weights[names[name]], plan.tp))
        layers: dict[int, list] = {}  # layer: [sharded here, forward passes]
        for module in model.modules():
            if isinstance(module, TransformerLayer):
                index = module.layer_number - 1
                sharded = isinstance(module.mlp.linear_fc1.weight, DTensor)
                layers[index] = [sharded, 0]

                def count(*_, index: int = index) -> None:
                    layers[index][1] += 1

                module.mlp.register_forward_hook(count)
        iteration_plan = planner_recipe(args, SPEC, plan.data_degree).build().plan(LENGTHS)
        executor = PlanExecutor.for_this_rank(
            model, config, device=torch.device("cpu"), timeout_s=30
        )
        batches = rank_microbatches(iteration_plan, ps.replica(), DATA)
        steps = []
        for _ in range(STEPS):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            result = executor.run(iteration_plan, batches)
            stepped, grad_norm, _ = optimizer.step()
            assert stepped
            steps.append((result.loss_sum, result.num_tokens, float(grad_norm)))
        final, clipped = {}, {}
        for name, param in model.module.named_parameters():
            sdp = isinstance(param, DTensor)
            value = (param.full_tensor() if sdp else param).detach().numpy().copy()
            grad = (param.grad.full_tensor() if sdp else param.main_grad).numpy().copy()
            tp_place = (ps.tp_rank(), plan.tp, getattr(param, "partition_dim", 0))
            final[names[name]], clipped[names[name]] = (value, *tp_place), (grad, *tp_place)
        layers = {i: (sharded, n / (STEPS * len(batches))) for i, (sharded, n) in layers.items()}
        return steps, (final, clipped), state_bytes(model, optimizer), layers
    finally:
        ps.destroy()


def _assert_tp_close(got: tuple, full: np.ndarray, name: str, atol: float) -> None:
    """`got` (value, tp rank, tp size, partition dim) against the reference's `full` tensor."""
    value, tp_rank, tp, dim = got
    expected = full if value.shape == full.shape else tp_slice(full, name, tp_rank, tp, dim)
    np.testing.assert_allclose(value, expected, rtol=1e-4, atol=atol, err_msg=name)


@pytest.mark.parametrize(
    ("partition", "ckpt", "sdp", "tp"),
    [([3, 1], {0, 1}, {0, 2}, 1), ([4], {1, 2}, {0, 1, 2, 3}, 1), ([4], {0, 1}, {1, 3}, 2)],
    ids=["pp2-sdp2-dp2-mixed-3+1", "pp1-pure-sdp4", "tp2-sdp2-dp2-mixed"],
)
def test_sdp_plan_steps_equal_reference(tmp_path, partition, ckpt, sdp, tp):
    """SDP layers (ZeRO-3 over the data-parallel group) beside DP layers, with CKPT on both,
    under an uneven partition, and a plan with every layer SDP: after two optimiser steps
    with gradient clipping (which engages: the global norm exceeds --clip-grad) every
    parameter, every loss and every rank's gradient norm equal the single-process
    reference's; the SDP layers, and only they, are sharded."""
    flags = (*GPT, "--num-layers", str(sum(partition)), *SDP_FLAGS)
    weights, ref_steps, ref_final = run_ranks(_reference_steps, 1, flags)[0]
    pp = len(partition)
    ranks_per_stage = 4 // pp
    tree = (("sdp", "tp"), (ranks_per_stage // tp, tp)) if tp > 1 else (("sdp",), (4 // pp,))
    layer = {i: LayerStrategy(pp, *tree, i in ckpt) for i in sdp}
    path = write_searched_plan(tmp_path / "plan.json", partition, ckpt, tp=tp, layer=layer)
    results = run_ranks(_plan_steps, 4, str(path), weights, flags, timeout_s=180)
    for step, (ref_loss, ref_norm) in enumerate(ref_steps):
        assert ref_norm > 0.5  # clipping engaged
        loss_sum = sum(r[0][step][0] for r in results) / tp  # each TP shard reports it
        tokens = sum(r[0][step][1] for r in results) / tp
        assert tokens == LENGTHS.sum()
        assert loss_sum / tokens == pytest.approx(ref_loss, rel=1e-5)
        for r in results:
            assert r[0][step][2] == pytest.approx(ref_norm, rel=1e-5)
    seen = set()
    for _, (final, clipped), _, _ in results:
        for name, got in final.items():
            # Adam moves every element by about the learning rate (1e-2) per step, also those
            # whose gradient is near its eps (rounding noise amplified): weights agree to 1% of
            # a step; gradient scale and clipping are held exactly by the clipped gradients
            _assert_tp_close(got, ref_final[0][name], name, atol=1e-4)
            _assert_tp_close(clipped[name], ref_final[1][name], name, atol=1e-6)
            seen.add(name)
    assert seen == set(ref_final[0])
    stages = [r[3] for r in results]
    assert sorted(i for layers in stages for i in layers) == sorted(
        list(range(sum(partition))) * ranks_per_stage
    )
    for layers in stages:  # the SDP layers are sharded; CKPT layers run forward twice
        assert layers == {i: (i in sdp, 2 if i in ckpt else 1) for i in layers}


def test_sdp_layers_hold_a_dp_degree_share_of_their_states(tmp_path):
    """Parameter + optimiser bytes per rank of PP=2 [3, 1] x DP=2: sharding layers 0 and 2
    (SDP2) saves exactly half of their parameters and Adam states on every rank of stage 0."""
    flags = (*GPT, "--num-layers", "4", *SDP_FLAGS)
    weights = run_ranks(_reference_steps, 1, flags)[0][0]
    sdp = {i: LayerStrategy(2, ("sdp",), (2,), False) for i in (0, 2)}
    dp_path = write_searched_plan(tmp_path / "dp.json", [3, 1], set())
    sdp_path = write_searched_plan(tmp_path / "sdp.json", [3, 1], set(), layer=sdp)
    dp_bytes = [r[2] for r in run_ranks(_plan_steps, 4, str(dp_path), weights, flags)]
    sdp_bytes = [r[2] for r in run_ranks(_plan_steps, 4, str(sdp_path), weights, flags)]
    sharded = ("decoder.layers.0.", "decoder.layers.2.")
    layer_bytes = sum(v.nbytes for n, v in weights.items() if n.startswith(sharded))
    # each sharded parameter is held with its two Adam moments, all fp32; halved over 2 ranks
    saved = 3 * layer_bytes // 2
    assert [d - s for d, s in zip(dp_bytes, sdp_bytes, strict=True)] == [saved, saved, 0, 0]


TINY = [
    "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
    "--seq-length", "64", "--max-position-embeddings", "64", "--data-path", "synthetic:flan",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2",
    "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters", "0",
    "--planner-workers", "0",
]  # fmt: skip


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.training import pretrain

    return pretrain(parse_args(argv))


@pytest.mark.parametrize("sdp", [(), (1, 2, 3)], ids=["dp", "sdp-on-3-layers"])
def test_pretrain_trains_a_searched_plan(tmp_path, capfd, sdp) -> None:
    """`pretrain` with --parallel-plan: PP=2 with layers [3, 1] x DP=2, layers 0 and 2
    recomputed, 16 samples in 4 micro-batches, optionally with SDP layers (layer 2 is both
    SDP and CKPT; stage 1 is all SDP); the loss falls. `--log-peak-memory` traces the last
    iteration, FSDP2's freed storages included (they hold nothing)."""
    layer = {i: LayerStrategy(2, ("sdp",), (2,), i in (0, 2)) for i in sdp}
    path = write_searched_plan(
        tmp_path / "plan.json", [3, 1], {0, 2}, num_microbatches=4, global_batch_size=16,
        layer=layer,
    )  # fmt: skip
    argv = [*TINY, "--num-layers", "4", "--train-iters", "3", "--parallel-plan", str(path)]
    losses = run_ranks(_train, 4, [*argv, "--log-peak-memory"], timeout_s=120)
    assert all(rank_losses == losses[0] for rank_losses in losses)
    assert losses[0][-1] < losses[0][0], losses[0]
    out = capfd.readouterr().out
    traced = [line for line in out.splitlines() if "| peak memory" in line]
    assert len(traced) == 1 and "iteration 3/3" in traced[0]
    assert "TP 1, PP 2 with layers [3, 1], DP 2" in out and "recomputing layers [0, 2]" in out
    assert f"sharding (SDP) layers {list(sdp)}" in out
    assert "micro-batches 8 | recompute layers [0, 2]" in out  # 4 per replica, 2 replicas


@pytest.mark.parametrize(
    "precision",
    [["--bf16"], ["--fp16", "--initial-loss-scale", "2048", "--hysteresis", "1"]],
    ids=["bf16", "fp16"],
)
def test_sdp_plan_trains_like_the_dp_plan_in_half_precision(tmp_path, capfd, precision):
    """bf16, and fp16 with Megatron's dynamic loss scale: the plan with SDP layers 1-3 trains
    as the same plan with DP layers (losses within half-precision rounding) and, in fp16, skips
    the same overflowing steps (the first two) with the same loss scales, then steps."""
    layer = {i: LayerStrategy(2, ("sdp",), (2,), i in (0, 2)) for i in (1, 2, 3)}
    runs = {}
    for name, layers in (("dp", {}), ("sdp", layer)):
        path = write_searched_plan(
            tmp_path / f"{name}.json", [3, 1], {0, 2}, num_microbatches=4, global_batch_size=16,
            layer=layers,
        )  # fmt: skip
        argv = [*TINY, "--num-layers", "4", "--train-iters", "4", "--clip-grad", "1.0",
                "--parallel-plan", str(path), *precision]  # fmt: skip
        losses = run_ranks(_train, 4, argv, timeout_s=120)[0]
        lines = [line for line in capfd.readouterr().out.splitlines() if "| lm loss" in line]
        scales = [line.split("| loss scale")[1] if "| loss scale" in line else "" for line in lines]
        runs[name] = losses, scales
    np.testing.assert_allclose(runs["sdp"][0], runs["dp"][0], rtol=5e-3)
    assert runs["sdp"][0][-1] < runs["sdp"][0][0]
    assert runs["sdp"][1] == runs["dp"][1] and len(runs["sdp"][1]) == 4
    if "--fp16" in precision:  # the first steps overflow at 2048, the later ones step
        assert "skipped" in runs["sdp"][1][0] and "skipped" not in runs["sdp"][1][-1]


def _built_stage(rank: int, world: int, path: str, flags: tuple[str, ...]):
    """The dtypes of this rank's SDP-sharded parameters and of its optimiser's parameters."""
    from torch.distributed.tensor import DTensor

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.model_flags import spec_args
    from megatron.dynapipe.parallel_plan import apply_parallel_plan
    from megatron.dynapipe.stage import stage_in_ddp

    cpu_compat.install()
    args = spec_args(SPEC, MAX_SEQLEN, *flags, "--parallel-plan", path)
    plan = apply_parallel_plan(args, world)
    ps.initialize(plan.tp, plan.pp, plan.data_degree, layer_counts=list(plan.partition))
    try:
        _, model, optimizer, _ = stage_in_ddp(args, SPEC.vocab_size, (), plan.sharded_layers)
        sharded = {p.dtype for p in model.parameters() if isinstance(p, DTensor)}
        masters = {p.dtype for g in optimizer.param_groups for p in g["params"]}
        return sharded, masters
    finally:
        ps.destroy()


def test_sdp_layers_train_in_bf16_with_fp32_masters(tmp_path):
    layer = {i: LayerStrategy(2, ("sdp",), (2,), False) for i in range(4)}
    path = write_searched_plan(tmp_path / "plan.json", [3, 1], set(), layer=layer)
    flags = (*GPT, "--num-layers", "4", "--lr", "1e-2", "--bf16")
    for sharded, masters in run_ranks(_built_stage, 4, str(path), flags):
        assert sharded == {torch.bfloat16} and masters == {torch.float32}


def test_pretrain_gpt_runs_a_mixed_sdp_plan(tmp_path, capfd) -> None:
    """The real entry point on 4 forked ranks (torchrun's own start: test_training.py):
    `pretrain_gpt.py --parallel-plan` with PP=2 [3, 1] x DP=2, layers 0 and 3 SDP, 1 and 2 DP,
    layers 0 and 1 recomputed; it says so, every iteration logs a gradient norm, the loss
    falls, and it evaluates."""
    import re

    layer = {i: LayerStrategy(2, ("sdp",), (2,), i == 0) for i in (0, 3)}
    path = write_searched_plan(
        tmp_path / "plan.json", [3, 1], {0, 1}, num_microbatches=4, global_batch_size=16,
        layer=layer,
    )  # fmt: skip
    argv = [*TINY, "--num-layers", "4", "--train-iters", "4", "--clip-grad", "1.0",
            "--eval-iters", "1", "--eval-interval", "2", "--parallel-plan", str(path)]  # fmt: skip
    program = str(ROOT / "pretrain_gpt.py")
    assert run_ranks(program_exit_status, 4, program, argv, timeout_s=300) == [0] * 4
    stdout = capfd.readouterr().out
    assert "recomputing layers [0, 1]; sharding (SDP) layers [0, 3]" in stdout
    lines = [line for line in stdout.splitlines() if "] iteration" in line]
    assert len(lines) == 4 and all("| grad norm" in line for line in lines), stdout
    losses = [float(re.search(r"lm loss ([\d.]+)", line).group(1)) for line in lines]
    assert losses[-1] < losses[0], stdout
    assert "validation loss at iteration 2 |" in stdout  # forward-only, SDP layers gathered


def _main(capfd, argv: list[str], world_size: int = 4) -> str:
    """pretrain_gpt.py started as rank 0 of `world_size`: exit status 2, one line on stderr
    (returned), before any process group exists."""
    assert exit_status_before_launch(str(ROOT / "pretrain_gpt.py"), argv, world_size) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


SDP2 = LayerStrategy(2, ("sdp",), (2,), False)
DP2_SDP2 = LayerStrategy(1, ("dp", "sdp"), (2, 2), False)
TP2 = LayerStrategy(2, ("tp",), (2,), False)


@pytest.mark.parametrize(
    ("plan", "flags", "world", "named"),
    [
        ({}, [], 8, "is for 4 GPUs; this job has 8"),
        ({}, ["--num-layers", "6"], 4, "num_layers 4; the flags (--num-layers) give 6"),
        ({}, ["--hidden-size", "64"], 4, "hidden_size 32; the flags (--hidden-size) give 64"),
        ({"seq_length": 128}, [], 4, "sequences of 128 tokens; --seq-length is 64"),
        ({"partition": [4], "layer": {1: DP2_SDP2}}, [], 4, "layer 1 (DP2+SDP2): SDP over 2 of"),
        ({"layer": {2: SDP2}}, ["--save", "CKPT"], 4, "--save: plan"),
        ({"layer": {2: SDP2}}, ["--use-distributed-optimizer"], 4, "shards layers [2] (SDP"),
        ({"layer": {1: TP2}}, [], 4, "layer 1 (PP2+TP2): TP 2 in stage 0, whose layer 0 runs"),
        ({"missing": True}, [], 4, "does not exist"),
        ({}, ["--pipeline-model-parallel-size", "2"], 4, "--pipeline-model-parallel-size: --par"),
    ],
    ids=[
        "gpus", "layers", "hidden", "seq-length", "dp-x-sdp", "sdp-save", "sdp-zero1",
        "tp-in-stage", "no-file", "flag",
    ],
)  # fmt: skip
def test_bad_plan_is_one_line_and_exit_2(tmp_path, capfd, plan, flags, world, named):
    path = tmp_path / "plan.json"
    if not plan.get("missing"):
        kwargs = {k: v for k, v in plan.items() if k not in ("missing", "partition")}
        write_searched_plan(path, plan.get("partition", [3, 1]), {0}, **kwargs)
    flags = [str(tmp_path / "ckpt") if f == "CKPT" else f for f in flags]
    argv = [*TINY, "--num-layers", "4", "--train-iters", "1", *flags]
    line = _main(capfd, [*argv, "--parallel-plan", str(path)], world)
    assert line.startswith("pretrain_gpt.py: error: ") and named in line, line
