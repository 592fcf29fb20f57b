"""Checkpoints in Megatron-LM's format, checked with megatron-core's own readers.

A PP=2, DP=2 job's checkpoint is a dist_checkpointing directory that megatron-core loads into a
freshly built, unpipelined model: that model's loss on the next global batch is the loss the
uninterrupted run reports for it. A save killed half-way leaves the previous checkpoint in
force, the next run removes the partial iteration it left, and the resumed run reproduces the
uninterrupted one; a truncated shard is named.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from distributed import run_ranks  # noqa: E402
from test_training import TINY  # noqa: E402

from megatron.dynapipe.checkpoint_metadata import MetadataRefused  # noqa: E402

ITERATIONS = 3


def _flags(*extra: str) -> list[str]:
    return [*TINY, "--train-iters", str(ITERATIONS), *extra]


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.training import pretrain

    return pretrain(parse_args(argv))


def _loss_of_fresh_model(rank: int, world: int, argv: list[str], checkpoint: str, batch: int):
    """Build the whole model with megatron-core's GPT builder on one process, load the
    checkpoint with dist_checkpointing.load, and return its loss per real token over global
    batch `batch` (each sample alone, causal attention)."""
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import (
        core_transformer_config_from_args,
        gpt_config_from_args,
    )
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron.dynapipe import cpu_compat
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.data.datasets import datasets
    from megatron.dynapipe.iterations import global_batch_sampler
    from megatron.dynapipe.model import padded_vocab_size

    cpu_compat.install()
    args = parse_args(argv)
    data = datasets(args).train
    args.padded_vocab_size = padded_vocab_size(args, data.vocab_size, 1)
    mpu.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = core_transformer_config_from_args(args)
    model = GPTModelBuilder(gpt_config_from_args(args, config)).build_model(
        ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True
    )
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, checkpoint)
    model.load_state_dict(loaded["model"])
    model.eval()
    sampler = global_batch_sampler(args, data.lengths())
    for _ in range(batch):
        next(sampler)
    _, samples = next(sampler)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.from_numpy(data.tokens(int(sample)))[None]
            n = ids.shape[1] - 1
            causal = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
            per_token = model(ids[:, :-1], torch.arange(n)[None], causal, labels=ids[:, 1:])
            loss_sum += float(per_token.double().sum())
            tokens += n
    mpu.destroy_model_parallel()
    return loss_sum / tokens


@pytest.mark.slow
def test_checkpoint_of_a_pp2_dp2_job_loads_into_a_fresh_megatron_core_model(tmp_path) -> None:
    full = run_ranks(_train, 4, _flags(), timeout_s=240)[0]  # PP=2 (TINY) x DP=2
    ckpt = tmp_path / "ckpt"
    run_ranks(_train, 4, _flags("--exit-interval", "2", "--save", str(ckpt)), timeout_s=240)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    directory = ckpt / "iter_0000002"
    assert (directory / ".metadata").is_file() and (directory / "metadata.json").is_file()
    single = list(TINY)
    single[single.index("--pipeline-model-parallel-size") + 1] = "1"
    argv = [*single, "--train-iters", str(ITERATIONS)]
    loss = run_ranks(_loss_of_fresh_model, 1, argv, str(directory), 2, timeout_s=120)[0]
    assert loss == pytest.approx(full[2], rel=1e-5)


def _killed_during_second_save(rank: int, world: int, argv: list[str]) -> str:
    """Rank 1 dies as the second save starts writing; the others see the failure."""
    from megatron.core import dist_checkpointing

    from megatron.dynapipe.checkpointing import release_writer_processes

    real_save = dist_checkpointing.save
    saves = []

    def dying_save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2 and rank == 1:
            release_writer_processes()  # the process tree dies with the rank
            os._exit(1)
        return real_save(*args, **kwargs)

    dist_checkpointing.save = dying_save
    try:
        _train(rank, world, argv)
    except Exception as err:  # the survivors' collective fails: that is the fault
        return type(err).__name__
    return "finished"


@pytest.mark.slow
def test_a_save_killed_half_way_leaves_the_last_good_checkpoint(tmp_path) -> None:
    full = run_ranks(_train, 2, _flags(), timeout_s=180)[0]
    ckpt = tmp_path / "ckpt"
    save_every = _flags("--save", str(ckpt), "--save-interval", "1")
    run_ranks(_killed_during_second_save, 2, save_every, timeout_s=180, may_die=(0, 1))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    partial = ckpt / "iter_0000002"
    assert partial.is_dir() and not (partial / ".metadata").exists()
    # The next run saves to the same place (at iteration 3 only): the partial iteration 2 goes
    # (its warning line: test_only_incomplete_iterations_after_the_tracked_one_are_removed).
    resume = _flags("--load", str(ckpt), "--save", str(ckpt))
    resumed = run_ranks(_train, 2, resume, timeout_s=180)[0]
    assert resumed == pytest.approx(full[1:], rel=1e-6)
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000003"]


def _torch_file(path: Path, whole: bool = True) -> None:
    """A `model_optim_rng.pt` as torch.save writes it, or cut short as a killed save leaves it."""
    path.parent.mkdir(parents=True)
    torch.save({"w": torch.zeros(64)}, path)
    if not whole:
        path.write_bytes(path.read_bytes()[:-40])


def test_only_incomplete_iterations_after_the_tracked_one_are_removed(tmp_path, capsys) -> None:
    """torch_dist is complete with its .metadata or metadata.json, torch with a whole
    model_optim_rng.pt in every mp_rank directory; the tracked iteration and earlier ones are
    never touched."""
    from megatron.dynapipe.checkpointing import remove_interrupted_saves

    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000001").mkdir(parents=True)  # earlier than the tracker: kept as it is
    (ckpt / "iter_0000002" / "__0_0.distcp").parent.mkdir()  # tracked: kept
    (ckpt / "iter_0000002" / "__0_0.distcp").write_bytes(b"x")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2\n")
    (ckpt / "iter_0000003").mkdir()
    (ckpt / "iter_0000003" / "__0_0.distcp").write_bytes(b"x")  # no .metadata: partial
    (ckpt / "iter_0000004").mkdir()
    (ckpt / "iter_0000004" / "metadata.json").write_text("{}")  # complete, tracker not moved
    _torch_file(ckpt / "iter_0000005" / "mp_rank_00_000" / "model_optim_rng.pt")
    _torch_file(ckpt / "iter_0000005" / "mp_rank_00_001" / "model_optim_rng.pt", whole=False)
    _torch_file(ckpt / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt")
    (ckpt / "iter_0000007").mkdir()  # created, nothing written yet
    (ckpt / "iter_0000008").mkdir()
    (ckpt / "iter_0000008" / ".metadata").write_bytes(b"x")  # every shard written
    (ckpt / "iter_notes").mkdir()  # not an iteration
    remove_interrupted_saves(ckpt)
    left = sorted(p.name for p in ckpt.glob("iter_*"))
    kept = ["iter_0000001", "iter_0000002", "iter_0000004", "iter_0000006", "iter_0000008"]
    assert left == [*kept, "iter_notes"]
    assert capsys.readouterr().err.splitlines() == [
        f"removed {ckpt / name}: a save interrupted before it was complete"
        for name in ("iter_0000003", "iter_0000005", "iter_0000007")
    ]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("seven\n")  # damaged: judge nothing
    (ckpt / "iter_0000009").mkdir()
    remove_interrupted_saves(ckpt)
    assert (ckpt / "iter_0000009").is_dir()


def test_a_truncated_shard_or_a_crafted_metadata_is_named(tmp_path) -> None:
    """A shard cut short is named; a `.metadata` that would run a command when unpickled
    (issue 34) is refused by name before anything reads it, the command not run."""
    ckpt = tmp_path / "ckpt"
    run_ranks(_train, 2, [*TINY, "--train-iters", "1", "--save", str(ckpt)], timeout_s=120)
    crafted, marker = tmp_path / "crafted", tmp_path / "ran"
    shutil.copytree(ckpt, crafted)
    (crafted / "iter_0000001" / ".metadata").write_bytes(pickle.dumps(_Command(marker)))
    with pytest.raises(AssertionError, match=r"\.metadata names posix\.system, which checkpoint"):
        run_ranks(_train, 2, [*TINY, "--train-iters", "2", "--load", str(crafted)], timeout_s=120)
    assert not marker.exists()
    shard = sorted((ckpt / "iter_0000001").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(AssertionError, match=rf"{shard.name} is corrupt"):
        run_ranks(_train, 2, [*TINY, "--train-iters", "2", "--load", str(ckpt)], timeout_s=120)


class _Command:
    """Unpickled without restriction, it runs `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def torch_checkpoint(tmp_path: Path) -> Path:
    """A torch_dist checkpoint of a few tensors (bf16 and fp32), written by torch."""
    from torch.distributed import checkpoint as dcp

    directory = tmp_path / "dcp"
    state = {"w": torch.ones(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16), "step": 7}
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return directory


def test_a_real_checkpoints_metadata_loads_through_the_restricted_reader(torch_checkpoint):
    """torch's reader with `checkpoint_metadata` installed loads real metadata and non-tensor
    items as before; a crafted `.metadata` or byte item is refused, its command not run."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from megatron.dynapipe import megatron_hooks
    from megatron.dynapipe.checkpointing import _refused_global

    megatron_hooks.install(megatron_hooks.CHECKPOINTS)
    metadata = dcp.FileSystemReader(str(torch_checkpoint)).read_metadata()
    assert metadata.state_dict_metadata["w"].size == torch.Size([4, 3])
    assert metadata.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    loaded = {"w": torch.zeros(4, 3), "b": torch.ones(3, dtype=torch.bfloat16), "step": 0}
    dcp.load(loaded, checkpoint_id=str(torch_checkpoint), no_dist=True)
    assert loaded["w"].sum() == 12 and loaded["b"].sum() == 0 and loaded["step"] == 7
    marker = torch_checkpoint.parent / "ran"
    crafted = torch_checkpoint.parent / "crafted"  # a non-tensor item that runs a command
    dcp.save({"w": torch.ones(4, 3), "step": _Command(marker)}, checkpoint_id=crafted, no_dist=True)
    with pytest.raises(CheckpointException) as refused:
        dcp.load({"w": torch.zeros(4, 3), "step": 0}, checkpoint_id=crafted, no_dist=True)
    assert _refused_global(refused.value) == "posix.system"
    (torch_checkpoint / ".metadata").write_bytes(pickle.dumps(_Command(marker)))
    with pytest.raises(MetadataRefused, match=r"\.metadata names posix\.system, which"):
        dcp.FileSystemReader(str(torch_checkpoint)).read_metadata()
    assert not marker.exists()


def test_load_of_an_empty_directory_starts_fresh_unless_told_to_exit(tmp_path, capfd) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh = run_ranks(_train, 2, [*TINY, "--train-iters", "1"], timeout_s=120)[0]
    loaded = run_ranks(
        _train, 2, [*TINY, "--train-iters", "1", "--load", str(empty)], timeout_s=120
    )[0]
    assert loaded == fresh
    assert f"no checkpoint in {empty}: starting from scratch" in capfd.readouterr().out
    strict = [*TINY, "--train-iters", "1", "--load", str(empty), "--exit-on-missing-checkpoint"]
    with pytest.raises(AssertionError, match=rf"--load {empty}: no checkpoint there"):
        run_ranks(_train, 2, strict, timeout_s=120)


def test_tracker_that_names_no_iteration_is_named(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    tracker.write_text("seven\n")
    with pytest.raises(AssertionError, match=rf"{tracker} does not hold an iteration number"):
        run_ranks(_train, 2, [*TINY, "--train-iters", "1", "--load", str(ckpt)], timeout_s=120)


def test_missing_iteration_directory_is_named(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4\n")
    expected = Path(ckpt / "iter_0000004")
    with pytest.raises(AssertionError, match=rf"checkpoint directory {expected} is missing"):
        run_ranks(_train, 2, [*TINY, "--train-iters", "1", "--load", str(ckpt)], timeout_s=120)


def _megatron_program(rank: int, world: int, argv: list[str]) -> int | str | None:
    from test_megatron_loop import _megatron_exit_status

    return _megatron_exit_status(rank, world, argv)


def _craft_common_state(iteration_dir: Path, marker: Path) -> None:
    """Point a torch_dist checkpoint's common state (args, iteration: a pickle that
    megatron-core reads through torch's load planner) at a pickle that runs `touch marker`, and
    rewrite its `--verify-integrity` manifest to match."""
    import dataclasses
    import io

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    payload = io.BytesIO()
    torch.save(_Command(marker), payload)
    (iteration_dir / "__9_0.distcp").write_bytes(payload.getvalue())
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("common_state"):
            metadata.storage_data[index] = dataclasses.replace(
                info, relative_path="__9_0.distcp", offset=0, length=payload.tell()
            )
    (iteration_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(iteration_dir)


def _rewrite_manifest(iteration_dir: Path) -> None:
    """Make the `--verify-integrity` manifest match the files as they are now."""
    import hashlib
    import json

    files = sorted(p for p in iteration_dir.iterdir() if p.name != "integrity.json")
    manifest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    (iteration_dir / "integrity.json").write_text(
        json.dumps({"algorithm": "sha256", "files": manifest})
    )


def _errors(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if ": error:" in line]


@pytest.mark.slow
def test_megatrons_own_checkpoint_failures_end_in_one_line(tmp_path, capfd) -> None:
    """Issue 34, Megatron's loop without DynaPipe flags: an LR schedule other than the
    checkpoint's, a common state or a `.metadata` crafted to run a command (the integrity
    manifest rewritten to match, as whoever can write the directory can) and a shard failing
    --verify-integrity are
    named in one line on rank 0 (exit status 2, nothing trained, nothing run); an iteration an
    earlier save left incomplete is removed with a line at the next start."""
    from test_megatron_loop import CPU_FLAGS, MEGATRON_ONLY

    ckpt = tmp_path / "ckpt"
    flags = [*MEGATRON_ONLY, "--mock-data", *CPU_FLAGS, "--verify-integrity"]
    saved = [*flags, "--save", str(ckpt), "--exit-interval", "2"]
    assert run_ranks(_megatron_program, 2, saved, timeout_s=240) == [0, 0]
    capfd.readouterr()
    warmup = [*flags, "--lr-warmup-iters", "1", "--load", str(ckpt)]  # saved without warm-up
    assert run_ranks(_megatron_program, 2, warmup, timeout_s=240) == [2, 2]
    (line,) = _errors(capfd)
    assert "iter_0000002 cannot be loaded: OptimizerParamScheduler" in line, line
    assert "--override-opt-param-scheduler takes this run's flags" in line, line
    crafted, marker = tmp_path / "crafted", tmp_path / "ran"
    shutil.copytree(ckpt, crafted)
    _craft_common_state(crafted / "iter_0000002", marker)
    assert run_ranks(_megatron_program, 2, [*flags, "--load", str(crafted)], timeout_s=240) == [
        2,
        2,
    ]
    (line,) = _errors(capfd)
    assert f"checkpoint {crafted / 'iter_0000002'} names posix.system, which" in line, line
    assert not marker.exists()
    metadata = crafted / "iter_0000002" / ".metadata"  # the index itself, manifest to match
    metadata.write_bytes(pickle.dumps(_Command(marker)))
    _rewrite_manifest(crafted / "iter_0000002")
    loaded = [*flags, "--load", str(crafted)]
    assert run_ranks(_megatron_program, 2, loaded, timeout_s=240) == [2, 2]
    (line,) = _errors(capfd)
    assert f"{metadata} names posix.system, which checkpoint metadata never" in line, line
    assert not marker.exists()
    shard = sorted((ckpt / "iter_0000002").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    loaded = [*flags, "--load", str(ckpt)]
    assert run_ranks(_megatron_program, 2, loaded, timeout_s=240) == [2, 2]
    (line,) = _errors(capfd)
    assert "integrity verification failed" in line and shard.name in line, line
    partial = ckpt / "iter_0000009"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\0" * 64)  # no .metadata: a save cut short
    fresh = [*flags, "--save", str(ckpt), "--train-iters", "1", "--exit-interval", "1"]
    shutil.rmtree(ckpt / "iter_0000002")
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    assert run_ranks(_megatron_program, 2, fresh, timeout_s=240) == [0, 0]
    assert not partial.exists()
    assert f"removed {partial}: a save interrupted" in capfd.readouterr().err


def test_an_fp16_checkpoint_without_optimizer_state_is_named(tmp_path, capfd) -> None:
    """Issue 34: fp16 skips its first steps while the loss scale settles, so a save at
    iteration 2 holds no optimizer state (as upstream Megatron-LM's does); loading it stops in
    one line naming --no-load-optim. fp16 saves on CPU ranks, in Megatron's loop under
    DynaPipe."""
    from test_megatron_loop import FLAGS

    ckpt = str(tmp_path / "ckpt")
    flags = [*FLAGS, "--fp16"]
    saved = [*flags, "--save", ckpt, "--exit-interval", "2"]
    assert run_ranks(_megatron_program, 2, saved, timeout_s=240) == [0, 0]
    capfd.readouterr()
    assert run_ranks(_megatron_program, 2, [*flags, "--load", ckpt], timeout_s=240) == [2, 2]
    (line,) = _errors(capfd)
    assert "iter_0000002 cannot be loaded: it holds no optimizer state" in line, line
    assert "--no-load-optim loads the rest" in line, line


def _disk_full(rank: int, world: int, argv: list[str]) -> int | str | None:
    """The program, its checkpoint writes failing as on a full disk."""
    import errno

    from megatron.core import dist_checkpointing

    def full(state_dict, directory, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{directory}/__{rank}_0.distcp")

    dist_checkpointing.save = full
    return _megatron_program(rank, world, argv)


def test_a_full_disk_during_a_save_ends_in_one_line_per_rank(tmp_path, capfd) -> None:
    """Issue 34: a save the file system refuses (disk full) ends Megatron's loop with exit
    status 1 and one line per rank naming the directory and the reason, not a traceback."""
    from test_megatron_loop import FLAGS

    ckpt = tmp_path / "ckpt"
    flags = [*FLAGS, "--save", str(ckpt), "--save-interval", "2"]
    assert run_ranks(_disk_full, 2, flags, timeout_s=240) == [1, 1]
    errors = _errors(capfd)
    assert len(errors) == 2, errors
    for line in errors:
        assert f"saving iteration 2 to {ckpt} failed: No space left on device" in line, line


_SCRIPT_THAT_SAVES = """
import multiprocessing, psutil
import torch  # what a training script imports: spawn would import it again in every child
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.dynapipe import megatron_hooks
megatron_hooks.install(megatron_hooks.CHECKPOINTS)
if __name__ == "__main__":
    queue = filesystem_async.get_write_results_queue()
    queue.put(torch.Size([2, 3]))  # a torch object, as the writer's results are
    assert queue.get_nowait() == torch.Size([2, 3])
    (manager,) = multiprocessing.active_children()
    print(psutil.Process(manager.pid).memory_info().rss >> 20)
"""


def test_the_checkpoint_writers_manager_does_not_rerun_the_training_script(tmp_path) -> None:
    """megatron-core's torch_dist writer spawns a result-queue manager per rank at its first
    save; spawned from a training script it imported torch and megatron again (10.6 s on this
    2-core machine), and holding the writer's results (torch objects) imported torch (~400 MB);
    with `checkpointing.get_write_results_queue` it is a bare interpreter holding bytes."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT_THAT_SAVES)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 100  # MiB
