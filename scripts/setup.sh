#!/usr/bin/env bash
# Install ftrain for development: torch first (the CPU build when no GPU is present, so a fresh CPU
# machine never downloads multi-GB CUDA wheels), then the package with every optional extra.
set -euo pipefail
PY=${PYTHON:-python}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$PY" -m pip install "torch>=2.4"
elif "$PY" -c "import torch, sys; sys.exit(0 if '+cpu' in torch.__version__ or not torch.version.cuda else 1)" 2>/dev/null; then
  echo "setup: CPU torch already installed"
else
  # The +cpu wheel comes from a local wheel directory or from PyTorch's CPU index; point pip at
  # the latter with PIP_EXTRA_INDEX_URL on machines that have neither.
  "$PY" -m pip install "torch==${FTRAIN_TORCH_VERSION:-2.13.0}+cpu" \
    || "$PY" -m pip install "torch==${FTRAIN_TORCH_VERSION:-2.13.0}"
fi
"$PY" -m pip install -e ".[dev]"
