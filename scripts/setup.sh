#!/usr/bin/env bash
# Creates .venv (if absent) and installs dgpp-core, every in-tree plugin and the test tools.
# torch is pinned first: on the CPU dev/CI machine torch==2.13.0 is a local CPU wheel, and anything
# that pulls torch before it would resolve to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q "torch==2.13.0" "triton==3.8.0" numpy
pip install -q -r requirements-dev.txt
pip install -q -e ./dgpp-core -e ./plugins/dgpp-qwen -e ./plugins/dgpp-glm -e ./plugins/dgpp-deepseek \
  -e ./plugins/dgpp-mimo -e ./plugins/dgpp-flint
