#!/usr/bin/env bash
# Installs everything qwen-serve and its tests need into .venv (idempotent, safe to re-run).
#   QWENSERVE_TORCH   pip requirement for torch (default: torch==2.13.0, the CPU build on this kind
#                     of machine; set e.g. "torch" on a CUDA host to use its own build)
#   QWENSERVE_EXTRAS  extras to install (default: dev)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
torch_spec=${QWENSERVE_TORCH:-torch==2.13.0}
extras=${QWENSERVE_EXTRAS:-dev}

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "WARNING: Location" >&2); }

# torch first and pinned, so that resolving the project never pulls a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "$torch_spec"
pip install -e ".[${extras}]"
# The CPU kernels, one object per instruction-set level, so that no process compiles them at first use.
.venv/bin/python -m qwenserve.cpu_kernels build >/dev/null \
  || echo "setup: the CPU kernels could not be built: PyTorch's ops will run instead, slower" >&2
# flash-linear-attention for its tests in Triton's interpreter (tests/engine/test_linear_attention_gpu.py), in a folder
# of its own: on the venv's path, transformers would run its kernels for the CPU reference models, where they cannot.
[ -d .venv/fla/fla ] || pip install --no-deps --target .venv/fla "fla-core==0.6.0" "einops==0.8.1"
# GemLite's W4A16 / W8A16 kernels likewise, for their test in Triton's interpreter (tests/engine/test_gemlite_linear.py)
# and for scripts/gpu_check.sh to carry.
[ -d .venv/gemlite/gemlite ] || pip install --no-deps --target .venv/gemlite "gemlite==0.6.0.post2"

# The tests talk to a real Redis server; Mooncake's engine loads libibverbs even over TCP; the chart's alerts are
# tested with promtool (Debian's prometheus package; nothing is started); the dev cluster enforces NetworkPolicies
# with nft.
debs=()
command -v redis-server >/dev/null 2>&1 || debs+=(redis-server)
command -v nft >/dev/null 2>&1 || debs+=(nftables)
ldconfig -p | grep -q libibverbs.so.1 || debs+=(libibverbs1 librdmacm1 libnuma1)
lean=()  # without their recommendations (prometheus would bring a node exporter)
command -v promtool >/dev/null 2>&1 || lean+=(prometheus)
if [ ${#debs[@]} -gt 0 ] || [ ${#lean[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    [ ${#debs[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${debs[@]}" >/dev/null
    [ ${#lean[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${lean[@]}" >/dev/null
  else
    echo "setup: missing Debian packages: ${debs[*]} ${lean[*]}" >&2
  fi
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
