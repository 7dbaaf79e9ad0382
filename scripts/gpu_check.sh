#!/usr/bin/env bash
# The checks that need a GPU, as one prepared run on a lent device machine (CUDA, PyTorch and Triton there, nothing
# to download):
# - quantized checkpoints on CUDA (bench/quantized_cuda_bench.py): bf16 against AWQ 4-bit through GemLite's W4A16
#   kernels, the same copy dequantized at load, and GPTQ 8-bit through W8A16: kernels chosen, memory, decode steps,
#   agreement;
# - flash-linear-attention's kernels for hybrid models against PyTorch's forms (bench/linear_attention_kernels_bench.py).
# fla-core and gemlite travel in .venv/fla and .venv/gemlite, where scripts/setup.sh installs them:
#   run(command="bash scripts/gpu_check.sh", carry=[".venv/fla", ".venv/gemlite"], timeout_s=590)
# Results land in $OUT (or ./gpu-check when OUT is unset); each part has its own time limit, so one that hangs leaves
# the others their time.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  PYTHONPATH=".venv/gemlite:." "$python" -c 'import torch, triton, gemlite; print("torch", torch.__version__, "triton", triton.__version__, "gemlite", gemlite.__version__)'
  PYTHONPATH=".venv/gemlite:." timeout "${QUANTIZED_TIMEOUT:-470}" \
    "$python" bench/quantized_cuda_bench.py --device cuda --out "$out/quantized_cuda.json" \
    || echo "gpu_check: quantized_cuda_bench failed or ran out of time ($?)"
  PYTHONPATH=".venv/fla:." timeout "${LINEAR_TIMEOUT:-90}" \
    "$python" bench/linear_attention_kernels_bench.py --device cuda --out "$out/linear_attention_kernels.json" \
    || echo "gpu_check: linear_attention_kernels_bench failed or ran out of time ($?)"
} 2>&1 | tee "$out/gpu_check.log"
