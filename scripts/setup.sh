#!/usr/bin/env bash
# One-time set-up on a fresh machine with nothing but Python: torch (the CPU wheel when no torch is
# installed yet; a GPU machine keeps its own CUDA build), then this package with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test]"
