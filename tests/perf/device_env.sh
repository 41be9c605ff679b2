# Sourced by the GPU scripts (run_gpu.sh, run_cuda_checks.sh): pure-python packages a GPU host without package
# access lacks are installed from wheels in .whl to /tmp/site; the tree's dgpp-core and plugin sources come
# first on PYTHONPATH, so the wheels of dgpp itself only contribute their entry points.
OUT=${OUT:-perf_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
src=$(ls -d "$PWD"/plugins/*/src | tr '\n' ':')
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/dgpp-core/src:$src${PYTHONPATH:-}"
