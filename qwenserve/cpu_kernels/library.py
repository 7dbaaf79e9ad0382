"""The loaded C kernels as one value, `CpuKernels`: each kernel's Python call, which checks what it is given
before the C code reads it. The GIL is released while a kernel runs (ctypes calls)."""

from __future__ import annotations

import ctypes
import math

import torch

from qwenserve.cpu_kernels.packed_weight import PANEL, PANEL_DTYPES, PackedWeight
from qwenserve.cpu_kernels.quant_weight import QuantWeight


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every kernel's argument and result types declared (AttributeError when one is missing)."""
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    for paged in (lib.paged_decode_attention, lib.paged_decode_attention_bf16):
        paged.restype = ctypes.c_int
        paged.argtypes = [pointer] * 3 + [i64, pointer, i64, pointer, pointer] + [i64] * 5 + [ctypes.c_float, i64]
    lib.linear_packed.restype = None
    lib.linear_packed.argtypes = [pointer] * 3 + [i64] * 4
    lib.linear_packed_bf16.restype = None
    lib.linear_packed_bf16.argtypes = [pointer] * 3 + [i64] * 4
    lib.linear_quant.restype = ctypes.c_int
    lib.linear_quant.argtypes = [pointer] * 5 + [i64] * 6
    lib.linear_quant_amx.restype = ctypes.c_int
    lib.linear_quant_amx.argtypes = [pointer] * 5 + [i64] * 5
    lib.kv_checksum_chunks.restype = None
    lib.kv_checksum_chunks.argtypes = [pointer] * 2 + [i64] * 2 + [pointer] + [i64] * 2
    lib.kv_checksum_combine.restype = ctypes.c_uint64
    lib.kv_checksum_combine.argtypes = [pointer, i64, i64]
    lib.kv_gather_checksum.restype = None
    lib.kv_gather_checksum.argtypes = [pointer, i64, i64, pointer, i64, i64, pointer, i64, pointer, i64, i64]
    lib.apply_token_bitmask.restype = None
    lib.apply_token_bitmask.argtypes = [pointer, i64, pointer, i64, pointer, i64, i64]
    lib.kv_scatter_rows.restype = None
    lib.kv_scatter_rows.argtypes = [pointer, i64, pointer, i64, i64, pointer, i64, i64, i64]
    lib.gated_delta_step.restype = ctypes.c_int
    lib.gated_delta_step.argtypes = [pointer] * 6 + [i64, pointer, pointer] + [i64] * 4 + [ctypes.c_int]
    return lib


def _check_cpu_fp32(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} wants contiguous fp32 CPU tensors")



class CpuKernels:
    """The kernels of one loaded shared object. `lib` is the library itself (kv_transfer/checksum.py calls its
    checksum kernels directly); `variant` says which object it is (e.g. 'x86-64-v3 (prebuilt)')."""

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        self.lib = lib
        self.variant = variant

    def __repr__(self) -> str:
        return f"CpuKernels({self.variant})"

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [batch, heads, dim] fp32 contiguous
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, dim] of one layer, fp32 or bf16, contiguous
        v_cache: torch.Tensor,
        block_table: torch.Tensor,  # [batch, max_blocks] int64 contiguous
        context_lens: torch.Tensor,  # [batch] int64
        out: torch.Tensor,  # [batch, heads, dim] fp32 contiguous, written
        scale: float,
    ) -> None:
        """softmax(q·K^T · scale)·V over each sequence's first context_lens[b] cached tokens, every tensor on CPU.
        A bf16 cache is widened to fp32 as it is read (the fp32 attention over the bf16 K/V). IndexError, before
        anything is read, when a block id is outside the cache. The GIL is released while it runs."""
        batch, heads, dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        _check_cpu_fp32("paged_decode_attention", q, out)
        if (k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype
                or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or k_cache.device.type != "cpu" or v_cache.device.type != "cpu"):
            raise ValueError("paged_decode_attention wants contiguous fp32 or bf16 CPU caches of one dtype")
        if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64 or not block_table.is_contiguous():
            raise ValueError("block_table and context_lens must be contiguous int64")
        if (heads % kv_heads or out.shape != q.shape or block_table.shape[0] != batch or context_lens.numel() != batch
                or v_cache.shape != k_cache.shape):
            raise ValueError("paged_decode_attention: inconsistent shapes")
        attend = self.lib.paged_decode_attention if k_cache.dtype == torch.float32 else self.lib.paged_decode_attention_bf16
        status = attend(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_table.data_ptr(),
            block_table.shape[1], context_lens.contiguous().data_ptr(), out.data_ptr(), batch, heads, kv_heads, dim,
            block_size, scale, torch.get_num_threads(),
        )
        if status == -2:
            raise IndexError(f"paged_decode_attention: a block table names a block outside [0, {num_blocks}) or is "
                             "shorter than its context (a scheduler bug)")
        if status != 0:
            raise MemoryError("paged_decode_attention could not allocate its scratch")

    def linear_packed(self, x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] @ Wᵀ -> [m, n], x and `out` contiguous fp32 CPU tensors, the panels fp32 or bf16 (widened to
        fp32 as they are read: the fp32 product of the bf16 weights), written into `out` [m, n] when given. The GIL
        is released while it runs."""
        packed = weight.panels
        _check_cpu_fp32("linear_packed", x)
        if packed.dtype not in PANEL_DTYPES or not packed.is_contiguous() or packed.device.type != "cpu":
            raise ValueError(f"linear_packed wants contiguous fp32 or bf16 CPU panels, got {packed.dtype}")
        if x.dim() != 2 or packed.dim() != 3:
            raise ValueError("linear_packed wants x [m, k] and one packed matrix")
        m, k = x.shape
        if packed.shape[1] != k:
            raise ValueError(f"linear_packed: x has {k} columns, the weight {packed.shape[1]}")
        n = packed.shape[0] * PANEL
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        elif out.shape != (m, n):
            raise ValueError(f"linear_packed: out must have shape {(m, n)}")
        _check_cpu_fp32("linear_packed", out)
        product = self.lib.linear_packed if packed.dtype == torch.float32 else self.lib.linear_packed_bf16
        product(x.data_ptr(), packed.data_ptr(), out.data_ptr(), m, k, n, torch.get_num_threads())
        return out

    def linear_quant(self, x: torch.Tensor, weight: QuantWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] @ Wᵀ -> [m, n] for a weight kept as 4- or 8-bit codes (W4A16, W8A16: linear_quant.c), x and `out`
        contiguous fp32 CPU tensors, written into `out` [m, n] when given. The GIL is released while it runs."""
        _check_cpu_fp32("linear_quant", x)
        weight.check()
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"linear_quant: x must be [m, {k}], got {tuple(x.shape)}")
        if weight.perm is not None:
            x = x.index_select(1, weight.perm)
        m = x.shape[0]
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        elif out.shape != (m, n):
            raise ValueError(f"linear_quant: out must have shape {(m, n)}")
        _check_cpu_fp32("linear_quant", out)
        status = self.lib.linear_quant(x.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(),
                                       weight.zeros.data_ptr(), out.data_ptr(), m, k, n, weight.bits, weight.group_size,
                                       torch.get_num_threads())
        if status != 0:
            raise MemoryError("linear_quant could not allocate its scratch")
        return out

    def linear_quant_amx(self, x: torch.Tensor, weight: QuantWeight, out: torch.Tensor | None = None
                         ) -> torch.Tensor | None:
        """`linear_quant` for a 4-bit weight with x rounded to bf16 first, on AMX tiles (linear_quant.c): many rows'
        product, as PyTorch's bf16 product rounds x. None where it cannot run (no AMX here or in this build, 8-bit
        codes, groups not a multiple of 32 inputs): then `linear_quant` does."""
        _check_cpu_fp32("linear_quant_amx", x)
        weight.check()
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"linear_quant_amx: x must be [m, {k}], got {tuple(x.shape)}")
        if weight.bits != 4:
            return None
        if weight.perm is not None:
            x = x.index_select(1, weight.perm)
        m = x.shape[0]
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        elif out.shape != (m, n):
            raise ValueError(f"linear_quant_amx: out must have shape {(m, n)}")
        _check_cpu_fp32("linear_quant_amx", out)
        status = self.lib.linear_quant_amx(x.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(),
                                           weight.zeros.data_ptr(), out.data_ptr(), m, k, n, weight.group_size,
                                           torch.get_num_threads())
        if status == -3:
            return None
        if status != 0:
            raise MemoryError("linear_quant_amx could not allocate its scratch")
        return out

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
        """logits[rows[i], t] = -inf where bit t of mask[i] is 0, in place: `logits` 2-D fp32 CPU with contiguous
        rows, `rows` int64, `mask` int32 [len(rows), words] contiguous (32 tokens a word, least significant bit
        first)."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
            raise ValueError("apply_token_bitmask wants 2-D fp32 CPU logits with contiguous rows")
        rows = rows.to(torch.int64).contiguous()
        if mask.dtype != torch.int32 or not mask.is_contiguous() or mask.dim() != 2 or mask.shape[0] != rows.numel():
            raise ValueError("apply_token_bitmask wants an int32 [rows, words] contiguous mask")
        if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[0]):
            raise ValueError("apply_token_bitmask: a row index is outside the logits")
        self.lib.apply_token_bitmask(logits.data_ptr(), logits.stride(0), mask.data_ptr(), mask.shape[1], rows.data_ptr(),
                                     rows.numel(), logits.shape[1])

    def scatter_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
        """dst[p, rows[t]] = src[p, t] for dst [P, S, ...] contiguous and src [P, T, ...] of the same dtype whose
        rows are contiguous (planes may be strided), both on the CPU: `dst.index_copy_(1, rows, src)` at the speed
        of a copy. Rows must lie in [0, S) (checked). The GIL is released while it runs."""
        row = math.prod(dst.shape[2:])
        if (dst.dim() < 2 or src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype
                or not dst.is_contiguous() or dst.device.type != "cpu" or src.device.type != "cpu"):
            raise ValueError(f"scatter_rows: cannot put {tuple(src.shape)} {src.dtype} into {tuple(dst.shape)} {dst.dtype}")
        if src.numel() and (src.shape[1] > 1 and src.stride(1) != row or not src[0, 0].is_contiguous()):
            raise ValueError("scatter_rows wants src rows that are contiguous")
        rows = rows.to(torch.int64).contiguous()
        if rows.dim() != 1 or rows.numel() != src.shape[1]:
            raise ValueError(f"scatter_rows: {rows.numel()} rows for {src.shape[1]} source rows")
        if not rows.numel() or not row:
            return
        low, high = torch.aminmax(rows)
        if int(low) < 0 or int(high) >= dst.shape[1]:
            raise ValueError(f"scatter_rows: a row index is outside [0, {dst.shape[1]})")
        size = dst.element_size()
        self.lib.kv_scatter_rows(src.data_ptr(), src.stride(0) * size, dst.data_ptr(), dst.stride(0) * size, dst.shape[0],
                                 rows.data_ptr(), rows.numel(), row * size, torch.get_num_threads())

    def gated_delta_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of the gated delta rule for B sequences, as models.gated_delta.recurrent_gated_delta_step: q, k
        [B, H, dk], v [B, H, dv], g and beta [B, H] fp32 CPU; `states` [slots, H, dk, dv] fp32 contiguous, updated in
        place at `slots` [B]. Returns the outputs [B, H, dv]. IndexError when a slot is outside the states. The GIL is
        released while it runs."""
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
        _check_cpu_fp32("gated_delta_step", q, k, v, g, beta, states)
        batch, heads, dk = q.shape
        dv = v.shape[-1]
        if (k.shape != q.shape or v.shape[:2] != (batch, heads) or g.shape != (batch, heads) or beta.shape != g.shape
                or states.shape[1:] != (heads, dk, dv)):
            raise ValueError("gated_delta_step: inconsistent shapes")
        slots = slots.to(torch.int64).contiguous()
        if slots.shape != (batch,):
            raise ValueError(f"gated_delta_step: {slots.numel()} slots for a batch of {batch}")
        out = torch.empty(batch, heads, dv, dtype=torch.float32)
        status = self.lib.gated_delta_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                           states.data_ptr(), states.shape[0], slots.data_ptr(), out.data_ptr(), batch, heads,
                                           dk, dv, torch.get_num_threads())
        if status == -2:
            raise IndexError(f"gated_delta_step: a slot is outside [0, {states.shape[0]}) (a scheduler bug)")
        if status != 0:
            raise ValueError(f"gated_delta_step: value head dim {dv} is larger than the kernel's scratch")
        return out
