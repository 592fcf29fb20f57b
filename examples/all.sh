#!/usr/bin/env bash
# Regenerate every paper figure (issue #8): one script at a time, with progress and elapsed
# time, stopping at the first failure and naming it (non-zero exit).
#
#   examples/all.sh                 # every figure into examples/out/<figure>/
#   OUT=/tmp/figs examples/all.sh   # another output root
#   QUICK=1 examples/all.sh         # each script's tiny workload (smoke run)
#   FIGURES="examples.figures.dynapipe_fig7 ..." examples/all.sh   # an explicit list of modules
#
# Each script runs as a module from the repository root (`python -m examples.figures.<name>`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/examples/out}"
PYTHON="${PYTHON:-python3}"

# In order: DynaPipe, Hydraulis, Galvatron-BMW, HexiScale, then beyond the seeds.
DEFAULT_FIGURES=(
    examples.figures.dynapipe_fig4
    examples.figures.dynapipe_fig5
    examples.figures.dynapipe_fig7
    examples.figures.dynapipe_fig13
    examples.figures.dynapipe_fig14
    examples.figures.dynapipe_fig15
    examples.figures.dynapipe_fig16
    examples.figures.dynapipe_fig17
    examples.figures.dynapipe_fig18
    examples.figures.hydraulis_fig3
    examples.figures.hydraulis_fig10
    examples.figures.hydraulis_fig11
    examples.figures.hydraulis_fig12
    examples.figures.hydraulis_fig13
    examples.figures.hydraulis_table1
    examples.figures.hydraulis_table2
    examples.figures.galvatron_table2
    examples.figures.galvatron_table3
    examples.figures.galvatron_table4
    examples.figures.galvatron_fig4
    examples.figures.galvatron_fig5
    examples.figures.hexiscale_fig1
    examples.figures.hexiscale_fig4_5
    examples.figures.hexiscale_table2
    examples.figures.hexiscale_fig8
    examples.figures.hexiscale_fig9
    examples.figures.hexiscale_fig10
    examples.figures.beyond_mixed_long_tail
)
if [[ -n "${FIGURES:-}" ]]; then
    read -r -a SCRIPTS <<< "$FIGURES"
else
    SCRIPTS=("${DEFAULT_FIGURES[@]}")
fi
EXTRA=()
[[ -n "${QUICK:-}" ]] && EXTRA+=(--quick)

total=${#SCRIPTS[@]}
began=$SECONDS
for i in "${!SCRIPTS[@]}"; do
    module="${SCRIPTS[$i]}"
    name="${module##*.}"
    echo "[$((i + 1))/$total] $name ..."
    t0=$SECONDS
    if ! "$PYTHON" -m "$module" --out "$OUT" "${EXTRA[@]}"; then
        echo "FAILED: $name (python -m $module) after $((SECONDS - t0)) s; later figures not run" >&2
        exit 1
    fi
    echo "[$((i + 1))/$total] $name done in $((SECONDS - t0)) s (total $((SECONDS - began)) s)"
done
echo "all $total figures written under $OUT in $((SECONDS - began)) s"
