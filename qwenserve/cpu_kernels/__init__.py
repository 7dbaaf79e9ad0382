"""C kernels for what PyTorch's CPU ops leave slow, each kept because bench/kernels_bench.py measures a gain that
shows in a step: decode attention read straight from the paged KV cache (paged_decode.c); the linear layers'
x · Wᵀ on weights packed in panels of 16 output columns (linear.c, packed_weight.py); structured output's token
mask applied to the logits without unpacking it (token_bitmask.c); a hybrid model's recurrent update at decode, in
place in the state slots (gated_delta.c); and the KV handoff's checksum, with the copy, the gather and the scatter
that compute it or move the bytes (kv_checksum.c; kv_transfer/checksum.py defines the algorithm). They are loaded
with ctypes: no Python or torch headers, so no ABI to keep.

- builder.py: built at install time, `python -m qwenserve.cpu_kernels build` (scripts/setup.sh and the image build
  run it), one shared object per instruction-set level, so a pod never compiles;
- loader.py: `load()` opens the best one this CPU runs (or builds one at first use where none was built) as a
  `CpuKernels` value, or says once with a WARNING why there is none;
- library.py: `CpuKernels`, each kernel's checked Python call;
- packed_weight.py: `PackedWeight`, the layout of the packed product's weights.

Which kernels an engine runs is chosen once, from its config, in engine/kernels.py (`--no-cpu-kernel`,
QWENSERVE_CPU_KERNEL=0, turns them off; the qwenserve_cpu_kernels_available gauge then reads 0).
"""
