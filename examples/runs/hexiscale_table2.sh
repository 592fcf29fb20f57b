#!/usr/bin/env bash
# HexiScale Table 2 / the mixed-cluster run (hexiscale.txt §5.1-5.3) measured: the asymmetric
# plan `dynapipe-hetero` finds for the cluster (pipelines of different depth, TP per stage,
# batch shares per pipeline), run by pretrain_gpt.py --hetero-plan, beside the symmetric
# Megatron layouts (TP x PP x DP) on the same ranks, for each global batch, with the planner's
# predictions.
#
# Where the GPUs are one type, SLOWDOWNS emulates the mix: rank r's forward and backward passes
# take SLOWDOWNS[r] times as long (--device-speed), and the planner sees the same ranks as a
# cluster of the DYNAPIPE_GPU with its peak FLOPS and memory bandwidth divided by the factor
# (cluster.yaml beside the note). On a real mixed machine, give
# CLUSTER: a cluster YAML (examples/clusters/) whose devices are this machine's GPUs in
# nvidia-smi order; the HexiScale run then places each rank on its device through
# CUDA_VISIBLE_DEVICES, and no run is slowed.
#
#   examples/runs/hexiscale_table2.sh                   # the GPUs nvidia-smi lists
#   TINY=1 examples/runs/hexiscale_table2.sh            # 2 CPU ranks, tiny GPT (minutes)
#
# Variables (defaults: Table 2's Llama 30B at 4,096 tokens, §5.1's batches):
#   MODEL=llama-30b SEQ=4096 GLOBAL_BATCHES="128 256 512 1024" (samples)
#   SLOWDOWNS=1,...,1,2,...,2 (the second half of the ranks 2x slower) or CLUSTER=FILE
#   LAYOUTS="1x1 8x1 1x8 ..." (TPxPP of the symmetric layouts; default from NPROC, _lib.sh)
#   DATA_PATH=synthetic:webcode   and the shared ones in _lib.sh
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/_lib.sh"
start_runs hexiscale_table2

if [[ -n "$TINY" ]]; then
    : "${SEQ:=128}" "${GLOBAL_BATCHES:=16 32}"
fi
: "${MODEL:=llama-30b}" "${SEQ:=4096}" "${GLOBAL_BATCHES:=128 256 512 1024}" "${CLUSTER:=}"
: "${LAYOUTS:=$(pure_layouts "$NPROC")}" "${DATA_PATH:=synthetic:webcode}"
if [[ -z "$CLUSTER" ]]; then
    : "${SLOWDOWNS:=$(for ((r = 0; r < NPROC; r++)); do
        echo $((r < NPROC - NPROC / 2 ? 1 : 2))
    done | paste -sd,)}"
    CLUSTER="$OUT_DIR/cluster.yaml"
    "$PYTHON" "$RUNS_DIR/_prepare.py" emulated-cluster "$DYNAPIPE_GPU" "$SLOWDOWNS" "$CLUSTER"
    speed=(--device-speed "$SLOWDOWNS")
    mix="$NPROC ranks emulating a mixed cluster (--device-speed $SLOWDOWNS)"
else
    SLOWDOWNS="" speed=() mix="$NPROC GPUs of $CLUSTER"
fi
base_flags

panel="$(basename "$MODEL" .json) at $SEQ tokens, $NPROC ranks"
x_name="global batch (samples)"
for batch in $GLOBAL_BATCHES; do
    plan="$OUT_DIR/hetero_plan_$batch.json"
    point=(--seq-length "$SEQ" --global-batch-size "$batch" --dynamic-micro-batching)
    if ! "$PYTHON" -m dynapipe_planner.hetero.cli --cluster "$CLUSTER" --model "$MODEL" \
        --seq-length "$SEQ" --global-batch-size "$batch" --bind-ranks --output "$plan" --quiet \
        > "$OUT_DIR/hetero_plan_$batch.txt" 2>&1; then
        skip_method "$panel" "$x_name" "$batch" hexiscale "$(tail -n 1 "$OUT_DIR/hetero_plan_$batch.txt")"
    elif [[ -n "$SLOWDOWNS" ]]; then
        ranks_speed="$("$PYTHON" "$RUNS_DIR/_prepare.py" by-rank "$plan" "$SLOWDOWNS")"
        launch "$panel" "$x_name" "$batch" hexiscale "${point[@]}" --hetero-plan "$plan" \
            --device-speed "$ranks_speed"
    else
        devices="$(seq -s, 0 $((NPROC - 1)))"
        CUDA_VISIBLE_DEVICES="$("$PYTHON" "$RUNS_DIR/_prepare.py" by-rank "$plan" "$devices")" \
            launch "$panel" "$x_name" "$batch" hexiscale "${point[@]}" --hetero-plan "$plan"
    fi
    for layout in $LAYOUTS; do
        tp="${layout%x*}" pp="${layout#*x}"
        launch "$panel" "$x_name" "$batch" "$(layout_label "$tp" "$pp")" "${point[@]}" "${speed[@]}" \
            --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp"
    done
done
draw "$(basename "$MODEL" .json) on $mix, global batches of $DATA_PATH samples up to $SEQ \
tokens, dynamic micro-batching on every layout, $ITERS iterations per run. hexiscale: the plan \
of \`dynapipe-hetero --bind-ranks\` for each batch (hetero_plan_<batch>.txt beside the note), run \
with --hetero-plan over the disaggregated optimiser; symmetric layouts: Megatron's TP/PP/DP \
with its DDP and optimiser."
