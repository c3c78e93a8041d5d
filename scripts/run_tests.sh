#!/usr/bin/env bash
# The test command of the README: set up .venv on a fresh machine, then run the whole suite (CPU, < 10 min).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set +e
python -m pytest tests -q -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$status"
