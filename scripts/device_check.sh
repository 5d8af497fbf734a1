#!/usr/bin/env bash
# One device call: install (no network there), the whole test suite (CPU + gpu-marked) and the demo on CUDA.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { echo "pip install failed:"; tail -25 "$OUT/pip.log"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.log"
python3 -m torch_xaccel.demo 2>&1 | tee "$OUT/demo.log" | tail -20
python3 -m pytest -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -40
