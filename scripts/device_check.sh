#!/usr/bin/env bash
# One device call: install (no network there), the whole test suite (CPU + gpu-marked), the demo on
# CUDA, then the benchmark suite given as arguments (e.g. `gemm_epilogue --no-max-autotune`). Logs go to $OUT.
# Env: SKIP_TESTS=1, BENCH_FIRST=1, TEST_TIMEOUT=s, BENCH_TIMEOUT=s, PYTEST_ARGS="-m gpu", PYTEST_WORKERS=N
# (default 6, 0: one process), XACCEL_COMMIT=<hash> (the device copy has no .git).
# Anchor wheels and the CUTLASS headers (without them the CUTLASS GPU tests skip):
# `python3 -m pip download --no-deps -d .whl xlstm==2.0.6 mlstm-kernels==2.0.6 flashrnn==1.0.8 nvidia-cutlass==4.2.0.0`
# here, then name .whl in the device call's carry.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XACCEL_CACHE_DIR=${XACCEL_CACHE_DIR:-/tmp/xaccel-cache}
# at most 8 files come back from a device call: installs and versions share setup.log
# (an image whose setuptools predates SPDX licence metadata cannot install it: the checkout is then
# imported from its root, the backend registered by torch_xaccel itself)
python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/setup.log" 2>&1 \
  || { echo "pip install failed, running from the checkout:"; tail -5 "$OUT/setup.log"; export PYTHONPATH="$PWD"; }
# pure-Python wheels (xlstm, mlstm-kernels, flashrnn, nvidia-cutlass), when the call carries .whl
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >> "$OUT/setup.log" 2>&1 \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/setup.log"
run_tests() {
  [ "${SKIP_TESTS:-0}" = 1 ] && return
  python3 -m torch_xaccel.demo 2>&1 | tee "$OUT/demo.log" | tail -4
  # PYTEST_ARGS narrows the run (e.g. "-m gpu"); default: the whole suite, CPU tests included
  # SIGINT on timeout: pytest still prints its summary; no:logging keeps the xlstm tests' DEBUG
  # logs from drowning the tracebacks
  # pytest-xdist (on the device image) spreads test files over processes: the -m gpu suite is
  # bound by kernel compiles on the host (PYTEST_WORKERS=0: one process)
  local workers=""
  if [ "${PYTEST_WORKERS:-6}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
    workers="-n ${PYTEST_WORKERS:-6} --dist loadfile"
  fi
  timeout -s INT "${TEST_TIMEOUT:-3600}" python3 -m pytest -q -p no:cacheprovider -p no:logging --show-capture=no \
    --tb=short --durations=20 $workers ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED|Error" | tail -15
}
run_bench() {
  [ $# -gt 0 ] || return
  timeout -s INT "${BENCH_TIMEOUT:-3600}" python3 -m torch_xaccel.bench "$@" --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^  " | tail -30
}
# BENCH_FIRST=1: timings before tests, so a long test run cannot cut them; *_TIMEOUT bound each part
if [ "${BENCH_FIRST:-0}" = 1 ]; then run_bench "$@"; run_tests; else run_tests; run_bench "$@"; fi
