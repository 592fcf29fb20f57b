#!/usr/bin/env bash
# DynaPipe Figs. 13 and 14 (dynapipe.txt §8.1-8.2) measured: real tokens/s of DynaPipe (dynamic
# micro-batching, adaptive schedule) and of megatron-core's 1F1B over packed rows
# (packing-1f1b) and over Megatron's fixed-length windows (megatron-1f1b), vs the maximum
# sequence length (Fig. 13, at TOKENS per global batch) and vs the tokens per global batch
# (Fig. 14, at FIG14_SEQLEN), beside the planner's predictions.
#
#   examples/runs/dynapipe_fig13_14.sh                  # the GPUs nvidia-smi lists
#   TINY=1 examples/runs/dynapipe_fig13_14.sh           # 2 CPU ranks, tiny GPT (minutes)
#
# Variables (defaults: the paper's 8-GPU GPT 6.7B on TP2 x PP4, FLAN-like lengths):
#   MODEL=gpt-6.7b TP=2 PP=4 (DP = NPROC / (TP x PP))  MICRO_BATCH_SIZE=1 (baseline rows)
#   MAX_SEQLENS="512 1024 2048 4096 8192" TOKENS=65536
#   GLOBAL_BATCHES="16384 32768 65536 131072" FIG14_SEQLEN=2048
#   DATA_PATH=synthetic:flan   and the shared ones in _lib.sh (NPROC, ITERS, EXTRA_ARGS, OUT...)
set -euo pipefail
# shellcheck source=examples/runs/_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/_lib.sh"
start_runs dynapipe_fig13_14

if [[ -n "$TINY" ]]; then
    : "${TP:=1}" "${PP:=2}" "${MAX_SEQLENS:=128 256}" "${TOKENS:=2048}"
    : "${GLOBAL_BATCHES:=1024 4096}" "${FIG14_SEQLEN:=128}"
fi
: "${MODEL:=gpt-6.7b}" "${TP:=2}" "${PP:=4}" "${MICRO_BATCH_SIZE:=1}"
: "${MAX_SEQLENS:=512 1024 2048 4096 8192}" "${TOKENS:=65536}"
: "${GLOBAL_BATCHES:=16384 32768 65536 131072}" "${FIG14_SEQLEN:=2048}"
: "${DATA_PATH:=synthetic:flan}"
base_flags

# run_methods PANEL X_NAME X SEQLEN TOKENS: every method at one grid point.
run_methods() {
    local point=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        --seq-length "$4" --tokens-per-global-batch "$5")
    launch "$1" "$2" "$3" dynapipe "${point[@]}" --dynamic-micro-batching --pipeline-schedule adaptive \
        --dataloader-inter-document-masking
    launch "$1" "$2" "$3" packing-1f1b "${point[@]}" --baseline packing-1f1b \
        --micro-batch-size "$MICRO_BATCH_SIZE"
    launch "$1" "$2" "$3" megatron-1f1b "${point[@]}" --baseline megatron-1f1b \
        --micro-batch-size "$MICRO_BATCH_SIZE"
}

for seqlen in $MAX_SEQLENS; do
    run_methods "Fig. 13: $TOKENS tokens per batch" "max sequence length" "$seqlen" "$seqlen" "$TOKENS"
done
for tokens in $GLOBAL_BATCHES; do
    run_methods "Fig. 14: max length $FIG14_SEQLEN" "tokens per global batch" "$tokens" \
        "$FIG14_SEQLEN" "$tokens"
done
draw "$(basename "$MODEL" .json) on $NPROC ranks as TP$TP x PP$PP x DP$((NPROC / (TP * PP))), \
$DATA_PATH lengths cut at the maximum sequence length, $ITERS iterations per run. Baselines: \
$MICRO_BATCH_SIZE row(s) of the sequence length per micro-batch."
