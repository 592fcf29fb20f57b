"""Runtime groundwork on CPU + gloo: megatron.dynapipe.parallel_state fills megatron-core's
globals in ClusterSpec's rank order, a real megatron-core GPTModel runs under cpu_compat with
TP=2 and matches TP=1, megatron-core's 1F1B schedule + DDP + Adam train on TP=2 x PP=2, and
cpu_compat redirects no CUDA call site beyond tests/data/cuda_call_sites.txt (regenerate it with
DYNAPIPE_WRITE_CALL_SITES=1 after checking each new site is safe on CPU; test_megatron_baseline.py
checks its runs against the same list and adds the tied-embedding PP site of language_module).

Skipped when the `runtime` extra (torch, megatron-core) is not installed.
"""

from __future__ import annotations

import os

import pytest
from paths import TESTS

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402

from dynapipe_planner.cluster import ClusterSpec, get_gpu  # noqa: E402

CALL_SITES_FILE = TESTS / "data" / "cuda_call_sites.txt"


def _state_of_rank(rank: int, world: int, tp: int, pp: int, dp: int) -> dict:
    from megatron.core import parallel_state as mpu

    from megatron.dynapipe import parallel_state as ps

    ps.initialize(tp, pp, dp)
    try:
        return {
            "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "tp_size": mpu.get_tensor_model_parallel_world_size(),
            "pp_rank": mpu.get_pipeline_model_parallel_rank(),
            "pp_size": mpu.get_pipeline_model_parallel_world_size(),
            "dp_rank": mpu.get_data_parallel_rank(),
            "dp_size": mpu.get_data_parallel_world_size(),
            "first": mpu.is_pipeline_first_stage(),
            "last": mpu.is_pipeline_last_stage(),
            "next": mpu.get_pipeline_model_parallel_next_rank(),
            "prev": mpu.get_pipeline_model_parallel_prev_rank(),
            "ours": (ps.tp_rank(), ps.stage(), ps.num_stages(), ps.replica(), ps.num_replicas()),
            "peers": [ps.peer_rank(s) for s in range(pp)],
        }
    finally:
        ps.destroy()


@pytest.mark.parametrize(("tp", "pp", "dp"), [(2, 2, 1), (1, 2, 2), (1, 4, 1)])
def test_parallel_state_matches_cluster_layout(tp: int, pp: int, dp: int) -> None:
    cluster = ClusterSpec(get_gpu("A100-80GB"), num_stages=pp, num_replicas=dp, tp=tp)
    states = run_ranks(_state_of_rank, tp * pp * dp, tp, pp, dp)
    for stage in range(pp):
        for replica in range(dp):
            for t in range(tp):
                rank = cluster.rank(replica, stage, t)
                got = states[rank]
                assert (got["tp_rank"], got["tp_size"]) == (t, tp), rank
                assert (got["pp_rank"], got["pp_size"]) == (stage, pp), rank
                assert (got["dp_rank"], got["dp_size"]) == (replica, dp), rank
                assert got["first"] == (stage == 0) and got["last"] == (stage == pp - 1), rank
                assert got["next"] == cluster.rank(replica, (stage + 1) % pp, t), rank
                assert got["prev"] == cluster.rank(replica, (stage - 1) % pp, t), rank
                assert got["ours"] == (t, stage, pp, replica, dp), rank
                assert got["peers"] == [cluster.rank(replica, s, t) for s in range(pp)], rank


def _tiny_gpt(tp: int, pp: int, seed: int):
    """The tiny fp32 GPTModel of these tests, built for this rank's stage."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=16,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )
    return config, model


def _batch(seed: int, labels: bool = False):
    """(input_ids, position_ids, attention_mask) of 2 x 16 tokens, or the labels."""
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(seed))
    if labels:
        return tokens[:, 1:]
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)  # True = masked out
    return tokens[:, :-1], positions, mask


def _gpt_loss(rank: int, world: int, tp: int, seed: int) -> tuple[float, float, set[str]]:
    """One forward+backward of a tiny GPTModel; returns (loss, grad norm², call sites)."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps

    assert cpu_compat.install()
    ps.initialize(tp, 1, world // tp)
    try:
        _, model = _tiny_gpt(tp, 1, seed)
        loss = model(*_batch(seed), labels=_batch(seed, labels=True)).mean()
        loss.backward()
        grad_sq = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
        return loss.detach().item(), grad_sq, cpu_compat.recorded_call_sites()
    finally:
        ps.destroy()


def _pipeline_training(rank: int, world: int, tp: int, pp: int) -> tuple[list, set[str]]:
    """Three steps of megatron-core's 1F1B schedule + DDP + Adam on one fixed global batch."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps

    assert cpu_compat.install()
    ps.initialize(tp, pp, world // (tp * pp))
    try:
        config, model = _tiny_gpt(tp, pp, seed=7)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), [model]
        )
        microbatches = [(_batch(s), _batch(s, labels=True)) for s in range(4)]

        def forward_step(data_iterator, model):
            (inputs, positions, mask), labels = next(data_iterator)
            out = model(inputs, positions, mask, labels=labels)

            def loss_func(per_token):
                loss = per_token.mean()
                return loss, {"loss": loss.detach().clone()}

            return out, loss_func

        losses = []
        for _ in range(3):
            model.zero_grad_buffer()
            opt.zero_grad()
            stats = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(microbatches),
                model=[model],
                num_microbatches=len(microbatches),
                seq_length=16,
                micro_batch_size=2,
            )
            opt.step()
            if stats:
                losses.append(sum(float(s["loss"]) for s in stats) / len(stats))
        return losses, cpu_compat.recorded_call_sites()
    finally:
        ps.destroy()


@pytest.fixture(scope="module")
def gpt_runs() -> dict[str, list]:
    return {
        "tp1": run_ranks(_gpt_loss, 1, 1, 1234),
        "tp1_again": run_ranks(_gpt_loss, 1, 1, 1234),
        "tp2": run_ranks(_gpt_loss, 2, 2, 1234),
        "tp2pp2": run_ranks(_pipeline_training, 4, 2, 2),
    }


def test_pipeline_schedule_trains(gpt_runs: dict[str, list]) -> None:
    results = gpt_runs["tp2pp2"]
    assert [losses == [] for losses, _ in results] == [True, True, False, False]
    (last, _), (other, _) = results[2], results[3]
    assert last == other  # the two TP shards of the last stage report the same loss
    assert last[0] > last[1] > last[2]  # it learns the fixed batch


def test_gpt_tp2_matches_tp1(gpt_runs: dict[str, list]) -> None:
    (loss1, grad1, _), (again, grad_again, _) = gpt_runs["tp1"][0], gpt_runs["tp1_again"][0]
    assert (loss1, grad1) == (again, grad_again)  # deterministic
    assert 3.0 < loss1 < 7.0  # about ln(128) for a fresh model
    tp2 = gpt_runs["tp2"]
    for loss, grad_sq, _ in tp2:
        assert loss == pytest.approx(loss1, abs=1e-5)
        assert grad_sq > 0
    assert tp2[0][0] == tp2[1][0]


def test_cuda_call_sites_are_known(gpt_runs: dict[str, list]) -> None:
    seen = set().union(*(run[-1] for runs in gpt_runs.values() for run in runs))
    assert seen, "cpu_compat recorded no call site: is it installed?"
    if os.environ.get("DYNAPIPE_WRITE_CALL_SITES") == "1":  # regenerate after review
        CALL_SITES_FILE.write_text("".join(f"{site}\n" for site in sorted(seen)))
    known = set(CALL_SITES_FILE.read_text().split())
    new = sorted(seen - known)
    assert not new, (
        f"megatron-core reaches CUDA at call sites not in {CALL_SITES_FILE.name}: {new}; "
        "check each is safe on CPU, then add it to the file"
    )


def test_cpu_compat_is_idempotent_and_records() -> None:
    def check(rank: int, world: int) -> tuple[bool, bool, str]:
        from megatron.dynapipe import cpu_compat

        first, second = cpu_compat.install(), cpu_compat.install()
        t = torch.zeros(2, device="cuda").cuda().to("cuda")
        torch.cuda.synchronize()
        return first, second, str(t.device)

    assert run_ranks(check, 1)[0] == (True, True, "cpu")
