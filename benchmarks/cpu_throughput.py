"""Real tokens/s of DynaPipe against megatron-core's 1F1B baselines on this machine's CPU ranks
(seed `dynapipe.txt` §8: throughput against the packing baseline on long-tailed data).

`torchrun --nproc-per-node 2 pretrain_gpt.py` (PP=2, gloo): a small GPT (4 layers, hidden 128)
and 16,384 tokens per iteration of a long-tailed dataset truncated at 4,096 tokens; DynaPipe
planned with this machine's own costs (`--dynapipe-cost-model local`, profiled on first use and
cached); baselines `packing-1f1b` and `megatron-1f1b` at 1, 2 and 4 rows per micro-batch
(`padding` on request). Methods and measurement: `benchmarks/throughput.py`.

What the ratio means on CPU: every micro-batch runs as THD sequences with per-sample attention
(the cost a variable-length kernel has on GPU), DynaPipe's padded or packed rows as packing-1f1b's
packed rows, so each pays its samples' own attention. Megatron's windows (megatron-1f1b) have no
padding but full seq-length attention across documents. CPU work counts the ranks' CPU-seconds
(work done, whatever the bubble); wall time is what a smaller bubble improves."""

from __future__ import annotations

if __package__ in (None, ""):  # run by path: its imports need the repository root
    raise SystemExit("run from the repository root: python -m benchmarks.cpu_throughput")

from benchmarks.throughput import Defaults, measure, parser

CPU = Defaults(
    nproc_per_node=2,
    pipeline_model_parallel_size=2,
    num_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    seq_length=4096,
    tokens_per_global_batch=16384,
    baselines=("packing-1f1b", "megatron-1f1b"),
    micro_batch_sizes=(1, 2, 4),
)


def main() -> None:
    measure(parser(__doc__.split("\n\n")[0], CPU).parse_args())


if __name__ == "__main__":
    main()
