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
the job with exit status 2 and one line on rank 0. A fault of the running job (a peer that
died, a plan that never came or was refused, a failed transfer) ends it with exit status 1 and
one line on each rank that saw it, naming that rank. `--debug` (or DYNAPIPE_DEBUG=1) adds the
traceback to either.
"""

import logging
import sys
import warnings

# megatron-core warns at import about every optional GPU package it falls back from, and logs
# each parameter at INFO; keep the output to DynaPipe's per-iteration lines and real problems.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.training")
# torch says at import, on machines without CUDA, where it would look for the CUDA toolkit to
# build extensions; nothing here builds one, and an error must stay one line.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

from megatron.dynapipe.arguments import parse_args  # noqa: E402
from megatron.dynapipe.exits import exit_status  # noqa: E402
from megatron.dynapipe.training import pretrain  # noqa: E402


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dynapipe").setLevel(logging.INFO)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    # megatron-1f1b builds its GPTDataset indices in memory on purpose (megatron_samples).
    logging.getLogger("megatron.core.datasets.gpt_dataset").setLevel(logging.ERROR)
    args = parse_args()  # a bad flag ends here: exit status 2, one line
    return exit_status("pretrain_gpt.py", lambda: pretrain(args), args)


if __name__ == "__main__":
    sys.exit(main())
