"""Real tokens/s of DynaPipe against megatron-core 1F1B with THD packing, against padding and
against Megatron's fixed-length windows, on this machine's GPUs (seed `dynapipe.txt` §8, Fig. 13).

One rank per GPU (`torchrun --nproc-per-node <GPUs> pretrain_gpt.py`, NCCL), bf16, a GPT of 24
layers x 2,048 hidden (16 heads) at sequence length 8,192 with PP=2 over the GPUs (the rest data
parallel), 65,536 tokens per iteration of a long-tailed dataset; DynaPipe planned with the
GPU's own costs (`--dynapipe-cost-model local`: a CUDA table profiled on first use and kept;
`--dynapipe-args "--dynapipe-cost-model analytic"` plans with the analytic model of
`--dynapipe-gpu`, the planner's preset the device name names). TransformerEngine (`pip
install -e ".[gpu]"`) gives every micro-batch per-sample attention. Methods and measurement:
`benchmarks/throughput.py`. Without CUDA it stops; `cpu_throughput.py` is the CPU benchmark.
"""

from __future__ import annotations

import sys

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.gpu_throughput")

from benchmarks.throughput import Defaults, measure, parser
from dynapipe_planner.cluster import GPU_PRESETS


def planner_gpu(device_name: str) -> str | None:
    """The planner's GPU preset a CUDA device name names ("NVIDIA A100-SXM4-80GB" ->
    "A100-80GB"), or None."""
    name = device_name.upper().replace(" ", "").replace("-", "")
    matches = [p for p in GPU_PRESETS if all(part in name for part in p.upper().split("-"))]
    return max(matches, key=len, default=None)


def _defaults(gpus: int, device_name: str) -> Defaults:
    known = planner_gpu(device_name)
    return Defaults(
        nproc_per_node=gpus,
        pipeline_model_parallel_size=2 if gpus % 2 == 0 else 1,
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        seq_length=8192,
        tokens_per_global_batch=65536,
        baselines=("packing-1f1b", "padding", "megatron-1f1b"),
        micro_batch_sizes=(1, 2, 4),
        extra_args="--bf16" + (f" --dynapipe-gpu {known}" if known else ""),
    )


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        print(
            "benchmarks.gpu_throughput: error: no CUDA device (benchmarks.cpu_throughput "
            "measures CPU ranks)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    defaults = _defaults(torch.cuda.device_count(), torch.cuda.get_device_name())
    measure(parser(__doc__.split("\n\n")[0], defaults).parse_args())


if __name__ == "__main__":
    main()
