#!/usr/bin/env bash
# The serving measurement on a CUDA GPU (docs/benchmarks.md, "Serving over HTTP"), logs under $OUT: the burst's
# prefill step in-process (tests/perf/bench_burst_prefill.py), overlapped decode steps against plain ones
# (tests/perf/check_overlap_cuda.py; on a mismatch the server runs with DGPP_OVERLAP=0), then `dgpp bench serve`
# on a random Qwen3-8B checkpoint written to disk. CASES picks the server cases.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export PATH="/tmp/site/bin:$PATH"
dgpp() { python3 -c "import sys; from dgpp.cli import main; sys.exit(main())" "$@"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 tests/perf/bench_burst_prefill.py 2>&1 | grep -v Warning | tee "$OUT/burst_prefill.log"
if ! python3 tests/perf/check_overlap_cuda.py --streams "${OVERLAP_STREAMS:-64,1}" 2>&1 | tee "$OUT/overlap.log"; then
  echo "overlapped steps differ: serving with DGPP_OVERLAP=0" | tee -a "$OUT/overlap.log"
  export DGPP_OVERLAP=0
fi
dgpp bench serve --geometry qwen3-8b --serve-cases "${CASES:-1,8,64,64:sampled,64:nostream}" \
  --checkpoint-dir /tmp/ck ${PROFILE:+--profile-dir "$OUT"} 2>&1 | grep -v Warning | tee "$OUT/serve.log"
