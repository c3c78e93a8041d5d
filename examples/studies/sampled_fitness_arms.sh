#!/usr/bin/env bash
# Issue 22: the main job's recipe with greedy fitness (the reference) against sampled fitness, on the validation
# split, scored with the papers' protocol (T = 0.6, top-p 0.95). Same completions per iteration in every arm
# (24 members x 12 prompts x 1 greedy completion, or x 6 prompts x 2 samples).
#   bash examples/studies/sampled_fitness_arms.sh [arm ...]     # arms: greedy sampled sampled_per_prompt
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/sampled_fitness}
SAMPLES=${SAMPLES:-8}
arms=("$@")
[ ${#arms[@]} -gt 0 ] || arms=(greedy sampled_per_prompt sampled)
for arm in "${arms[@]}"; do
  case "$arm" in
    greedy) extra=() ;;
    sampled) extra=(--temperature 0.6 --num_generations 2 --prompt_batch_size 6) ;;
    sampled_per_prompt) extra=(--temperature 0.6 --num_generations 2 --prompt_batch_size 6 --per_prompt_shaping zscore) ;;
    *) echo "unknown arm $arm (greedy, sampled, sampled_per_prompt)" >&2; exit 2 ;;
  esac
  echo "== $arm: training" >&2
  $PY -m trl_es.launch examples/scripts/main_job.py --output_dir "$OUT/$arm" --eval_strategy no "${extra[@]}"
  echo "== $arm: validation, greedy + $SAMPLES samples at the papers' protocol" >&2
  $PY -m trl_es.cli eval --model_name_or_path "$OUT/$arm" --split validation --num_samples "$SAMPLES" \
    --pass_k 1 2 4 8 --sample_temperature 0.6 --top_p 0.95 --sample_batch_size 8 \
    --output_file "$OUT/$arm/validation_eval.json"
done
