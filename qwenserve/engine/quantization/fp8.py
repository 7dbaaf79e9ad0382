"""FP8 with block scales (`quant_method: fp8`, `weight_block_size: [128, 128]`), as Qwen's `-FP8` checkpoints are.

Per linear with weight W [out, in] and blocks of R x C:
- `weight` float8_e4m3fn [out, in];
- `weight_scale_inv` float32 [ceil(out / R), ceil(in / C)]: one scale per block, the blocks at the right and bottom
  edges partial.
W[o, i] = weight[o, i] * weight_scale_inv[o // R, i // C] (the name says "inverse" of the quantizer's scale: it
multiplies). Activations stay in 16 bits: `activation_scheme: dynamic` quantizes them at run time, which a
dequantized model need not do.
"""

from __future__ import annotations

from typing import Any

import torch

from qwenserve.engine.errors import CheckpointError
from qwenserve.engine.quantization.scheme import FLOAT_DTYPES, Part, Quantization

SUPPORTED = "FP8 (e4m3) weights with block scales (weight_block_size) and dynamic activation scales"


class Fp8BlockLayout:
    """weight / weight_scale_inv as DeepSeek-style block-wise FP8 checkpoints store them."""

    marker = "weight_scale_inv"
    required = ("weight", "weight_scale_inv")

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def parts(self, out_features: int, in_features: int) -> dict[str, Part]:
        """weight [out, in] in float8_e4m3fn, weight_scale_inv [ceil(out/R), ceil(in/C)]."""
        rows, cols = self.block
        return {
            "weight": Part((out_features, in_features), (torch.float8_e4m3fn,)),
            "weight_scale_inv": Part((-(-out_features // rows), -(-in_features // cols)), FLOAT_DTYPES),
        }

    def dequantize(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
        """Each block times its scale, in fp32."""
        rows, cols = self.block
        scales = parts["weight_scale_inv"].float()
        scales = scales.repeat_interleave(rows, dim=0)[:out_features].repeat_interleave(cols, dim=1)[:, :in_features]
        return parts["weight"].float() * scales

    def integer(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int) -> None:
        """None: FP8 values are floats, dequantized at load."""
        return None


def parse(qc: dict[str, Any]) -> Quantization:
    """The Quantization an FP8 quantization_config describes; CheckpointError (one line) for what is not supported."""
    block = qc.get("weight_block_size", [128, 128])
    fmt = str(qc.get("fmt") or "e4m3").lower()
    scheme = str(qc.get("activation_scheme") or "dynamic").lower()
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
        raise CheckpointError(f"FP8 with weight_block_size {block!r} is not supported: qwen-serve loads {SUPPORTED}")
    if fmt != "e4m3":
        raise CheckpointError(f"FP8 format {fmt!r} is not supported: qwen-serve loads {SUPPORTED}")
    if scheme != "dynamic":
        raise CheckpointError(f"FP8 activation_scheme {scheme!r} is not supported: qwen-serve loads {SUPPORTED}")
    if str(qc.get("scale_fmt") or "float") != "float" or qc.get("modules_to_convert"):
        raise CheckpointError(f"FP8 with scale_fmt {qc.get('scale_fmt')!r} or modules_to_convert is not supported: "
                              f"qwen-serve loads {SUPPORTED}, float32 scales on linear layers")
    rows, cols = block
    return Quantization(
        method="fp8", bits=8, group_size=None, symmetric=True, layout=Fp8BlockLayout((rows, cols)), block=(rows, cols),
        not_converted=tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()), lm_head=True,
    )
