"""Turn a heterogeneous job's layout-independent checkpoint into a Megatron-LM checkpoint.

    python tools/checkpoint_to_megatron.py --load hetero_ckpt --save megatron_ckpt \\
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 1024 ...

`--dynamic-strategies` and `--hetero-plan` jobs save `iter_NNNNNNN/full_state.pt` (every
parameter whole with its AdamW moments) and, beside it, the same state as a Megatron checkpoint.
This tool writes the Megatron checkpoint for a `full_state.pt` saved without it (given the
same Megatron flags as the run; `--load` the heterogeneous checkpoint, `--save` where to
write), with `megatron.dynapipe.layouts.megatron_export`, the code the job's own save runs.
One process, on the CPU, holding the whole model. Bad input ends with exit status 2 and one
line (`--debug` adds the traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def convert(args: argparse.Namespace) -> str:
    """Convert as the parsed flags say; returns the line to print."""
    from megatron.dynapipe.arguments import ArgumentError
    from megatron.dynapipe.data.datasets import datasets
    from megatron.dynapipe.layouts import checkpointing as hetero_checkpointing
    from megatron.dynapipe.layouts.megatron_export import cannot_export, export
    from megatron.dynapipe.model import padded_vocab_size

    if not args.load or not args.save:
        raise ArgumentError("give --load (the full_state.pt checkpoint) and --save")
    why_not = cannot_export(args)
    if why_not:
        raise ArgumentError(f"{why_not}; convert without them")
    saved = hetero_checkpointing.read(args.load)
    return export(args, saved, padded_vocab_size(args, datasets(args).train.vocab_size, 1))


def main(argv: Sequence[str] | None = None) -> int:
    from dynapipe_planner.cli_args import report_error
    from megatron.dynapipe.arguments import parse_args
    from megatron.dynapipe.checkpointing import CheckpointError
    from megatron.dynapipe.data.base import DataError
    from megatron.dynapipe.layouts.megatron_export import one_process_group

    args = parse_args(list(sys.argv[1:] if argv is None else argv))  # bad flags: exit 2 here
    one_process_group()
    try:
        print(convert(args), flush=True)
    except (CheckpointError, DataError) as error:
        report_error("checkpoint_to_megatron.py", error, args)  # --debug: with the traceback
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
