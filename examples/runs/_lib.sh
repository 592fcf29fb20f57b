# Sourced by every examples/runs/*.sh: paths, the ranks, TINY mode, the flags every run shares,
# and `launch` / `skip_method` / `draw`, which record and draw through _collect.py (run as the
# module `examples.runs._collect`, with the repository root on PYTHONPATH, from any directory).
#
# Environment shared by every script (each script lists its own grid variables):
#   NPROC        ranks on this node (default: the GPUs nvidia-smi lists; TINY: 2 CPU ranks)
#   TINY=1       CPU ranks (gloo), a tiny GPT (tiny_gpt.json), 3 iterations, a small grid
#   MODEL        a model preset (dynapipe-plan --help lists them) or a ModelSpec JSON file
#   ITERS        iterations per run (default 10; TINY 3), of which WARMUP are dropped (2; TINY 1)
#   DYNAPIPE_GPU the device the planner's analytic cost model describes (default A100-80GB;
#                give the GPU you run on so that predicted and measured compare)
#   EXTRA_ARGS   more pretrain_gpt.py flags for every run (default on GPUs: --bf16)
#   OUT          output root (default examples/out); a script writes $OUT/runs/<name>/
#   PYTHON       the interpreter with the project installed (default python3)
# shellcheck shell=bash

RUNS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$RUNS_DIR/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
TINY="${TINY:-}"
STARTED="$(date +%s)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

GPUS="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)"
if [[ -n "$TINY" ]]; then
    export CUDA_VISIBLE_DEVICES=""  # CPU ranks even on a GPU machine
    : "${NPROC:=2}" "${ITERS:=3}" "${WARMUP:=1}" "${MODEL:=$RUNS_DIR/tiny_gpt.json}"
else
    : "${NPROC:=$GPUS}" "${ITERS:=10}" "${WARMUP:=2}"
    if [[ "$GPUS" -gt 0 ]]; then : "${EXTRA_ARGS=--bf16}"; fi
fi
: "${DYNAPIPE_GPU:=A100-80GB}" "${EXTRA_ARGS:=}"
if [[ "$NPROC" -lt 1 ]]; then
    echo "$(basename "$0"): no GPU found; set NPROC for CPU ranks, or TINY=1" >&2
    exit 2
fi

# start_runs NAME: the output folder $OUT_DIR, emptied of an earlier sweep's records.
start_runs() {
    NAME="$1"
    OUT_DIR="${OUT:-$ROOT/examples/out}/runs/$NAME"
    rm -rf "$OUT_DIR/logs" "$OUT_DIR/runs.jsonl"
    mkdir -p "$OUT_DIR"
    echo "$NAME: $NPROC ranks${TINY:+ (TINY: CPU ranks, tiny model)}, output in $OUT_DIR"
}

# pretrain_gpt.py's flags of every run: the model, data, iterations and logging.
base_flags() {
    local model extra
    read -r -a model <<< "$("$PYTHON" "$RUNS_DIR/_prepare.py" model-flags "$MODEL")"
    read -r -a extra <<< "$EXTRA_ARGS"
    BASE_FLAGS=(
        "${model[@]}" --data-path "$DATA_PATH" --train-iters "$ITERS" --log-interval 1
        --lr 1e-4 --lr-decay-style constant --eval-iters 0 --seed 1234
        --dynapipe-gpu "$DYNAPIPE_GPU" "${extra[@]}"
    )
}

# pure_layouts N: symmetric TPxPP layouts of N ranks (the rest is DP): pure DP, TP and PP,
# and from 4 ranks DP+TP, DP+PP (and 3D from 8).
pure_layouts() {
    local n="$1" layouts="1x1 ${1}x1 1x${1}"
    if [[ "$n" -ge 4 ]]; then layouts+=" 2x1 1x2"; fi
    if [[ "$n" -ge 8 ]]; then layouts+=" 2x2"; fi
    echo "$layouts"
}

# layout_label TP PP: the strategy's name as the papers write it (DP8, TP2+DP4, ...).
layout_label() {
    local tp="$1" pp="$2" dp=$((NPROC / ($1 * $2))) parts=()
    if [[ "$tp" -gt 1 ]]; then parts+=("TP$tp"); fi
    if [[ "$pp" -gt 1 ]]; then parts+=("PP$pp"); fi
    if [[ "$dp" -gt 1 || ${#parts[@]} -eq 0 ]]; then parts+=("DP$dp"); fi
    local IFS=+
    echo "${parts[*]}"
}

# collect ARGS...: `python -m examples.runs._collect ARGS...` from wherever the script runs.
collect() {
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m examples.runs._collect "$@"
}

# launch PANEL X_NAME X METHOD FLAGS...: one `torchrun pretrain_gpt.py` with the base flags and
# FLAGS, recorded (a failed run is recorded and the sweep goes on).
launch() {
    local panel="$1" x_name="$2" x="$3" method="$4"
    shift 4
    collect run --out "$OUT_DIR" --panel "$panel" --x-name "$x_name" \
        --x "$x" --method "$method" -- \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
        "$ROOT/pretrain_gpt.py" "${BASE_FLAGS[@]}" "$@"
}

# skip_method PANEL X_NAME X METHOD REASON: a method the runtime cannot run at this point.
skip_method() {
    collect skip --out "$OUT_DIR" --panel "$1" --x-name "$2" --x "$3" --method "$4" \
        --reason "$5"
}

# draw WORKLOAD: the PNG, CSV and note of every recorded run.
draw() {
    collect draw "$NAME" --out "$OUT_DIR" --warmup "$WARMUP" --started "$STARTED" \
        --workload "$1" ${TINY:+--tiny}
    echo "$NAME: done in $(($(date +%s) - STARTED)) s"
}
