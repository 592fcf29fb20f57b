"""Heterogeneous training end to end on forked gloo ranks (fp32, no dropout but in the
dropout-resume test).

`--dynamic-strategies` on 4 ranks (candidates proposed at start-up; the tiny memory limit makes
the selector switch between them) trains with the same losses as a single-process reference
that runs every sample of each global batch alone through the whole model and steps AdamW. A
static `--hetero-plan` layout with gradient clipping and weight decay equals the reference
with Megatron's optimiser semantics. A run saved under a static `--hetero-plan` layout and
resumed under `--dynamic-strategies` continues with the uninterrupted run's losses: the
checkpoint holds full fp32 weights and optimiser states, whatever layout wrote it. And
`pretrain_gpt.py --dynamic-strategies` under torchrun trains on 4 CPU ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "128", "--dynamic-micro-batching", "--tokens-per-global-batch", "1024",
    "--data-path", "synthetic:flan", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr", "1e-2", "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0",
    "--log-interval", "1", "--eval-iters", "0",
    "--dynapipe-memory-limit-gib", "0.003", "--planner-workers", "0", "--dynapipe-timeout", "180",
]  # fmt: skip
# The job's timeout also bounds a save's Megatron export (a fresh interpreter: about 13 CPU-s of
# imports alone), which on a loaded 2-core machine took more than 60 s; the tests' own limit is
# 240 s (`run_ranks`).
DYNAMIC = [*TINY, "--dynamic-strategies"]
HETERO_PLAN = {
    "replicas": [
        {
            "stages": [
                {"devices": [0, 1], "tp": 2, "layers": [0, 2]},
                {"devices": [2], "tp": 1, "layers": [2, 4]},
            ],
            "batch_fraction": 0.75,
        },
        {"stages": [{"devices": [3], "tp": 1, "layers": [0, 4]}], "batch_fraction": 0.25},
    ]
}
ITERATIONS = 3


def _reference(rank: int, world: int, argv: list[str], iterations: int):
    """The whole model on one rank, each batch's samples alone: (initial weights, losses)."""
    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.data.datasets import datasets
    from megatron.dynapipe.iterations import global_batch_sampler
    from megatron.dynapipe.layouts.training import hetero_job
    from megatron.dynapipe.model import build_stage_model

    args = parse_args(argv)
    dataset = datasets(args).train
    spec = hetero_job(args, dataset.vocab_size, dataset.lengths(), 4).spec
    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        _, model = build_stage_model(args, spec.vocab_size)
        weights = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        flat = [p for n, p in model.named_parameters() if p.dim() == 1 or n.endswith(".bias")]
        rest = [p for n, p in model.named_parameters() if not (p.dim() == 1 or n.endswith(".bias"))]
        optimizer = torch.optim.AdamW(
            [{"params": rest}, {"params": flat, "weight_decay": 0.0}],
            lr=args.lr,
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
        )
        sampler = global_batch_sampler(args, dataset.lengths())
        losses = []
        for _ in range(iterations):
            _, batch = next(sampler)
            optimizer.zero_grad()
            total, tokens = torch.zeros(()), 0
            for i in batch:
                t = torch.as_tensor(dataset.tokens(int(i)), dtype=torch.int64)[None]
                n = t.shape[1] - 1
                mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1)
                total = total + model(t[:, :-1], torch.arange(n)[None], mask, labels=t[:, 1:]).sum()
                tokens += n
            loss = total / tokens
            loss.backward()
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            losses.append(float(loss))
        return weights, losses
    finally:
        ps.destroy()


def _train(rank: int, world: int, argv: list[str], weights: dict):
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.layouts.training import pretrain_hetero

    names: list[str] = []
    losses = pretrain_hetero(parse_args(argv), initial_weights=weights, strategies_out=names)
    return losses, names


@pytest.fixture(scope="module")
def reference():
    argv = [*DYNAMIC, "--train-iters", str(ITERATIONS)]
    return run_ranks(_reference, 1, argv, ITERATIONS, timeout_s=120)[0]


@pytest.fixture(scope="module")
def uninterrupted(reference):
    weights, _ = reference
    argv = [*DYNAMIC, "--train-iters", str(ITERATIONS)]
    return run_ranks(_train, 4, argv, weights, timeout_s=240)[0]


def test_dynamic_strategies_equal_the_reference(reference, uninterrupted) -> None:
    _, ref_losses = reference
    losses, names = uninterrupted
    assert len(set(names)) >= 2, f"the selector never switched: {names}"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]


def test_dynamic_strategies_know_the_emulated_speeds() -> None:
    """With ranks 2 and 3 emulated 2x slower, the candidates are typed by speed class (each
    class filled with pipelines of one scheme, laid out on its own ranks) and training still
    equals the reference."""
    argv = [*DYNAMIC, "--train-iters", str(ITERATIONS), "--device-speed", "2:2,3:2"]
    # Its own reference: TP1 candidates pad the vocabulary less than the proposals' TP4.
    weights, ref_losses = run_ranks(_reference, 1, argv, ITERATIONS, timeout_s=120)[0]
    losses, names = run_ranks(_train, 4, argv, weights, timeout_s=240)[0]
    assert all("/2x" in name for name in names), names  # the slow class is in every strategy
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_one_cached_stage_model_trains_like_all(reference) -> None:
    """`--max-cached-strategies 1` rebuilds a stage model at every switch; the pulls refill
    it, so the losses are the reference's, and `--overlap-pull-push` changes nothing either."""
    weights, ref_losses = reference
    argv = [*DYNAMIC, "--train-iters", str(ITERATIONS), "--max-cached-strategies", "1"]
    losses, names = run_ranks(_train, 4, [*argv, "--overlap-pull-push"], weights)[0]
    assert len(set(names)) >= 2, f"the selector never switched: {names}"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_static_hetero_plan_with_clipping_and_weight_decay_equals_the_reference(
    tmp_path: Path,
) -> None:
    """A static asymmetric layout (TP2 | TP1 + TP1, 75/25 of the tokens) with Megatron's
    optimiser semantics: gradients clipped by their global norm, decoupled weight decay
    sparing biases and norms."""
    import json

    plan = tmp_path / "hetero.json"
    plan.write_text(json.dumps(HETERO_PLAN))
    # Adam barely feels a uniformly scaled gradient; a large eps makes clipping visible (the
    # second loss moves by 5e-4 relative against no clipping).
    argv = [*TINY, "--train-iters", "2", "--clip-grad", "0.5", "--weight-decay", "0.1"]
    argv += ["--adam-eps", "1e-3"]
    weights, ref_losses = run_ranks(_reference, 1, argv, 2, timeout_s=120)[0]
    losses, _ = run_ranks(_train, 4, [*argv, "--hetero-plan", str(plan)], weights)[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_stage_recompute_modes_of_a_plan_file_train_like_the_reference(
    tmp_path: Path, reference
) -> None:
    """Per-stage recomputation named in the `--hetero-plan` file (full on the TP2 stage, none
    after it, selective on the single-stage pipeline) changes memory and time, not the math."""
    import json

    modes = [["full", "none"], ["selective"]]
    plan = json.loads(json.dumps(HETERO_PLAN))
    for rep, mine in zip(plan["replicas"], modes, strict=True):
        for stage, mode in zip(rep["stages"], mine, strict=True):
            stage["recompute"] = mode
    path = tmp_path / "modes.json"
    path.write_text(json.dumps(plan))
    weights, ref_losses = reference
    argv = [*TINY, "--train-iters", str(ITERATIONS), "--hetero-plan", str(path)]
    losses, _ = run_ranks(_train, 4, argv, weights, timeout_s=240)[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.slow
def test_resume_under_another_strategy_set(tmp_path: Path, reference, uninterrupted) -> None:
    import json

    weights, _ = reference
    plan = tmp_path / "hetero.json"
    plan.write_text(json.dumps(HETERO_PLAN))
    ckpt = tmp_path / "ckpt"
    first = [*TINY, "--hetero-plan", str(plan), "--train-iters", "2", "--save", str(ckpt)]
    saved, names = run_ranks(_train, 4, first, weights, timeout_s=240)[0]
    assert names[0].startswith("hetero-plan [TP2:L0-2|TP1:L2-4] + [TP1:L0-4]")
    assert (ckpt / "iter_0000002" / "full_state.pt").exists()
    resume = [*DYNAMIC, "--train-iters", str(ITERATIONS), "--load", str(ckpt)]
    resumed, _ = run_ranks(_train, 4, resume, None, timeout_s=240)[0]
    losses, _ = uninterrupted
    np.testing.assert_allclose(saved, losses[:2], rtol=1e-5)
    np.testing.assert_allclose(resumed, losses[2:], rtol=1e-5)


def _convert(rank: int, world: int, argv: list[str]) -> str:
    import importlib.util

    from megatron.dynapipe.arguments import parse_args

    path = ROOT / "tools" / "checkpoint_to_megatron.py"
    spec = importlib.util.spec_from_file_location("checkpoint_to_megatron", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool.convert(parse_args(argv))


def _homogeneous(rank: int, world: int, argv: list[str]) -> list[float]:
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.training import pretrain

    return pretrain(parse_args(argv))


@pytest.mark.slow
def test_a_dynamic_strategies_run_continues_under_plain_megatron(
    tmp_path: Path, reference, uninterrupted
) -> None:
    """Saved by --dynamic-strategies after 1 iteration, resumed from the same directory by the
    homogeneous loop at PP=2 (the save wrote a Megatron checkpoint beside full_state.pt):
    iterations 2 and 3 train on the same global batches from the same weights, Adam moments and
    step. tools/checkpoint_to_megatron.py writes the same checkpoint from full_state.pt alone."""
    weights, _ = reference
    hetero = tmp_path / "hetero"
    first = [*DYNAMIC, "--train-iters", "1", "--save", str(hetero)]
    run_ranks(_train, 4, first, weights, timeout_s=240)
    assert (hetero / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (hetero / "iter_0000001" / "full_state.pt").is_file()
    assert not list(hetero.glob(".*"))  # the staged full state moved into place
    # The vocabulary padded as the 4-rank heterogeneous job padded it (for TP up to 4).
    homogeneous = [*TINY, "--padded-vocab-size", "512", "--train-iters", str(ITERATIONS)]
    resume = [*homogeneous, "--pipeline-model-parallel-size", "2", "--load", str(hetero)]
    resume.append("--override-opt-param-scheduler")  # the save's schedule ended at iteration 1
    resumed = run_ranks(_homogeneous, 2, resume, timeout_s=240)[0]
    losses, _ = uninterrupted
    np.testing.assert_allclose(resumed, losses[1:], rtol=1e-5)
    converted = tmp_path / "converted"
    convert = [*homogeneous, "--load", str(hetero), "--save", str(converted)]
    line = run_ranks(_convert, 1, convert, timeout_s=120)[0]
    assert line == f"wrote {converted} (iteration 1, Megatron torch_dist)", line
    assert (converted / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_checkpoint_to_megatron_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    """The tool as a program (forked from this process: its imports are done)."""
    from forked_programs import preimport_runtime, run_forked

    assert preimport_runtime()
    tool = ROOT / "tools" / "checkpoint_to_megatron.py"
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = [*TINY, "--train-iters", "1", "--load", str(empty), "--save", str(tmp_path / "out")]
    out = run_forked([tool, *argv], cwd=tmp_path, timeout_s=120)
    assert out.returncode == 2, out.stdout[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("checkpoint_to_megatron.py: error: no checkpoint in "), lines
    assert "Traceback" not in out.stdout and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_resume_continues_the_dropout_streams(tmp_path: Path, reference) -> None:
    """With dropout on, a run saved after 2 iterations and resumed by as many ranks under the
    same layout continues with the uninterrupted run's third loss: every rank's default
    generator and TP RNG tracker (the TP2 stage's attention dropout) come back."""
    import json

    weights, _ = reference
    plan = tmp_path / "hetero.json"
    plan.write_text(json.dumps(HETERO_PLAN))
    argv = [*TINY, "--hetero-plan", str(plan), "--hidden-dropout", "0.1"]
    argv += ["--attention-dropout", "0.1"]
    whole, _ = run_ranks(_train, 4, [*argv, "--train-iters", "3"], weights, timeout_s=240)[0]
    ckpt = tmp_path / "ckpt"
    first = [*argv, "--train-iters", "2", "--save", str(ckpt)]
    saved, _ = run_ranks(_train, 4, first, weights, timeout_s=240)[0]
    resume = [*argv, "--train-iters", "3", "--load", str(ckpt)]
    resumed, _ = run_ranks(_train, 4, resume, None, timeout_s=240)[0]
    np.testing.assert_allclose(saved, whole[:2], rtol=1e-6)
    np.testing.assert_allclose(resumed, whole[2:], rtol=1e-6)


def test_pretrain_gpt_dynamic_strategies(capfd) -> None:
    """The real entry point on 4 forked ranks (torchrun's own start: test_training.py), a
    planner worker, two emulated slow ranks (candidates typed by speed class); each iteration's
    line names its strategy, the selector switches, and the loss falls."""
    import re

    from distributed import program_exit_status

    root = ROOT
    at = DYNAMIC.index("--planner-workers")
    argv = DYNAMIC[:at] + DYNAMIC[at + 2 :]  # plan in a worker process, as by default
    argv += ["--train-iters", "4", "--device-speed", "2:2,3:2"]
    program = str(root / "pretrain_gpt.py")
    assert run_ranks(program_exit_status, 4, program, argv, timeout_s=300) == [0] * 4
    stdout = capfd.readouterr().out
    lines = [line for line in stdout.splitlines() if "| lm loss" in line]
    assert len(lines) == 4 and "iteration 4/4" in lines[-1], stdout
    strategies = [re.search(r"\| strategy (.+?) \|", line).group(1) for line in lines]
    assert len(set(strategies)) >= 2, stdout
    losses = [float(re.search(r"lm loss ([\d.]+)", line).group(1)) for line in lines]
    assert losses[-1] < losses[0], stdout
    assert "pull" in lines[0] and "push" in lines[0] and "tokens/s" in lines[0]


class _Payload:
    """A pickle that runs a command when unpickled without weights_only (the test checks
    that loading refuses it instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_checkpoint_is_refused_not_run(tmp_path: Path) -> None:
    from megatron.dynapipe.checkpointing import CheckpointError
    from megatron.dynapipe.layouts import checkpointing

    marker = tmp_path / "ran"
    shard = tmp_path / "ckpt" / "iter_0000001" / "full_state.pt"
    shard.parent.mkdir(parents=True)
    # Written as a save writes it, checksum included: a checksum proves no authorship.
    checkpointing.save_atomically({"format": checkpointing.FORMAT, "x": _Payload(marker)}, shard)
    checkpointing.mark_latest(tmp_path / "ckpt", 1)
    with pytest.raises(CheckpointError, match=rf"{shard} is corrupt"):
        checkpointing.read(tmp_path / "ckpt")
    assert not marker.exists()


def test_a_flipped_byte_in_a_full_state_checkpoint_is_named(tmp_path: Path) -> None:
    from megatron.dynapipe.checkpointing import CheckpointError
    from megatron.dynapipe.layouts import checkpointing

    shard = tmp_path / "ckpt" / "iter_0000001" / "full_state.pt"
    shard.parent.mkdir(parents=True)
    payload = {"format": checkpointing.FORMAT, "iteration": 1, "w": torch.arange(1000.0)}
    checkpointing.save_atomically(payload, shard)
    checkpointing.mark_latest(tmp_path / "ckpt", 1)
    assert checkpointing.read(tmp_path / "ckpt").payload["iteration"] == 1
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard} is corrupt: its SHA-256 differs"):
        checkpointing.read(tmp_path / "ckpt")


class _Killed(BaseException):
    """Stands for the process dying at that point of a save."""


def _saves_then_dies_exporting(rank: int, world: int, directory: Path) -> None:
    """Saves iteration 1 whole, then iteration 2 until its Megatron export has written part of
    `iter_0000002/` and the process dies (one rank: the gather and barrier are its own)."""
    from megatron.dynapipe.checkpointing import TrainState
    from megatron.dynapipe.layouts import checkpointing

    class Optimizer:
        def full_state_dict(self, dst: int) -> dict:
            return {"w": {"param": torch.arange(10.0)}}

    class Sampler:
        def state_dict(self) -> dict:
            return {"position": 0}

    def dying_export(staged: Path) -> None:
        (directory / "iter_0000002").mkdir()
        (directory / "iter_0000002" / "__0_0.distcp").write_bytes(b"part of a shard")
        os._exit(1)

    checkpointing.save(directory, TrainState(1), Optimizer(), Sampler())
    checkpointing.save(directory, TrainState(2), Optimizer(), Sampler(), dying_export)


def test_the_next_run_removes_what_a_killed_full_state_save_left(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A save killed while Megatron's export writes leaves the staged `full_state.pt` and its
    checksum beside a partial `iter_0000002/`; one killed before the marker's rename leaves
    `latest_iteration.tmp`. The next run's clean-up removes them, a warning line each, and the
    checkpoint in force still reads."""
    from megatron.dynapipe.layouts import checkpointing

    ckpt = tmp_path / "ckpt"
    run_ranks(_saves_then_dies_exporting, 1, ckpt, timeout_s=60, may_die={0})
    staged = [".iter_0000002.full_state.pt", ".iter_0000002.full_state.pt.sha256"]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        *staged,
        "iter_0000001",
        "iter_0000002",
        "latest_iteration.txt",
    ]

    def killed(*args) -> None:
        raise _Killed

    with monkeypatch.context() as m, pytest.raises(_Killed):
        m.setattr(checkpointing.os, "replace", killed)
        checkpointing.mark_latest(ckpt, 2)
    assert (ckpt / "latest_iteration.tmp").exists()
    checkpointing.remove_interrupted_saves(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000001", "latest_iteration.txt"]
    assert capsys.readouterr().err.splitlines() == [
        f"removed {ckpt / name}: a save interrupted before it was complete"
        for name in [*staged, "iter_0000002"]
    ]
    assert checkpointing.read(ckpt).payload["iteration"] == 1
