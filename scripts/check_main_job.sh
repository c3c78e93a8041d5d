#!/usr/bin/env bash
# The README's main job as a fresh machine runs it, cut to one ES iteration: an empty TRL_ES_CACHE (the embedded
# model is de-quantized and cached on the way), the real launcher with 2 processes (TRL_ES_NUM_PROCESSES=2, also on
# a one-core machine), the real entry point (scripts/run_main_job.sh). Then checks that the trained model, the seed
# log and results.json are there and complete. Then the same from the broken cache that a two-process build left
# before cache format 2 (a marker without config or weights): it must be rebuilt, not trusted. Then the tests that
# load the real model or run the GPU acceptance driver on CPU (pytest -m slow). Run by .ci/run; about 4 minutes on 2 CPU cores.
#   bash scripts/check_main_job.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export TRL_ES_CACHE="$work/cache"

run_and_check() {  # $1: output folder
  TRL_ES_NUM_PROCESSES=2 bash scripts/run_main_job.sh \
    --max_steps 1 --output_dir "$1" --num_validation_prompts 12 --num_eval_prompts 12 --per_device_eval_batch_size 12
  .venv/bin/python - "$1" <<'PY'
import json
import os
import sys

from transformers import AutoModelForCausalLM

from trl_es.es import SEED_LOG_NAME
from trl_es.models import _cache_problem, cache_dir

out = sys.argv[1]
problem = _cache_problem(cache_dir() / "SmolLM2-135M-Instruct")
assert problem is None, f"the embedded model cache is not usable: {problem}"
for name in ("model.safetensors", "config.json", SEED_LOG_NAME, "results.json", "trl_es_run.json",
             "training_curves.png"):
    path = os.path.join(out, name)
    assert os.path.isfile(path) and os.path.getsize(path) > 0, f"missing or empty: {path}"
with open(os.path.join(out, "results.json")) as f:
    results = json.load(f)
assert results["iterations"] == 1, results
for key in ("accuracy_before", "accuracy_after", "test_accuracy_before", "test_accuracy_after"):
    assert 0.0 <= results[key] <= 1.0, (key, results)
with open(os.path.join(out, SEED_LOG_NAME)) as f:
    records = [json.loads(line) for line in f][1:]
assert [r["step"] for r in records] == [1] and len(records[0]["members"]) == 24, records
model = AutoModelForCausalLM.from_pretrained(out)
assert sum(p.numel() for p in model.parameters()) == 134_515_008
print(f"[check_main_job] ok: model, seed log, results.json in {out}; test accuracy "
      f"{results['test_accuracy_before']:.3f} -> {results['test_accuracy_after']:.3f} after 1 iteration")
PY
}

echo "[check_main_job] 1/2: from an empty cache ($TRL_ES_CACHE)"
run_and_check "$work/fresh"

# What a rank != 0 build left behind before cache format 2: tokenizer files and a marker, no config, no weights.
echo "[check_main_job] 2/2: from the broken cache an earlier two-process build left"
cached="$TRL_ES_CACHE/SmolLM2-135M-Instruct"
rm -f "$cached/config.json" "$cached/model.safetensors" "$cached/generation_config.json"
echo '{"format": 1, "source": "SmolLM2-135M-Instruct.Q4_1.gguf"}' > "$cached/trl_es_embedded.json"
run_and_check "$work/rebuilt"

# The tests marked "slow": those that load the real embedded model (the GGUF de-quantized into a fresh cache, bitwise
# equal to the GGUF model, greedy chat generation) and benchmarks/gpu_acceptance.sh end to end on CPU (six
# interpreters); the suite (scripts/run_tests.sh) runs on tiny models.
echo "[check_main_job] the real-model tests and the GPU acceptance driver on CPU (pytest -m slow)"
.venv/bin/python -m pytest tests -q -p no:cacheprovider -m slow
