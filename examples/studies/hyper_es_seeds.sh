#!/usr/bin/env bash
# The Hyper-ES comparison of a recipe over seeds (task seed N and training seed 42 + N), then the mean +- std table
# and every seed's search curve (examples/studies/hyper_es_table.py). A seed whose comparison.json exists is skipped;
# pools and GRPO-LoRA baselines already trained are reused, and the search resumes from its last checkpoint, so the
# command can be stopped and run again.
#   bash examples/studies/hyper_es_seeds.sh [seed ...]        # default: 0 1 2
#   RECIPE=examples/recipes/hyper_es_paper_protocol_cpu.yaml OUT=runs/hyper_es_paper bash examples/studies/hyper_es_seeds.sh 0
#   SEEDS_ONLY=1 ...: run the seeds, no table (several seeds in parallel, one command each, then the table once)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
RECIPE=${RECIPE:-examples/recipes/hyper_es_arithmetic_cpu.yaml}
OUT=${OUT:-runs/hyper_es_cpu}
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
for seed in "${seeds[@]}"; do
  if [ -f "$OUT/seed$seed/comparison.json" ]; then
    echo "== seed $seed: $OUT/seed$seed/comparison.json exists, skipped" >&2
    continue
  fi
  echo "== seed $seed" >&2
  resume=()
  last=$(ls -d "$OUT/seed$seed"/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1 || true)
  [ -z "$last" ] || resume=(--resume_from_checkpoint "$last")
  $PY examples/scripts/hyper_es.py --config "$RECIPE" \
    --output_dir "$OUT/seed$seed" --task_seed "$seed" --seed $((42 + seed)) "${resume[@]}"
done
[ -z "${SEEDS_ONLY:-}" ] || exit 0
files=()
for seed in "${seeds[@]}"; do files+=("$OUT/seed$seed/comparison.json"); done
$PY examples/studies/hyper_es_table.py "${files[@]}" --output_file "$OUT/table.md" --plot_file "$OUT/search_curves.png"
