#!/usr/bin/env bash
# Packed weights at batch on a CUDA GPU, in one call: the expert block probe's choice and alone == batched bits per
# expert format (check_quant_moe), GLM-5.3's packed decode at batch 64 and 1 (graph and eager), and the MoE
# geometries with packed experts at batch 64 with a per-kernel profile. Each part has its own time limit
# (seconds: PROBE_S, GLM_S, MOE_S) so one slow part leaves the others' logs. Logs under $OUT (or ./perf_out).
# Usage: bash tests/perf/run_packed_batch.sh [probe|glm|moe ...]   (default: all three, in that order)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(probe glm moe)
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"

for part in "${parts[@]}"; do
  case "$part" in
    probe)
      # Qwen3.5-122B expert shape, then GLM-5.3's wider one (int4 g64 as shipped)
      timeout "${PROBE_S:-150}" python3 tests/perf/check_quant_moe.py --formats int4,mxfp4,nvfp4,fp8 \
        --tokens 2048,512,1 --rotate 2 --no-old-loop --json "$OUT/moe_probe.json" 2>&1 | tee "$OUT/moe_probe.log"
      timeout "${PROBE_S:-150}" python3 tests/perf/check_quant_moe.py --hidden 6144 --inter 2048 --formats int4 \
        --tokens 2048,64,1 --rotate 2 --no-old-loop 2>&1 | tee "$OUT/moe_probe_glm.log"
      ;;
    glm)
      timeout "${GLM_S:-240}" python3 tests/perf/check_glm5_cuda.py --cases 64x1024,1x1024 --steps 6 \
        --skip-kernels --profile 2>&1 | tee "$OUT/glm5.log"
      ;;
    moe)
      for geometry_quant in "qwen3.5-122b-a10b-24l@8 nvfp4" "deepseek-v4-flash-8l@4 mxfp4+fp8_block"; do
        set -- $geometry_quant
        timeout "${MOE_S:-180}" python3 -m dgpp.cli bench --hf-cases "" --check-cases "" --geometry "$1" \
          --quant "$2" --cases 128x64x32,128x1x32 --profile 128x64x6 2>&1 | tee "$OUT/moe_${1%%@*}.log"
      done
      ;;
    *)
      echo "unknown part $part (probe, glm, moe)" >&2
      exit 2
      ;;
  esac
done
