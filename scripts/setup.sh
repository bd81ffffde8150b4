#!/usr/bin/env bash
# Create .venv and install xllm-py with its test extras. Safe to run again.
# Pins the CPU build of torch (torch==2.13.0) when the venv has no torch yet, so that
# nothing pulls a multi-GB CUDA build by accident; an existing torch is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${XLLM_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${XLLM_TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q -e ".[test,ucx]"
echo "xllm-py installed in $VENV (activate with: . $VENV/bin/activate)"
