"""Quantized checkpoint formats: what config.json's `quantization_config` says (`quantization_of`), one module per
format for how it stores a linear layer, and `QuantizedLinears`, which the loader asks which tensors make which
weight. For now every format is dequantized to the serving dtype at load: memory is the serving dtype's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qwenserve.engine.errors import CheckpointError
from qwenserve.engine.quantization import awq, compressed_tensors, fp8, gptq
from qwenserve.engine.quantization.linears import QuantizedLinears
from qwenserve.engine.quantization.scheme import LinearLayout, Part, Quantization

__all__ = ["SUPPORTED", "LinearLayout", "Part", "Quantization", "QuantizedLinears", "quantization_of"]

PARSERS: dict[str, Callable[[dict[str, Any]], Quantization]] = {
    "awq": awq.parse,
    "gptq": gptq.parse,
    "compressed-tensors": compressed_tensors.parse,
    "fp8": fp8.parse,
}
SUPPORTED = ("awq (GEMM, 4-bit), gptq (4- or 8-bit), compressed-tensors (pack-quantized int4/int8) and fp8 "
             "(block scales)")


def quantization_of(config: dict[str, Any]) -> Quantization | None:
    """What `config`'s quantization_config (config.json as the one reader returns it) describes; None for a checkpoint
    in plain weights. CheckpointError, in one line naming the method and what is supported, when it cannot load."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"config.json's quantization_config must be an object, not {type(qc).__name__}")
    method = str(qc.get("quant_method") or "").lower()
    parse = PARSERS.get(method)
    if parse is None:
        raise CheckpointError(f"quantization method {method or '(none)'!r} is not supported: qwen-serve loads {SUPPORTED}")
    return parse(qc)
