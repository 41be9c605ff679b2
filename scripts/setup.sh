#!/usr/bin/env bash
# Creates .venv (if absent) and installs dgpp-core (with its demo extra), every in-tree plugin, the example
# third-party plugin (examples/dgpp-example-plugin: the Llama family) and the test tools.
# torch is pinned first: on the CPU dev/CI machine torch==2.13.0 is a local CPU wheel, and anything
# that pulls torch before it would resolve to a multi-GB CUDA build.
# A rerun with unchanged requirements and pyproject files skips the installs (a stamp in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
PLUGINS=(./plugins/dgpp-qwen ./plugins/dgpp-glm ./plugins/dgpp-deepseek ./plugins/dgpp-mimo ./plugins/dgpp-flint ./examples/dgpp-example-plugin)
# entry points are generated at install time, so a changed pyproject must reinstall
stamp=$(cat scripts/setup.sh requirements-dev.txt dgpp-core/pyproject.toml plugins/*/pyproject.toml examples/*/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.dgpp-setup 2>/dev/null)" = "$stamp" ] && python -c "import dgpp, torch" 2>/dev/null; then
  exit 0
fi
# the machine's pip config names index directories that may be absent; their warnings are noise
pip_install() { pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip_install "torch==2.13.0" "triton==3.8.0" numpy
pip_install -r requirements-dev.txt
editable=(-e "./dgpp-core[demo]")  # the demo extra: transformers (also a test reference) and gguf
for plugin in "${PLUGINS[@]}"; do editable+=(-e "$plugin"); done
pip_install "${editable[@]}"
echo "$stamp" > .venv/.dgpp-setup
