#!/usr/bin/env bash
# Correctness on a CUDA GPU: the CUDA-only pytest tests (skipped without a GPU) and the check scripts whose
# references were prepared on a CPU-only host (`... prepare --dir .cache/...`). Logs under $OUT. Not a CI step.
# Plugins are found through their entry points: on a GPU host without package access, put wheels of dgpp-core and
# the plugins in .whl (the code itself still comes from the tree, which is first on PYTHONPATH):
#   pip wheel -q --no-deps --no-build-isolation -w .whl ./dgpp-core ./plugins/dgpp-*
#   bash tests/perf/run_cuda_checks.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TRITON_INTERPRET=0
status=0
# only the tests that skip without a GPU: the rest feed CPU tensors to kernels written for the Triton interpreter
python3 -m pytest -q -p no:cacheprovider -o addopts="" -k "cuda or gpu" tests/kernels/test_moe.py \
  tests/kernels/test_decode_graphs.py tests/core/test_sampler.py plugins/dgpp-qwen/tests/test_qwen3_cuda.py \
  tests/core/test_speculative_cuda.py tests/core/test_sink_full_layers_cuda.py \
  tests/core/test_exact_cuda_routing.py::test_batch_invariant_chunked_prefill_equals_one_shot_on_cuda ${CUDA_TESTS:-} 2>&1 \
  | tee "$OUT/pytest_cuda.log" || status=1
for check in "plugins/dgpp-qwen/tests/check_qwen4_exp_cuda.py check --dir .cache/qwen4_exp_gpu" \
             "plugins/dgpp-glm/tests/check_glm4_moe_cuda.py check --dir .cache/glm_gpu" \
             "tests/core/test_speculative_cuda.py check --dir .cache/spec_gpu" \
             "tests/perf/check_exact_cuda.py" \
             "tests/perf/check_glm5_cuda.py --cases 1x1024 --steps 4"; do
  echo "== $check"
  python3 $check 2>&1 | tee -a "$OUT/checks.log" || status=1
done
exit $status
