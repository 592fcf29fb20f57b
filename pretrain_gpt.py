"""Train a megatron-core GPT with DynaPipe's per-iteration plans (launch with torchrun).

    torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --seq-length 1024 --pipeline-model-parallel-size 2 \
        --dynamic-micro-batching --tokens-per-global-batch 16384 --train-iters 10

Every Megatron-LM flag parses with Megatron's meaning (Megatron's own parser); the ones this
runtime cannot honour stop with one line. Heterogeneous jobs (pipelines of different TP/PP side
by side) take `--dynamic-strategies` (a strategy per iteration, Hydraulis) or `--hetero-plan
FILE` (one asymmetric layout, HexiScale) instead of the TP/PP sizes; `--device-speed` emulates
slower devices on CPU ranks. `--help` lists Megatron's flags and DynaPipe's.

A user error (bad data, tokenizer files, checkpoint, plan file, a model that fits nowhere) ends
the job with exit status 2 and one line on rank 0.
"""

import logging
import os
import sys
import warnings

# megatron-core warns at import about every optional GPU package it falls back from, and logs
# each parameter at INFO; keep the output to DynaPipe's per-iteration lines and real problems.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.training")

from dynapipe_planner.errors import PlanningError  # noqa: E402
from megatron.dynapipe.arguments import parse_args  # noqa: E402
from megatron.dynapipe.checkpointing import CheckpointError  # noqa: E402
from megatron.dynapipe.data.base import DataError  # noqa: E402
from megatron.dynapipe.device_speed import DeviceSpeedError  # noqa: E402
from megatron.dynapipe.hetero.candidates import CandidateError  # noqa: E402
from megatron.dynapipe.hetero.plan_file import HeteroPlanError  # noqa: E402
from megatron.dynapipe.training import pretrain  # noqa: E402

USER_ERRORS = (DataError, CheckpointError, DeviceSpeedError, HeteroPlanError, CandidateError)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dynapipe").setLevel(logging.INFO)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    # megatron-1f1b builds its GPTDataset indices in memory on purpose (megatron_samples).
    logging.getLogger("megatron.core.datasets.gpt_dataset").setLevel(logging.ERROR)
    try:
        pretrain(parse_args())
    except (*USER_ERRORS, PlanningError) as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"pretrain_gpt.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
