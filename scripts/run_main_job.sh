#!/usr/bin/env bash
# The main job of the README: set up .venv on a fresh machine, then ES-train SmolLM2-135M-Instruct on arithmetic.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python examples/scripts/main_job.py "$@"
