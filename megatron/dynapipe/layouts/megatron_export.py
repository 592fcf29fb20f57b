"""A heterogeneous job's layout-independent checkpoint written again as a Megatron-LM checkpoint.

`full_state.pt` holds every parameter whole in its TP=1 layout with its AdamW moments (seed
`hydraulis.txt` §5.2). `export` builds the same model once, unpipelined, with Megatron's own
builder, optimiser and LR schedule, puts the saved weights and moments into them and lets
Megatron's `save_checkpoint` write the checkpoint (`--ckpt-format`), with DynaPipe's data
position in the saved arguments; `pretrain_gpt.py` or a Megatron-LM program resumes from it
under any homogeneous TP/PP layout.

Megatron's checkpoint writer works on megatron-core's global process groups, which a
heterogeneous job leaves unset (its groups are per-strategy collections, `layout_groups`), so a
running job exports in a child process of one rank with groups of its own (`export_in_child`);
`tools/checkpoint_to_megatron.py` runs `export` for a saved checkpoint. Either holds the whole
model in one process, on the CPU, as the heterogeneous save's rank 0 already does.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from pathlib import Path

import torch

from ..checkpointing import CheckpointError
from ..world_of_one import WORLD_OF_ONE
from . import checkpointing as hetero_checkpointing
from .switch import fit_vocab_rows


def cannot_export(args: argparse.Namespace) -> str | None:
    """Why `args` describe a job whose checkpoint cannot be written in Megatron's format here,
    or None."""
    if args.fp16 or args.bf16 or args.use_distributed_optimizer:
        return (
            "--fp16/--bf16/--use-distributed-optimizer: the export writes fp32 weights and Adam "
            "moments of Megatron's plain optimiser"
        )
    return None


def one_process_group() -> None:
    """torch.distributed with this process alone (Megatron's save is written collectively)."""
    import torch.distributed as dist

    os.environ.update(WORLD_OF_ONE)
    dist.init_process_group("gloo")


def export(args: argparse.Namespace, saved: hetero_checkpointing.FullCheckpoint, vocab: int) -> str:
    """Write `saved` to `args.save` as a Megatron checkpoint of the model `args` describe, with
    a vocabulary of `vocab` rows; returns the line to print. Needs a one-rank process group."""
    from .. import checkpointing, cpu_compat
    from .. import parallel_state as ps
    from ..stage import stage_in_ddp

    why_not = cannot_export(args)
    if why_not:
        raise CheckpointError(f"cannot write a Megatron checkpoint: {why_not}")
    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        _, model, optimizer, scheduler = stage_in_ddp(args, vocab)
        notes = _copy_state(saved, model.module, optimizer)
        state = saved.state
        scheduler.step(increment=state.iteration * args.global_batch_size)
        checkpointing.save(args, state, model, optimizer, scheduler, saved.sampler_state)
        checkpointing.release_writer_processes()
    finally:
        ps.destroy()
    done = f"wrote {args.save} (iteration {state.iteration}, Megatron {args.ckpt_format})"
    return "; ".join([done, *notes])


def _copy_state(
    saved: hetero_checkpointing.FullCheckpoint, model: torch.nn.Module, optimizer
) -> list[str]:
    """The saved weights and AdamW moments into Megatron's model and optimiser; the vocabulary's
    padding rows fitted (a note says so)."""
    full = saved.payload["optimizer"]
    params = dict(model.named_parameters())
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    adam_of = {id(p): o for o in inner for group in o.param_groups for p in group["params"]}
    notes = fit_vocab_rows(full, {name: tuple(p.shape) for name, p in params.items()})
    missing = sorted(set(params) - set(full))
    if missing:
        raise CheckpointError(
            f"{saved.path} lacks parameter(s) {missing[:3]} of the model these flags build"
        )
    with torch.no_grad():
        for name, param in params.items():
            if tuple(full[name]["param"].shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{saved.path}: {name} is {tuple(full[name]['param'].shape)}, the model "
                    f"these flags build has {tuple(param.shape)}"
                )
            param.copy_(full[name]["param"])
            adam_of[id(param)].state[param] = {
                "step": torch.as_tensor(float(full[name]["step"])),
                "exp_avg": full[name]["exp_avg"].float().clone(),
                "exp_avg_sq": full[name]["exp_avg_sq"].float().clone(),
            }
    return notes


def _one_rank_args(args: argparse.Namespace, directory: Path) -> argparse.Namespace:
    """The job's flags as one unpipelined rank that writes to `directory`."""
    one = argparse.Namespace(**vars(args))
    one.rank = one.local_rank = 0
    one.world_size = one.data_parallel_size = 1
    one.tensor_model_parallel_size = one.pipeline_model_parallel_size = 1
    one.dynamic_strategies, one.hetero_plan, one.device_speed = False, None, None
    one.save, one.load = str(directory), None
    return one


def _child(args: argparse.Namespace, path: str, vocab: int) -> None:
    """The export child's body: one rank, the checkpoint at `path`, one line on failure."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        one_process_group()
        saved = hetero_checkpointing.FullCheckpoint(
            Path(path), hetero_checkpointing.load_payload(Path(path), "checkpoint")
        )
        export(args, saved, vocab)
    except CheckpointError as error:
        print(f"Megatron export: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def export_in_child(
    args: argparse.Namespace, path: Path, directory: Path, vocab: int, timeout_s: float
) -> None:
    """Export the checkpoint at `path` into `directory` as a Megatron checkpoint (tracker file
    included), from a fresh one-rank process within `timeout_s` (the job's timeout); a failure
    is a CheckpointError naming `path`."""
    child = multiprocessing.get_context("spawn").Process(
        target=_child, args=(_one_rank_args(args, directory), str(path), vocab)
    )
    child.start()
    child.join(timeout_s)
    if child.is_alive():  # bounded by the job's timeout, as every wait of the job is
        child.kill()
        child.join()
        raise CheckpointError(
            f"writing {path} as a Megatron checkpoint in {directory} took more than "
            f"--dynapipe-timeout ({timeout_s:g} s); the layout-independent "
            "checkpoint is kept"
        )
    if child.exitcode != 0:
        raise CheckpointError(
            f"writing {path} as a Megatron checkpoint in {directory} failed (exit status "
            f"{child.exitcode}); the layout-independent checkpoint is kept"
        )
