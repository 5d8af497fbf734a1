#!/usr/bin/env bash
# One-time set-up on a fresh machine with nothing but Python: torch (torch==$TORCH_VERSION, 2.13.0
# unless set, the CPU wheel on this machine's disk, when no torch is installed yet; a GPU machine
# keeps its own CUDA build), then this package in editable mode with its test extras. PYTHON picks
# the interpreter (a virtual environment's, say).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
"$PY" -m pip install -q -e ".[test]"
