"""The one place that chooses an engine's kernels, from its config and its device, once per engine.

`select_kernels` returns a `KernelSet`, handed down from there: its `ops` to the model's layers, its attention
backend to the model runner, its C kernels (`cpu`) to the runner (a KV import's scatter) and the grammar (the
logits' token masks). Nothing below asks again which kernels run.

- The precision (engine/precision.py): the dtypes of the activations, the packed weights and the KV cache, under
  `--dtype auto` from a start-up probe of this CPU's products.
- The C kernels (qwenserve.cpu_kernels) unless `cpu_kernel` is off: a CPU model's products on packed weights
  (fp32 models; the weights packed in fp32 or bf16, and PyTorch's bf16 product from the row count where the probe
  found it faster), its decode attention (fp32 queries over an fp32 or bf16 KV cache) and its linear-attention
  layers' recurrent update; on any device, the grammar's masks of the logits, which are on the CPU.
- A checkpoint stored in 4- or 8-bit integer codes (AWQ, GPTQ, compressed-tensors) on a CPU with the C kernels:
  its linear weights kept as codes and multiplied by the W4A16 / W8A16 kernel (models/quantized_linear.py); on CUDA
  where GemLite is installed and passes its start-up check, by GemLite's Triton kernels (models/gemlite_linear.py);
  unless `dequantize_weights`. Elsewhere, and for FP8, they are dequantized to the model's dtype at load, logged.
- On a CPU with the C kernels, unless `screen_lm_head` is off (or the head is quantized itself): the LM head's 8-bit
  codes beside it, which bound where a greedy or top-k step's largest logits can be (models/screened_head.py).
- On CUDA, flash-attn's paged attention where it imports and the dtype and block size suit it, and a hybrid model's
  recurrences in flash-linear-attention's and causal-conv1d's kernels unless `linear_attention_kernels` is off
  (models/linear_attention_gpu.py: each only where installed and agreeing with PyTorch's forms on the device).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from qwenserve.cpu_kernels import loader
from qwenserve.cpu_kernels.builder import cpu_flags
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.engine.attention import default_block_size, select_backend
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.precision import Precision, resolve_precision
from qwenserve.engine.quantization import Quantization, quantization_of
from qwenserve.engine.quantization.kept import CodePacker
from qwenserve.models import ModelConfig, gemlite_linear, linear_attention_gpu
from qwenserve.models.forward_context import AttentionBackend
from qwenserve.models.fused_decode import FusedRows, with_fused_decode
from qwenserve.models.ops import TORCH_OPS, Ops, cpu_kernel_ops
from qwenserve.models.quantized_head import with_quantized_head
from qwenserve.models.quantized_linear import amx_from, with_quantized_linears
from qwenserve.models.screened_head import with_screened_head

log = logging.getLogger("qwenserve.engine")

# The most rows a fused decode step runs where no other product takes over: its scratch is a few rows' activations.
FUSED_DECODE_MAX_ROWS = 256
# The most rows a step's LM head is screened for (models/screened_head.py): Qwen3-0.6B's head alone, full / screened,
# 10.8 / 6.8 ms at 1 row, 12.3 / 9.4 at 4, 13.5 / 15.7 at 8 (the codes' product reads them again per 4 rows).
SCREEN_MAX_ROWS = 4


@dataclass(frozen=True)
class KernelSet:
    """What one engine computes with. `cpu`: the C kernels, or None (off, or none load here); `ops`: what the
    model's layers call; `attention`: the attention backend over the paged KV cache, for `block_size`-token
    blocks; `precision`: the dtypes they compute in; `quantized`: the checkpoint's quantization where its linear
    weights stay codes for the W4A16 / W8A16 kernel (None: dequantized at load, or none), packed by `pack_codes`
    (None: the CPU kernel's QuantWeight); `prefill_on_tiles`: a CPU's prompt chunks run on AMX tiles, products and
    attention, fast enough for CUDA's token budget (EngineConfig.token_budget)."""

    cpu: CpuKernels | None
    ops: Ops
    attention: AttentionBackend
    block_size: int
    precision: Precision
    quantized: Quantization | None = None
    pack_codes: CodePacker | None = None
    prefill_on_tiles: bool = False

    @property
    def name(self) -> str:
        """e.g. 'ops=cpu_kernels attention=torch', for the start-up line."""
        return f"ops={self.ops.name} attention={self.attention.name}"


def select_kernels(config: EngineConfig, device: torch.device, model: ModelConfig | None = None) -> KernelSet:
    """The kernels of an engine with `config` on `device` for `model` (its shape sizes the precision probe; its
    being hybrid keeps its KV in its own dtype)."""
    cpu = None
    if config.cpu_kernel:
        cpu = loader.load()
    else:
        log.warning("CPU kernels off (--no-cpu-kernel, QWENSERVE_CPU_KERNEL=0): PyTorch's ops run instead, slower")
    shape = (model.hidden_size, model.intermediate_size or model.moe_intermediate_size) if model else None
    precision = resolve_precision(config, device, cpu if device.type == "cpu" else None, shape,
                                  bool(model and model.is_hybrid))
    dtype = precision.dtype
    backend = config.attention_backend
    if precision.kv_dtype != dtype:
        # flash-attn's paged kernels read a cache of the query's dtype; the torch backend widens what it reads.
        if backend == "flash_attn":
            raise ValueError(f"attention backend 'flash_attn' needs the KV cache in the model's dtype ({dtype}); "
                             f"drop --kv-cache-dtype {config.kv_cache_dtype} or use --attention-backend torch")
        backend = "torch"
    block_size = config.block_size or default_block_size(device, dtype)
    # A bf16 model's prompts attended on AMX tiles where the CPU has them (the kernel declines elsewhere too).
    amx_prefill = device.type == "cpu" and dtype == torch.bfloat16 and "amx_bf16" in cpu_flags()
    # Without AMX, PyTorch's bf16 attention runs slower than its fp32 one (torch_backend.py): prompts in fp32 there.
    widen_prefill = device.type == "cpu" and dtype == torch.bfloat16 and not amx_prefill
    attention = select_backend(backend, device, dtype, block_size, cpu if device.type == "cpu" else None,
                               amx_prefill, widen_prefill)
    ops = model_ops(config, device, precision, cpu)
    quantized = kept_quantization(config, device, cpu, model, dtype)
    pack_codes = None
    if quantized is not None and device.type == "cuda":
        label = f"w{quantized.bits}a16"
        ops = gemlite_linear.with_gemlite_linears(ops, label)
        pack_codes = gemlite_linear.code_packer(device, dtype)
        precision = dataclasses.replace(precision, quantized=label, reason=f"{precision.reason}; linear weights "
                                        f"{label.upper()}: {quantized.describe()} kept as codes for GemLite")
    elif quantized is not None:
        assert cpu is not None
        label = f"w{quantized.bits}a16"
        # bf16 activations lose nothing more to AMX's bf16 x; fp32 ones only where the engine already rounds x for
        # PyTorch's bf16 product.
        bf16_rows = 1 if precision.dtype == torch.bfloat16 else precision.dense_rows
        ops = with_quantized_linears(ops, cpu, label, bf16_rows)
        amx_rows = amx_from(label, bf16_rows)
        if amx_rows is not None and ops.decode_layers is not TORCH_OPS.decode_layers:
            ops = with_fused_decode(ops, cpu, fused_rows(precision, amx_rows))
        precision = dataclasses.replace(precision, quantized=label, reason=f"{precision.reason}; linear weights "
                                        f"{label.upper()}: {quantized.describe()} kept as codes")
    if config.quantize_lm_head == "int8":
        if device.type == "cpu" and cpu is not None:
            bf16_rows = 1 if precision.dtype == torch.bfloat16 else precision.dense_rows
            ops = with_quantized_head(ops, cpu, dtype, amx_from("w8a16", bf16_rows))
            precision = dataclasses.replace(precision, lm_head="w8a16", reason=f"{precision.reason}; LM head 8-bit "
                                            "codes (--quantize-lm-head int8)")
        else:
            log.warning("--quantize-lm-head int8 applies on a CPU with the C kernels; the LM head stays %s",
                        str(dtype).removeprefix("torch."))
    if config.screen_lm_head and config.quantize_lm_head == "none" and device.type == "cpu" and cpu is not None:
        # Only steps below the row count where the head's product moves to another kernel (the screen computes its
        # candidates with the panels' product).
        dense = precision.dense_rows if precision.weight_dtype == torch.bfloat16 else None
        ops = with_screened_head(ops, cpu, min(SCREEN_MAX_ROWS, dense - 1) if dense else SCREEN_MAX_ROWS)
    prefill_on_tiles = amx_prefill and cpu is not None and precision.dense_product == "amx" \
        and precision.dense_rows is not None
    return KernelSet(cpu, ops, attention, block_size, precision, quantized, pack_codes, prefill_on_tiles)


def kept_quantization(config: EngineConfig, device: torch.device, cpu: CpuKernels | None,
                      model: ModelConfig | None, dtype: torch.dtype) -> Quantization | None:
    """The quantization of `model`'s checkpoint where its linears stay 4- or 8-bit codes: integer formats (not FP8),
    unless `dequantize_weights`, on a CPU with the C kernels, or on CUDA where GemLite imports and agrees with
    PyTorch for 16-bit activations of `dtype`."""
    if model is None or config.dequantize_weights:
        return None
    quantization = quantization_of(model.raw)
    if quantization is None or quantization.block is not None or quantization.bits not in (4, 8):
        return None
    if device.type == "cpu":
        return quantization if cpu is not None else None
    if device.type == "cuda":
        if dtype in (torch.bfloat16, torch.float16) and gemlite_linear.gemlite_available() \
                and gemlite_linear.gemlite_agrees(device, dtype, quantization.bits):
            return quantization
        log.warning("%s on CUDA: linear weights dequantized to %s at load (GemLite's W%dA16 kernels are not installed "
                    "(`pip install gemlite`, in the gpu extra), failed their start-up check (logged above), or the "
                    "model's dtype is not 16-bit)", quantization.describe(), str(dtype).removeprefix("torch."),
                    quantization.bits)
    return None


def model_ops(config: EngineConfig, device: torch.device, precision: Precision, cpu: CpuKernels | None) -> Ops:
    """The model's ops: the C kernels' on a CPU where they load (the packed product runs several times PyTorch's
    BLAS at decode sizes, the recurrent update ~50x PyTorch's ops: bench/kernels_bench.py), the kernel packages'
    recurrences on CUDA where installed and switched on, PyTorch's everywhere else."""
    if device.type == "cpu" and cpu is not None:
        ops = cpu_kernel_ops(cpu, precision.dtype, precision.weight_dtype, precision.dense_rows,
                             precision.dense_product)
        if precision.dtype == torch.bfloat16 and precision.kv_dtype == torch.bfloat16 \
                and precision.weight_dtype == torch.bfloat16 and config.fused_decode:
            ops = with_fused_decode(ops, cpu, fused_rows(precision))
        return ops
    if device.type == "cuda" and config.linear_attention_kernels:
        return cuda_ops(device, precision.dtype)
    return TORCH_OPS


def fused_rows_of(precision: Precision) -> int:
    """Decode steps of fewer rows than this run every layer in one C call where the many-row product is one the call
    cannot make (PyTorch's): up to where it takes over from the panels (from there the layer-by-layer path runs it)."""
    return precision.dense_rows or FUSED_DECODE_MAX_ROWS


def fused_rows(precision: Precision, quant_amx_rows: int | None = None) -> FusedRows:
    """Which decode steps run in one C call: every one up to FUSED_DECODE_MAX_ROWS rows where the many-row products
    are ours on AMX tiles (the call makes them from the same row counts; codes from `quant_amx_rows`); where the
    bf16 one is PyTorch's, bf16 panels only below its row count."""
    tiled = precision.dense_product == "amx" and precision.dense_rows is not None
    return FusedRows(FUSED_DECODE_MAX_ROWS if tiled or quant_amx_rows is not None else fused_rows_of(precision),
                     fused_rows_of(precision), quant_amx_rows, precision.dense_rows if tiled else None)


def cuda_ops(device: torch.device, dtype: torch.dtype) -> Ops:
    """PyTorch's ops with the Gated DeltaNet recurrences of whichever kernel packages are installed and pass their
    start-up check on `device`."""
    gpu = linear_attention_gpu
    ops = TORCH_OPS
    if gpu.fla_available() and gpu.fla_agrees(device):
        ops = dataclasses.replace(ops, name=f"{ops.name}+fla", gated_delta_step=gpu.fla_gated_delta_step,
                                  gated_delta_prefills=gpu.fla_gated_delta_prefills)
    if gpu.causal_conv1d_available() and gpu.causal_conv1d_agrees(device, dtype):
        ops = dataclasses.replace(ops, name=f"{ops.name}+causal_conv1d", short_conv_step=gpu.causal_conv1d_step)
    return ops
