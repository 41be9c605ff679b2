#!/usr/bin/env bash
# Sets up everything on a fresh clone, then runs the whole test suite (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TRITON_INTERPRET=1
exec python -m pytest -q -p no:cacheprovider "$@"
