#!/usr/bin/env bash
# The decode measurements of docs/benchmarks.md as named steps under one time budget: each step's log under $OUT
# (STEP.log), a line per step in $OUT/steps.log, every step cut at what is left of BUDGET seconds (default 580).
#   STEPS="kvfp8 kv32k" DGPP_COMMIT=$(git rev-parse --short HEAD) bash tests/perf/run_decode_table.sh
# DGPP_COMMIT names the tree in the bench headers where the host's copy of .git lags the files. Steps:
#   kvfp8      fp8 K/V decode kernel against the fp32 reference and the bf16 kernel (check_kernels)
#   kv32k      Qwen3-8B@9 at 32K context, batch 1 and 32, K/V bf16 and fp8
#   qwen4      Qwen3.8-Flash-Next: the CUDA check (prepared references in .cache/qwen4_exp_gpu) and the bench
#   dsv4       DeepSeek-V4-Flash@4: the glue kernel checks, batch 1 / 8 with a batch-1 profile
#   moe        the packed MoE geometries (Qwen3.5-122B nvfp4, MiMo-V2.6 and DeepSeek-V4 mxfp4 + fp8_block)
#   dense      Qwen3-8B bf16 / fp8_block / nvfp4 at batch 1, 16, 64, and the per-shape packed tiles
#   glm5       GLM-5.3 12 layers packed, context 1,024, batch 1 and 64, graph and eager
#   flint      Flint@8 in its release formats, batch 1 and 8, with a batch-1 profile
#   serve      Qwen3-8B fp8_block served at 64 streams, with 24 prompts solo == batched
#   long       long context: GLM-5.3 12 layers at 1K / 32K, Qwen3.8-Flash-Next at 128 / 32K, and an 8,192-token
#              prefill of the hybrid and MoE geometries (MiMo-V2.6, Qwen3.5-122B-A10B, Qwen3.8-Flash-Next)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
T0=$(date +%s)
BUDGET=${BUDGET:-580}
left() { local l=$((BUDGET - ($(date +%s) - T0))); [ "$l" -lt 5 ] && l=5; echo "$l"; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
run() {
  local name=$1
  shift
  echo "== $name ($(left) s left)" | tee -a "$OUT/steps.log"
  timeout "$(left)" "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$? $name" | tee -a "$OUT/steps.log"
  grep -E "^\| [0-9]|graph:|greedy|err|failed|kernels vs" "$OUT/$name.log" | tail -40
}
BENCH=(python3 -m dgpp.cli bench --hf-cases "")  # a command, not a function: `timeout` runs it
for step in ${STEPS:-kvfp8 kv32k qwen4 dsv4}; do
  case $step in
    kvfp8) run kvfp8 bash -c "cd tests/perf && python3 check_kernels.py --only kv_fp8_decode_attention" ;;
    kv32k) run kv32k "${BENCH[@]}" --geometry qwen3-8b@9 --cases 32768x1x16,32768x32x8 --kv-dtype auto,fp8 --check-cases "" ;;
    qwen4)
      run qwen4_check python3 plugins/dgpp-qwen/tests/check_qwen4_exp_cuda.py check --dir .cache/qwen4_exp_gpu
      run qwen4 "${BENCH[@]}" --geometry qwen3.8-flash-next-8l --cases 128x1x64,128x8x64,32768x1x16 --check-cases 128x2x16 \
        --profile 128x1x8 ;;
    dsv4)
      run dsv4_check bash -c "cd tests/perf && python3 check_deepseek_v4_cuda.py"
      run dsv4 "${BENCH[@]}" --geometry deepseek-v4-flash-8l@4 --cases 128x1x64,128x8x64 --check-cases 128x3x16 --profile 128x1x8 ;;
    moe)
      for spec in qwen3.5-122b-a10b-24l@8:nvfp4 mimo-v2.6-flash-8l@4:mxfp4+fp8_block \
        deepseek-v4-flash-8l@4:mxfp4+fp8_block; do
        run "moe_${spec%%@*}" "${BENCH[@]}" --geometry "${spec%%:*}" --quant "bf16,${spec#*:}" \
          --cases 128x1x64,128x8x64,128x64x64 --check-cases 128x8x16
      done ;;
    dense)
      run dense "${BENCH[@]}" --geometry qwen3-8b --quant bf16,fp8_block,nvfp4 --cases 128x1x64,128x16x64,128x64x64
      run dense_tiles python3 tests/perf/bench_packed_batch.py --formats nvfp4,fp8_block --rows 1,16,64 \
        --problems gate_up,qkv --tiles ;;
    glm5) run glm5 python3 tests/perf/check_glm5_cuda.py --cases 1x1024,64x1024 --steps 8 --skip-kernels ;;
    flint) run flint "${BENCH[@]}" --geometry flint@8 --quant release --cases 128x1x32,128x8x32 --check-cases "" --profile 128x1x8 ;;
    serve) run serve python3 -m dgpp.cli bench serve --geometry qwen3-8b --quant fp8_block --serve-cases 64 \
      --solo-check 24 --checkpoint-dir /tmp/ck8 ;;
    long)
      run long_glm5 python3 tests/perf/check_glm5_cuda.py --cases 1x1024,1x32768,8x8192 --steps 6 --skip-kernels --modes graph
      run long_qwen4 "${BENCH[@]}" --geometry qwen3.8-flash-next-8l --cases 128x1x32,8192x1x16,32768x1x16 \
        --check-cases "" --prefill 8192 --prefill-attn triton
      for geometry in mimo-v2.6-flash-8l@4 qwen3.5-122b-a10b-24l@8; do
        run "prefill_${geometry%%@*}" "${BENCH[@]}" --geometry "$geometry" --cases 128x1x16 --check-cases "" \
          --prefill 8192 --prefill-attn triton
      done ;;
    *) echo "unknown step $step" | tee -a "$OUT/steps.log" ;;
  esac
done
