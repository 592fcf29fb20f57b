"""Train a megatron-core GPT with DynaPipe's per-iteration plans (launch with torchrun).

    torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --seq-length 1024 --pipeline-model-parallel-size 2 \
        --dynamic-micro-batching --tokens-per-global-batch 16384 --train-iters 10

Heterogeneous jobs (pipelines of different TP/PP side by side) take `--dynamic-strategies`
(a strategy per iteration, Hydraulis) or `--hetero-plan FILE` (one asymmetric layout,
HexiScale) instead of the TP/PP sizes; `--device-speed` emulates slower devices on CPU ranks.

Megatron's flags keep their meaning; `--dynamic-micro-batching`, `--pipeline-schedule`,
`--tokens-per-global-batch` and the other DynaPipe flags are listed by `--help`.
"""

import logging
import warnings

# megatron-core warns at import about every optional GPU package it falls back from, and logs
# each parameter at INFO; keep the output to DynaPipe's per-iteration lines and real problems.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")

from megatron.dynapipe.arguments import parse_args  # noqa: E402
from megatron.dynapipe.training import pretrain  # noqa: E402

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dynapipe").setLevel(logging.INFO)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    pretrain(parse_args())
