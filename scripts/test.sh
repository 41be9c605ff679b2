#!/usr/bin/env bash
# Sets up everything on a fresh clone, then runs the test suite (CPU). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -x -q tests/core`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TRITON_INTERPRET=1
status=0
python -m pytest -q -p no:cacheprovider "$@" || status=$?
if [ "$status" -eq 5 ]; then
  # pytest's "no tests collected": a selection that runs nothing must not look like a pass or a quiet skip
  echo "scripts/test.sh: pytest collected no tests for: ${*:-tests/ plugins/}" >&2
  exit 1
fi
exit "$status"
