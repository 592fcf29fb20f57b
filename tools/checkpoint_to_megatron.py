"""Turn a heterogeneous job's layout-independent checkpoint into a Megatron-LM checkpoint.

    python tools/checkpoint_to_megatron.py --load hetero_ckpt --save megatron_ckpt \\
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 1024 ...

`--dynamic-strategies` and `--hetero-plan` jobs save `iter_NNNNNNN/full_state.pt`: every
parameter whole in its TP=1 layout with its AdamW moments (seed `hydraulis.txt` §5.2). This
tool builds the same model once, unpipelined, with Megatron's own builder, optimiser and LR
schedule (given the same Megatron flags as the run), puts the saved weights and moments into
them, and lets Megatron's `save_checkpoint` write the checkpoint (`--ckpt-format torch_dist`
by default), with DynaPipe's data position in the saved arguments. `pretrain_gpt.py` or a
Megatron-LM program then resumes from it under any homogeneous TP/PP layout.

One process, on the CPU, holding the whole model (as the heterogeneous save's rank 0 did). Bad
input ends with exit status 2 and one line.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence

import torch


def _one_process_group() -> None:
    """torch.distributed with this process alone (Megatron's save is written collectively)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def convert(argv: Sequence[str]) -> str:
    """Convert; returns the line to print."""
    from megatron.dynapipe import checkpointing, cpu_compat
    from megatron.dynapipe import parallel_state as ps
    from megatron.dynapipe.arguments import ArgumentError, parse_args
    from megatron.dynapipe.hetero import checkpointing as hetero_checkpointing
    from megatron.dynapipe.hetero.switch import fit_vocab_rows
    from megatron.dynapipe.model import padded_vocab_size
    from megatron.dynapipe.training import _model_and_optimizer, datasets

    args = parse_args(argv)
    if not args.load or not args.save:
        raise ArgumentError("give --load (the full_state.pt checkpoint) and --save")
    if args.fp16 or args.bf16 or args.use_distributed_optimizer:
        raise ArgumentError(
            "--fp16/--bf16/--use-distributed-optimizer: the conversion writes fp32 weights and "
            "Adam moments of Megatron's plain optimiser; convert without them"
        )
    saved = hetero_checkpointing.read(args.load)
    cpu_compat.install()
    ps.initialize(1, 1, 1)
    try:
        vocab = padded_vocab_size(args, datasets(args).train.vocab_size, 1)
        _, model, optimizer, scheduler = _model_and_optimizer(args, vocab)
        full = saved.payload["optimizer"]
        params = dict(model.module.named_parameters())
        inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        adam_of = {id(p): o for o in inner for group in o.param_groups for p in group["params"]}
        notes = fit_vocab_rows(full, {name: tuple(p.shape) for name, p in params.items()})
        missing = sorted(set(params) - set(full))
        if missing:
            raise checkpointing.CheckpointError(
                f"{saved.path} lacks parameter(s) {missing[:3]} of the model these flags build"
            )
        with torch.no_grad():
            for name, param in params.items():
                if tuple(full[name]["param"].shape) != tuple(param.shape):
                    raise checkpointing.CheckpointError(
                        f"{saved.path}: {name} is {tuple(full[name]['param'].shape)}, the model "
                        f"these flags build has {tuple(param.shape)}"
                    )
                param.copy_(full[name]["param"])
                adam_of[id(param)].state[param] = {
                    "step": torch.as_tensor(float(full[name]["step"])),
                    "exp_avg": full[name]["exp_avg"].float().clone(),
                    "exp_avg_sq": full[name]["exp_avg_sq"].float().clone(),
                }
        state = saved.state
        scheduler.step(increment=state.iteration * args.global_batch_size)
        checkpointing.save(args, state, model, optimizer, scheduler, saved.sampler_state)
        checkpointing.release_writer_processes()
    finally:
        ps.destroy()
    done = f"wrote {args.save} (iteration {state.iteration}, Megatron {args.ckpt_format})"
    return "; ".join([done, *notes])


def main(argv: Sequence[str] | None = None) -> int:
    from megatron.dynapipe.checkpointing import CheckpointError
    from megatron.dynapipe.data.base import DataError

    argv = list(sys.argv[1:] if argv is None else argv)
    _one_process_group()
    try:
        print(convert(argv), flush=True)
    except (CheckpointError, DataError) as error:
        print(f"checkpoint_to_megatron.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
