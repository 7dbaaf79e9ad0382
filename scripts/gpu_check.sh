#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run on a lent device machine (CUDA, PyTorch and Triton there, nothing
# to download): flash-linear-attention's kernels for hybrid models against PyTorch's forms, timed in the same run
# (bench/linear_attention_kernels_bench.py). fla-core travels in .venv/fla, where scripts/setup.sh installs it:
#   run(command="bash scripts/gpu_check.sh", carry=[".venv/fla"], timeout_s=480)
# Results land in $OUT (or ./gpu-check when OUT is unset).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH=".venv/fla:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" -c 'import torch, triton, fla; print("torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__)'
  "$python" bench/linear_attention_kernels_bench.py --device cuda --out "$out/linear_attention_kernels.json"
} 2>&1 | tee "$out/gpu_check.log"
