#!/usr/bin/env bash
# Issue 22: GRPO's levers on the validation split (task seed 0, one budget), TRL's defaults otherwise: the
# learning rate at num_generations 8, then num_generations at the best learning rate (chosen by validation greedy
# accuracy at the end of the budget, then sampled pass@1). Each arm: examples/studies/compare_es_grpo.py.
#   bash examples/studies/tune_grpo.sh                       # BUDGET=4 LRS="3e-6 1e-5 3e-5" GENS="4 16"
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/grpo_tune}
BUDGET=${BUDGET:-4}
LRS=${LRS:-"3e-6 1e-5 3e-5"}
GENS=${GENS-"4 16"}  # GENS="" skips the num_generations sweep
arm() {  # arm LR GENERATIONS
  local dir="$OUT/lr$1_g$2"
  [ -f "$dir/results.json" ] && return 0
  $PY examples/studies/compare_es_grpo.py --methods grpo --split validation --task_seeds 0 \
    --budgets_minutes "$BUDGET" --grpo_learning_rate "$1" --grpo_num_generations "$2" --sampled_samples 8 \
    --output_dir "$dir"
}
best() {  # best [GLOB]: the arm folder with the best (greedy accuracy, sampled pass@1) at the end
  $PY - "$OUT" "${1:-lr*_g*}" <<'PYEOF'
import json, pathlib, sys
rows = []
for path in sorted(pathlib.Path(sys.argv[1]).glob(sys.argv[2] + "/results.json")):
    row = json.loads(path.read_text())["table"][-1]
    rows.append(((row["mean"], row.get("sampled_pass@1", 0.0)), path.parent.name))
    print(f"{path.parent.name}: greedy {row['mean']:.3f} sampled pass@1 {row.get('sampled_pass@1', float('nan')):.3f}",
          file=sys.stderr)
print(max(rows)[1])
PYEOF
}
for lr in $LRS; do arm "$lr" 8; done
lr=$(best "lr*_g8" | sed -E 's/^lr(.*)_g[0-9]+$/\1/')
echo "best learning rate at num_generations 8: $lr" >&2
for g in $GENS; do arm "$lr" "$g"; done
echo "best arm: $(best)" >&2
