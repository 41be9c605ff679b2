#!/usr/bin/env bash
# Packed weights at batch on a CUDA GPU, in one call: the expert block probe's choice and alone == batched bits per
# expert format (check_quant_moe), GLM-5.3's packed decode at batch 64 and 1 (graph and eager), and the MoE
# geometries with packed experts at batch 64 with a per-kernel profile. Each part has its own time limit
# (seconds: PROBE_S, GLM_S, MOE_S) so one slow part leaves the others' logs. Logs under $OUT (or ./perf_out).
# ``introws``: the row-exact int GEMM with one dot over its row blocks against one dot per 16 rows, bits and time,
# then GLM-5.3 at batch 64 and 1 either way (``DGPP_INT_ROWS_ONE_DOT=0`` / ``=1``, the default; INTROWS_S). ``prefill``: the chunked delta
# rule's UT-transform launch and walk, Qwen3.5 through its CUDA paths against transformers, and the 8K prefill
# profile of Qwen3.5-122B (PREFILL_S). ``fp8chain``: FP8 block weights on wgmma with each 128-wide K block's dot from
# zero (the decode tile's chain) at 1, 16 and 64 rows, row-exactness across row tiles (FP8CHAIN_S).
# Usage: bash tests/perf/run_packed_batch.sh [probe|glm|moe|introws|prefill|fp8chain ...]   (default: probe, glm, moe)
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
    introws)
      for fmt_tile in "int8_g64 64x128x4x3x2x0,64x128x4x3x2x1" "int4_g64 64x128x4x3x1x0,64x128x4x3x1x1"; do
        set -- $fmt_tile
        timeout "${INTROWS_S:-120}" env PYTHONPATH="$PYTHONPATH:tests/perf" python3 tests/perf/bench_int_rows.py \
          --formats "$1" --shapes 6144x16384,16384x2048,6144x6144 --rows 1,16,64 --tiles "$2" 2>&1 |
          tee "$OUT/int_rows_$1.log"
      done
      for one_dot in 0 1; do
        DGPP_INT_ROWS_ONE_DOT=$one_dot timeout "${INTROWS_S:-120}" python3 tests/perf/check_glm5_cuda.py \
          --cases 64x1024,1x1024 --steps 6 --skip-kernels --modes graph 2>&1 | tee "$OUT/glm5_one_dot_$one_dot.log"
      done
      ;;
    prefill)
      timeout "${PREFILL_S:-120}" python3 tests/perf/check_prefill_kernels.py --only chunk_walk,chunk_prep 2>&1 |
        tee "$OUT/chunk_prep.log"
      [ -d .cache/qwen3_5_gpu ] && timeout "${PREFILL_S:-120}" python3 tests/perf/check_qwen3_5_cuda.py check \
        --dir .cache/qwen3_5_gpu 2>&1 | tee "$OUT/qwen3_5_check.log"
      timeout "${PREFILL_S:-120}" python3 -m dgpp.cli bench --hf-cases "" --check-cases "" \
        --geometry qwen3.5-122b-a10b-24l@8 --cases 128x1x8 --prefill 8192 --prefill-attn triton --profile-prefill 2>&1 |
        tee "$OUT/qwen3_5_prefill.log"
      ;;
    fp8chain)
      timeout "${FP8CHAIN_S:-150}" env PYTHONPATH="$PYTHONPATH:tests/perf" python3 tests/perf/probe_fp8_wgmma.py \
        --chain block --shapes 24576x4096,6144x4096 --rows 1,16,64 \
        --configs 128:16:128:1:4:4,128:16:128:1:4:6,256:16:128:1:8:4,128:64:128:1:4:3,256:64:128:1:8:3,128:64:128:2:4:3 \
        2>&1 | tee "$OUT/fp8chain.log"
      # the shipped FP8 tiles on the same shapes, same run
      timeout "${FP8CHAIN_S:-150}" env PYTHONPATH="$PYTHONPATH:tests/perf" python3 tests/perf/bench_packed_batch.py \
        --formats fp8_block --rows 1,16,64 --problems gate_up,qkv 2>&1 | tee "$OUT/fp8_shipped.log"
      ;;
    *)
      echo "unknown part $part (probe, glm, moe, introws, prefill, fp8chain)" >&2
      exit 2
      ;;
  esac
done
