#!/usr/bin/env bash
# GPU acceptance run (docs/scaling_out.md): the CUDA tests, population throughput (eager and compiled engines) and
# ES vs GRPO peak memory on random weights, every result as JSON in one folder. Made for one H200 lent for 10
# minutes with no network (../shared/gpu_notes.md: torch 2.11 + CUDA 13, transformers 5.17, no TRL, no datasets, no
# cma, no vLLM): the packages trl_es needs beyond the image travel as wheels in an ignored folder of the tree
# (default build/gpu_wheels, filled here with --download-wheels while a network is reachable) and are installed with
# pip --no-index --no-deps into a scratch folder put first on PYTHONPATH; trl_es itself is read from the tree.
#
#   bash benchmarks/gpu_acceptance.sh --download-wheels            # here, with a network: fill build/gpu_wheels
#   bash benchmarks/gpu_acceptance.sh --out "$OUT"                 # on the GPU machine (carry build/gpu_wheels)
#   bash benchmarks/gpu_acceptance.sh --device cpu --quick --out /tmp/acceptance   # the CPU path (tests)
#
# Options: --device cuda|cpu (default cuda), --out DIR (default $OUT, else gpu_acceptance_out), --quick, --wheels DIR,
# --budget_s S (default 540), --steps NAME... ; any other option goes to benchmarks/gpu_acceptance.py.
# Environment: PYTHON (default: .venv/bin/python when it exists, else python3), SCRATCH (default /tmp), WHEELS (the
# wheel folder), EXTRA_PINS (more requirements for --download-wheels).
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
WHEELS="${WHEELS:-$ROOT/build/gpu_wheels}"
DOWNLOAD=0
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --download-wheels) DOWNLOAD=1; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

if [ -z "${PYTHON:-}" ]; then
  PYTHON="$(command -v python3 || command -v python)"
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; fi
fi

# The pins trl_es needs beyond the GPU image, at the versions of this environment (pure-Python wheels, ~20 MiB).
if [ "$DOWNLOAD" = 1 ]; then
  mkdir -p "$WHEELS"
  PINS=$("$PYTHON" - <<'EOF'
from importlib.metadata import version
names = ("transformers", "trl", "datasets", "dill", "multiprocess", "cma", "peft")
print(" ".join(f"{p}=={version(p)}" for p in names))
EOF
)
  PINS="$PINS ${EXTRA_PINS:-}"  # e.g. EXTRA_PINS="tokenizers==0.23.3" if the image's is too old for transformers
  echo "[gpu_acceptance] downloading into $WHEELS: $PINS"
  # shellcheck disable=SC2086
  timeout 300 "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" $PINS
  exit $?
fi

SITE="${SCRATCH:-/tmp}/gpu_acceptance_site"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "[gpu_acceptance] installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
  rm -rf "$SITE"
  if timeout 180 "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "[gpu_acceptance] WARNING: installing the wheels failed; going on with what the image has" >&2
  fi
else
  echo "[gpu_acceptance] no wheels in $WHEELS: using the installed packages (summary.json lists what is missing)"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

cd "$ROOT" || exit 2
# The driver keeps to its own --budget_s (540 s by default) with a timeout per step; this outer timeout is the net.
timeout 590 "$PYTHON" "$HERE/gpu_acceptance.py" "${ARGS[@]}"
