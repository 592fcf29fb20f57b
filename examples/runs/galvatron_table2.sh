#!/usr/bin/env bash
# Galvatron-BMW Table II (galvatron_bmw.txt §VII-B) measured: the plan `dynapipe-search` finds
# for each per-GPU memory budget, run by pretrain_gpt.py where the runtime can express it, beside
# the pure strategies (DP, TP, PP and, from 4 ranks, their mixes) at the same global batch and
# budget, with the planner's predictions. A searched plan the runtime cannot run yet (ZeRO-3
# sharding, per-layer recomputation, uneven partitions: issue #20) is recorded as not runnable,
# with the search's reasons; its search output is kept beside the note (search_<budget>.txt).
#
#   examples/runs/galvatron_table2.sh                   # the GPUs nvidia-smi lists
#   TINY=1 examples/runs/galvatron_table2.sh            # 2 CPU ranks, tiny GPT (minutes)
#
# Variables (defaults: Table II's BERT-Huge-32 at 512 tokens, budgets 8-20 GB):
#   MODEL=bert-huge-32 SEQ=512 GLOBAL_BATCH=64 BUDGETS_GB="8 12 16 20" MICRO_BATCH_SIZE=1
#   LAYOUTS="1x1 8x1 1x8 ..." (TPxPP of the pure strategies; default from NPROC, _lib.sh)
#   DATA_PATH=synthetic:webcode   and the shared ones in _lib.sh (DYNAPIPE_GPU is the search's
#   GPU too: RTX-TITAN for the paper's testbed)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/_lib.sh"
start_runs galvatron_table2

if [[ -n "$TINY" ]]; then
    # 0.01 GiB: the search mixes recomputed layers (not runnable); 0.05 GiB: plain DP.
    : "${SEQ:=128}" "${GLOBAL_BATCH:=16}" "${BUDGETS_GB:=0.01 0.05}"
fi
: "${MODEL:=bert-huge-32}" "${SEQ:=512}" "${GLOBAL_BATCH:=64}" "${BUDGETS_GB:=8 12 16 20}"
: "${MICRO_BATCH_SIZE:=1}" "${LAYOUTS:=$(pure_layouts "$NPROC")}" "${DATA_PATH:=synthetic:webcode}"
base_flags

panel="$(basename "$MODEL" .json), global batch $GLOBAL_BATCH"
x_name="memory budget (GiB)"
for budget in $BUDGETS_GB; do
    plan="$OUT_DIR/search_$budget.json"
    if ! "$PYTHON" -m dynapipe_planner.search.cli --model "$MODEL" --num-gpus "$NPROC" --gpu "$DYNAPIPE_GPU" \
        --memory-limit-gib "$budget" --seq-length "$SEQ" --global-batch-size "$GLOBAL_BATCH" \
        --output "$plan" --quiet > "$OUT_DIR/search_$budget.txt" 2>&1; then
        skip_method "$panel" "$x_name" "$budget" searched "$(tail -n 1 "$OUT_DIR/search_$budget.txt")"
    elif flags="$("$PYTHON" "$RUNS_DIR/_prepare.py" search-flags "$plan")"; then
        read -r -a searched <<< "$flags"
        launch "$panel" "$x_name" "$budget" searched "${searched[@]}"
    else
        skip_method "$panel" "$x_name" "$budget" searched "$flags"
    fi
    for layout in $LAYOUTS; do
        tp="${layout%x*}" pp="${layout#*x}"
        launch "$panel" "$x_name" "$budget" "$(layout_label "$tp" "$pp")" \
            --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" \
            --seq-length "$SEQ" --global-batch-size "$GLOBAL_BATCH" \
            --micro-batch-size "$MICRO_BATCH_SIZE" --batching padding --dynapipe-recompute none \
            --dynapipe-memory-limit-gib "$budget"
    done
done
draw "$(basename "$MODEL" .json) (trained as a GPT) on $NPROC ranks, $GLOBAL_BATCH samples of \
$DATA_PATH lengths up to $SEQ tokens per iteration, padded to $SEQ, $ITERS iterations per run. \
searched: the plan of \`dynapipe-search --gpu $DYNAPIPE_GPU\` under each budget, run with the \
flags it prints for pretrain_gpt.py. Pure strategies: Megatron's TP/PP/DP layouts, \
$MICRO_BATCH_SIZE sample(s) per micro-batch per DP rank, no recomputation. The budget is the \
planners' per-GPU memory limit (\`--dynapipe-memory-limit-gib\`); nothing caps the device's memory."
