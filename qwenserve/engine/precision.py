"""An engine's precision: the dtypes of its activations, its linear weights and its KV cache, and why.

`--dtype auto` (the default) on a CPU where the C kernels load serves
- bf16 throughout where the start-up probe (cpu_kernels/linear_probe.py) finds our bf16 panels at least
  `MIN_BF16_SPEEDUP` times faster than fp32 at one row (a decode step streams half the bytes): the linear weights
  packed in bf16 (the panels widen them to fp32 and accumulate in fp32), and the activations in bf16, as a bf16
  model in transformers or vLLM, so that a prefill's norms, rotary embeddings and attention move half the bytes and
  run on the CPU's bf16 units; the logits stay fp32. From the row count where the probe finds PyTorch's bf16
  product faster than our panels (oneDNN: AMX or AVX512_BF16 on the CPUs that have them), products run there, on an
  unpacked bf16 copy of each weight. A hybrid model (Gated DeltaNet layers) keeps fp32 activations over its bf16
  weights: its recurrent state is fp32;
- fp32 elsewhere;
- its KV cache in bf16, chosen from what loaded and never from a measurement: a prefill and a decode worker of
  one deployment must agree on it (a handoff between caches of different dtypes is refused), and a timing may
  differ between two processes where a kernel's presence does not.
Anything explicit wins: `--dtype float32` is fp32 throughout (token-exact with transformers), `--cpu-weight-dtype`
and `--kv-cache-dtype` set their part. On CUDA, `auto` is bf16 throughout, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qwenserve.cpu_kernels import linear_probe
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.linear_probe import LinearProbe
from qwenserve.engine.config import EngineConfig
from qwenserve.kv_layout import TORCH_DTYPES

log = logging.getLogger("qwenserve.engine")

# bf16 panels are chosen where they decode at least this much faster than fp32's (else the rounding buys nothing).
MIN_BF16_SPEEDUP = 1.1
# The probe's shape when no model is given (Qwen3-0.6B's MLP).
DEFAULT_PROBE_MODEL = (1024, 3072)

Probe = Callable[[CpuKernels, int, int, int], LinearProbe]
# The many-row products, as the start-up log names them.
DENSE_PRODUCT_NAMES = {"amx": "our bf16 product on AMX tiles", "onednn": "PyTorch's bf16 product"}


@dataclass(frozen=True)
class Precision:
    """`dtype`: the model's (activations, norms, embeddings, weights left unpacked); `weight_dtype`: the packed
    linear weights' (the model's where none are packed); `kv_dtype`: the paged KV cache's; `dense_rows`: products
    of at least this many rows run in `dense_product` on a bf16 copy of the weight laid out for it (None: never):
    'amx', ours on AMX tiles (linear_amx.c), or 'onednn', PyTorch's bf16 product;
    `reason`: why, for the start-up log and the metrics. A bf16 `dtype` with bf16 `weight_dtype` on a CPU is the
    packed product's too (ops.cpu_kernel_ops)."""

    dtype: torch.dtype
    weight_dtype: torch.dtype
    kv_dtype: torch.dtype
    dense_rows: int | None = None
    reason: str = ""
    dense_product: str = "onednn"
    # 'w4a16' / 'w8a16' where a checkpoint's linear weights stay 4- or 8-bit codes (engine/kernels.py): shown as the
    # weights' part in place of weight_dtype, which is then what the others (the LM head) are packed in.
    quantized: str | None = None
    # 'w8a16' where the LM head is held as 8-bit codes (--quantize-lm-head int8; models/quantized_head.py).
    lm_head: str | None = None

    def labels(self) -> dict[str, str]:
        """The dtypes by part, as names ('float32', 'bfloat16', 'w4a16'), for the precision metric and status."""
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        weights = self.quantized or name(self.weight_dtype)
        return {"activations": name(self.dtype), "weights": weights, "kv": name(self.kv_dtype)}

    @property
    def name(self) -> str:
        """e.g. 'float32', 'bfloat16 amx>=16' or 'weights=bfloat16 kv=float32 activations=float32'."""
        labels = self.labels()
        if len(set(labels.values())) == 1:
            text = labels["activations"]
        else:
            text = f"weights={labels['weights']} kv={labels['kv']} activations={labels['activations']}"
        text += f" lm_head={self.lm_head}" if self.lm_head else ""
        return text + (f" {self.dense_product}>={self.dense_rows}" if self.dense_rows else "")


def is_auto(config: EngineConfig) -> bool:
    """Whether the engine's dtype is left to it (`--dtype auto`, the default)."""
    return config.dtype in (None, "auto")


def resolve_precision(config: EngineConfig, device: torch.device, cpu: CpuKernels | None,
                      model_shape: tuple[int, int] | None = None, hybrid: bool = False,
                      probe: Probe | None = None) -> Precision:
    """The precision of an engine with `config` on `device` with the C kernels `cpu` (None: not loaded), for a
    model of (hidden_size, intermediate_size) `model_shape`; `hybrid` models keep their KV in the model's dtype
    (their handoff's convolution state shares the layout's one dtype). `probe` measures the products (default:
    linear_probe.measure; tests stand one in)."""
    dtype = config.torch_dtype()
    packs = device.type == "cpu" and cpu is not None and dtype == torch.float32
    auto = is_auto(config) and packs
    reasons = []
    weight_dtype, dense_rows, dense_product = dtype, None, "onednn"

    def measure() -> LinearProbe:
        assert cpu is not None
        n, k = linear_probe.probe_shape(*(model_shape or DEFAULT_PROBE_MODEL))
        measured = (probe or linear_probe.measure)(cpu, n, k, torch.get_num_threads())
        log.info("linear products on this CPU (%s): %s", cpu.variant, measured.summary())
        return measured

    if packs and config.cpu_weight_dtype != "auto":
        weight_dtype = TORCH_DTYPES[config.cpu_weight_dtype]
        reasons.append(f"weights {config.cpu_weight_dtype} (--cpu-weight-dtype)")
    elif device.type == "cpu" and cpu is not None and dtype == torch.bfloat16:
        # --dtype bfloat16: the packed bf16 panels for a step's few rows, a many-row product where it wins.
        measured = measure()
        dense_rows, dense_product = measured.dense_from(), measured.dense_product()
        reasons.append("--dtype bfloat16" + (f"; {DENSE_PRODUCT_NAMES[dense_product]} from {dense_rows} rows, where "
                                             "it beats the panels" if dense_rows else ""))
    elif auto:
        measured = measure()
        speedup = measured.bf16_speedup()
        if speedup >= MIN_BF16_SPEEDUP:
            weight_dtype, dense_rows, dense_product = torch.bfloat16, measured.dense_from(), measured.dense_product()
            reasons.append(f"weights bfloat16: bf16 panels decode {speedup:.2f}x fp32's here")
            if not hybrid:
                dtype = torch.bfloat16
                reasons.append("activations bfloat16 (logits float32)")
            if dense_rows:
                reasons.append(f"{DENSE_PRODUCT_NAMES[dense_product]} from {dense_rows} rows, where it beats the "
                               "panels")
        else:
            reasons.append(f"weights float32: bf16 panels decode only {speedup:.2f}x fp32's here")
    if config.kv_cache_dtype != "auto":
        kv_dtype = TORCH_DTYPES[config.kv_cache_dtype]
        reasons.append(f"KV {config.kv_cache_dtype} (--kv-cache-dtype)")
    elif auto and not hybrid:
        kv_dtype = torch.bfloat16
        reasons.append("KV bfloat16: half the bytes a decode step reads (the bf16 attention kernel loaded)")
    else:
        kv_dtype = dtype
    if not reasons:
        reasons.append(_why_uniform(config, device, cpu, dtype))
    return Precision(dtype, weight_dtype, kv_dtype, dense_rows, "; ".join(reasons), dense_product)


def _why_uniform(config: EngineConfig, device: torch.device, cpu: CpuKernels | None, dtype: torch.dtype) -> str:
    if not is_auto(config):
        return f"--dtype {config.dtype}"
    if device.type != "cpu":
        return f"auto on {device.type}"
    if cpu is None:
        return "auto without the C kernels (PyTorch's ops)"
    return f"auto: {dtype} on this device"
