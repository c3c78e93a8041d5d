#!/usr/bin/env bash
# The main job of the README: set up .venv on a fresh machine, then ES-train SmolLM2-135M-Instruct on arithmetic,
# launched the fastest way the machine allows (python -m trl_es.launch: one single-threaded process per physical
# core with population parallelism, or one process on a one-core machine; TRL_ES_NUM_PROCESSES=1 forces one).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m trl_es.launch ${TRL_ES_NUM_PROCESSES:+--num_processes "$TRL_ES_NUM_PROCESSES"} examples/scripts/main_job.py "$@"
