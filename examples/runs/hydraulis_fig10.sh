#!/usr/bin/env bash
# Hydraulis Fig. 10 (hydraulis.txt §8.2) measured: real tokens/s of per-iteration heterogeneous
# strategies (--dynamic-strategies: pipelines of different TP/PP chosen per global batch, over
# the disaggregated optimiser) against Megatron-LM style homogeneous training on one TP x PP
# layout (megatron-core's 1F1B over rows packed to the context length, packing-1f1b, and over
# Megatron's fixed-length windows, megatron-1f1b), for each context length, beside the
# planner's predictions. dp_balanced (re-implemented), our cost-aware DP-balanced and HotSPa-style
# have no runtime here; the simulated figure (examples/figures/hydraulis_fig10.py) prices them.
#
#   examples/runs/hydraulis_fig10.sh                    # the GPUs nvidia-smi lists
#   TINY=1 examples/runs/hydraulis_fig10.sh             # 2 CPU ranks, tiny GPT (minutes)
#
# Variables (defaults: the paper's LLaMA 7B setting, run on the GPUs found; 8 in the paper):
#   MODEL=llama-7b CONTEXTS="16384 32768" TOKENS=100000 (tokens per iteration, §8.1)
#   TP=4 PP=2 (the homogeneous baselines' layout; DP = NPROC / (TP x PP))
#   MEMORY_LIMIT_GB (the planner's per-GPU budget; default: the device's memory)
#   DATA_PATH=synthetic:commoncrawl   and the shared ones in _lib.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/_lib.sh"
start_runs hydraulis_fig10

if [[ -n "$TINY" ]]; then
    # A 10 MB budget makes the selector weigh strategies other than plain DP on a tiny model.
    : "${TP:=1}" "${PP:=2}" "${CONTEXTS:=128 256}" "${TOKENS:=2048}" "${MEMORY_LIMIT_GB:=0.01}"
fi
: "${MODEL:=llama-7b}" "${CONTEXTS:=16384 32768}" "${TOKENS:=100000}" "${TP:=4}" "${PP:=2}"
: "${MEMORY_LIMIT_GB:=}" "${DATA_PATH:=synthetic:commoncrawl}"
base_flags
memory=()
if [[ -n "$MEMORY_LIMIT_GB" ]]; then memory=(--dynapipe-memory-limit-gib "$MEMORY_LIMIT_GB"); fi

panel="$(basename "$MODEL" .json) on $NPROC ranks"
for context in $CONTEXTS; do
    point=(--seq-length "$context" --tokens-per-global-batch "$TOKENS")
    launch "$panel" "context length" "$context" hydraulis "${point[@]}" "${memory[@]}" \
        --dynamic-micro-batching --dynamic-strategies
    layout=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        --micro-batch-size 1)
    launch "$panel" "context length" "$context" packing-1f1b "${point[@]}" "${layout[@]}" \
        "${memory[@]}" --baseline packing-1f1b
    launch "$panel" "context length" "$context" megatron-1f1b "${point[@]}" "${layout[@]}" \
        --baseline megatron-1f1b
done
draw "$(basename "$MODEL" .json) on $NPROC ranks, $TOKENS tokens per iteration of $DATA_PATH \
lengths cut at the context length, $ITERS iterations per run. Hydraulis: candidate strategies \
proposed at start-up from the data and the cost model, one selected and planned per iteration. \
Baselines: TP$TP x PP$PP x DP$((NPROC / (TP * PP))), one row of the context length per \
micro-batch.${MEMORY_LIMIT_GB:+ Planner memory budget $MEMORY_LIMIT_GB GiB per rank.}"
