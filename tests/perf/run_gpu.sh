#!/usr/bin/env bash
# Kernels and decode speed on a CUDA GPU: install dgpp from the working tree, check every kernel at real sizes, then run the
# decode benchmark. Logs under $OUT (or ./perf_out). Usage: bash tests/perf/run_gpu.sh [bench args...]
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  python3 tests/perf/check_kernels.py --json "$OUT/kernels.json" ${KERNEL_CHECKS:+--only "$KERNEL_CHECKS"} 2>&1 | tee "$OUT/kernels.log"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 tests/perf/bench_decode.py --out "$OUT/decode.md" "$@" 2>&1 | tee "$OUT/bench.log"
fi
