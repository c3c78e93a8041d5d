#!/usr/bin/env bash
# The test command of the README: set up .venv on a fresh machine, then run the whole suite (CPU, < 10 min) on two
# pytest-xdist workers: most tests hold one torch thread, so the second core runs the next test (9:56 serial, 7:26
# on two workers, 2-core VM, 2026-12-03). Pass -n 0 to run serially.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
set +e
python -m pytest tests -q -p no:cacheprovider -n 2 --dist loadfile "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$status"
