#!/usr/bin/env bash
# Issue 23: the Hyper-ES comparison of examples/recipes/hyper_es_arithmetic_cpu.yaml over seeds (task seed N and
# training seed 42 + N), then the mean +- std table and every seed's search curve (examples/studies/hyper_es_table.py).
# A seed whose comparison.json exists is skipped; pools and GRPO-LoRA baselines already trained are reused, so the
# command can be stopped and run again.
#   bash examples/studies/hyper_es_seeds.sh [seed ...]        # default: 0 1 2
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/hyper_es_cpu}
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
for seed in "${seeds[@]}"; do
  if [ -f "$OUT/seed$seed/comparison.json" ]; then
    echo "== seed $seed: $OUT/seed$seed/comparison.json exists, skipped" >&2
    continue
  fi
  echo "== seed $seed" >&2
  $PY examples/scripts/hyper_es.py --config examples/recipes/hyper_es_arithmetic_cpu.yaml \
    --output_dir "$OUT/seed$seed" --task_seed "$seed" --seed $((42 + seed))
done
files=()
for seed in "${seeds[@]}"; do files+=("$OUT/seed$seed/comparison.json"); done
$PY examples/studies/hyper_es_table.py "${files[@]}" --output_file "$OUT/table.md" --plot_file "$OUT/search_curves.png"
