"""The loaded C kernels as one value, `CpuKernels`: each kernel's Python call, which checks what it is given
before the C code reads it. The GIL is released while a kernel runs (ctypes calls)."""

from __future__ import annotations

import ctypes
import math

import torch

from qwenserve.cpu_kernels.amx_weight import AmxWeight
from qwenserve.cpu_kernels.decode_stack import DecodeStack
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
    lib.linear_quant_amx.argtypes = [pointer] * 5 + [i64] * 6
    lib.linear_bf16_amx.restype = ctypes.c_int
    lib.linear_bf16_amx.argtypes = [pointer, i64, pointer, pointer] + [i64] * 5
    lib.prefill_attention_amx.restype = ctypes.c_int
    lib.prefill_attention_amx.argtypes = [pointer, i64] * 4 + [i64, i64, pointer] + [i64] * 4 + [ctypes.c_float, i64]
    lib.kv_checksum_chunks.restype = None
    lib.kv_checksum_chunks.argtypes = [pointer] * 2 + [i64] * 2 + [pointer] + [i64] * 2
    lib.kv_checksum_combine.restype = ctypes.c_uint64
    lib.kv_checksum_combine.argtypes = [pointer, i64, i64]
    lib.kv_gather_checksum.restype = None
    lib.kv_gather_checksum.argtypes = [pointer, i64, i64, pointer, i64, i64, pointer, i64, pointer, i64, i64]
    lib.apply_token_bitmask.restype = None
    lib.apply_token_bitmask.argtypes = [pointer, i64, pointer, i64, pointer, i64, i64]
    lib.draw_tempered.restype = ctypes.c_int
    lib.draw_tempered.argtypes = [pointer, i64, i64, i64] + [pointer] * 4 + [i64]
    lib.head_screen.restype = i64
    lib.head_screen.argtypes = [pointer, i64, i64, pointer, i64] + [pointer] * 5 + [i64, i64]
    lib.argmax_rows.restype = None
    lib.argmax_rows.argtypes = [pointer, i64, i64, i64, pointer, i64]
    lib.kv_scatter_rows.restype = None
    lib.kv_scatter_rows.argtypes = [pointer, i64, pointer, i64, i64, pointer, i64, i64, i64]
    lib.gated_delta_step.restype = ctypes.c_int
    lib.gated_delta_step.argtypes = [pointer] * 6 + [i64, pointer, pointer] + [i64] * 4 + [ctypes.c_int]
    f32, flag = ctypes.c_float, ctypes.c_int
    lib.rms_norm_bf16.restype = None
    lib.rms_norm_bf16.argtypes = [pointer, i64, pointer, pointer] + [i64] * 3 + [f32, flag, i64]
    lib.qk_norm_rope_bf16.restype = None
    lib.qk_norm_rope_bf16.argtypes = [pointer, i64, pointer, i64] + [pointer] * 4 + [i64] * 6 + [f32, flag, i64]
    lib.silu_mul_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [pointer, i64, pointer] + [i64] * 4
    lib.linear_packed_bf16_io.restype = ctypes.c_int
    lib.linear_packed_bf16_io.argtypes = [pointer, i64, pointer, pointer] + [i64] * 4
    lib.paged_decode_attention_bf16_io.restype = ctypes.c_int
    lib.paged_decode_attention_bf16_io.argtypes = ([pointer, i64] + [pointer] * 2 + [i64, pointer, i64, pointer, pointer]
                                                   + [i64] * 6 + [ctypes.c_float, i64])
    lib.paged_decode_dp_supports.restype, lib.paged_decode_dp_supports.argtypes = ctypes.c_int, [i64]
    lib.release_thread_pool.restype, lib.release_thread_pool.argtypes = ctypes.c_int64, []
    lib.decode_stack_bf16.restype = ctypes.c_int
    lib.decode_stack_bf16.argtypes = [pointer, i64, pointer, i64] + [pointer] * 5 + [i64] * 2 + [pointer, i64, pointer]
    return lib


def _check_bf16_rows(name: str, *tensors: torch.Tensor) -> None:
    """2-D bf16 CPU tensors whose rows are contiguous (the rows may be strided: views into a wider output)."""
    for t in tensors:
        if t.dtype != torch.bfloat16 or t.dim() != 2 or t.stride(1) != 1 or t.device.type != "cpu":
            raise ValueError(f"{name} wants 2-D bf16 CPU tensors with contiguous rows")


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

    def bf16_decode_attention_uses_dot_product(self, head_dim: int) -> bool:
        """Whether a bf16 model's decode attention (bf16 q and out) runs AVX512_BF16's dot product at this head
        dim in this object (paged_attend_dp.h), rather than the fp32 kernel on the widened queries."""
        return bool(self.lib.paged_decode_dp_supports(head_dim))

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
        A bf16 cache is widened to fp32 as it is read (the fp32 attention over the bf16 K/V). A bf16 model's q and
        out (bf16 over a bf16 cache; rows may be strided, each row's heads contiguous) are widened and rounded in
        the C call, or taken as they are by AVX512_BF16's dot product (bf16_decode_attention_uses_dot_product). IndexError, before anything is read, when a block id is outside the cache. The GIL is released
        while it runs."""
        batch, heads, dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        bf16_io = q.dtype == torch.bfloat16
        if bf16_io:
            if (k_cache.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or q.stride(2) != 1
                    or q.stride(1) != dim or out.stride(2) != 1 or out.stride(1) != dim):
                raise ValueError("paged_decode_attention: bf16 q and out (each row's heads contiguous) over a bf16 "
                                 "cache")
        else:
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
        if bf16_io:
            status = self.lib.paged_decode_attention_bf16_io(
                q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_table.data_ptr(),
                block_table.shape[1], context_lens.contiguous().data_ptr(), out.data_ptr(), out.stride(0), batch,
                heads, kv_heads, dim, block_size, scale, torch.get_num_threads())
        else:
            attend = (self.lib.paged_decode_attention if k_cache.dtype == torch.float32
                      else self.lib.paged_decode_attention_bf16)
            status = attend(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_table.data_ptr(),
                block_table.shape[1], context_lens.contiguous().data_ptr(), out.data_ptr(), batch, heads, kv_heads,
                dim, block_size, scale, torch.get_num_threads(),
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

    def linear_packed_bf16_io(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        """x [m, k] bf16 (rows contiguous, maybe strided) @ Wᵀ -> [m, n] bf16 for bf16 panels: the fp32 product of
        x widened, rounded once (what linear_packed computes, with the conversions in the C call)."""
        packed = weight.panels
        _check_bf16_rows("linear_packed_bf16_io", x)
        if packed.dtype != torch.bfloat16 or packed.dim() != 3 or packed.shape[1] != x.shape[1]:
            raise ValueError(f"linear_packed_bf16_io wants one bf16 packed matrix of {x.shape[1]} columns")
        m, k = x.shape
        n = packed.shape[0] * PANEL
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if self.lib.linear_packed_bf16_io(x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), m, k, n,
                                          torch.get_num_threads()):
            raise MemoryError("linear_packed_bf16_io could not allocate its scratch")
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
        """`linear_quant` with x rounded to bf16 first, on AMX tiles (linear_quant.c): many rows' product, as
        PyTorch's bf16 product rounds x. None where it cannot run (no AMX here or in this build, groups not a multiple
        of 32 inputs): then `linear_quant` does."""
        _check_cpu_fp32("linear_quant_amx", x)
        weight.check()
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"linear_quant_amx: x must be [m, {k}], got {tuple(x.shape)}")
        if weight.perm is not None:
            x = x.index_select(1, weight.perm)
        m = x.shape[0]
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        elif out.shape != (m, n):
            raise ValueError(f"linear_quant_amx: out must have shape {(m, n)}")
        _check_cpu_fp32("linear_quant_amx", out)
        if m == 0:
            return out  # nothing to multiply (the C code's zero-row scratch would be an allocation of nothing)
        status = self.lib.linear_quant_amx(x.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(),
                                           weight.zeros.data_ptr(), out.data_ptr(), m, k, n, weight.bits,
                                           weight.group_size, torch.get_num_threads())
        if status == -3:
            return None
        if status != 0:
            raise MemoryError("linear_quant_amx could not allocate its scratch")
        return out

    def linear_bf16_amx(self, x: torch.Tensor, weight: AmxWeight, out: torch.Tensor | None = None
                        ) -> torch.Tensor | None:
        """x [m, k] bf16 (rows contiguous, maybe strided) @ Wᵀ -> [m, n] on AMX tiles (linear_amx.c): bf16, or fp32
        into `out` [m, n] (contiguous fp32) when given; fp32 sums either way. None where it cannot run (no AMX here
        or in this build): the caller multiplies another way."""
        _check_bf16_rows("linear_bf16_amx", x)
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"linear_bf16_amx: x must be [m, {k}], got {tuple(x.shape)}")
        m = x.shape[0]
        if out is None:
            out = torch.empty(m, n, dtype=torch.bfloat16)
        elif out.shape != (m, n):
            raise ValueError(f"linear_bf16_amx: out must have shape {(m, n)}")
        else:
            _check_cpu_fp32("linear_bf16_amx", out)
        if m == 0:
            return out
        status = self.lib.linear_bf16_amx(x.data_ptr(), x.stride(0), weight.tiles.data_ptr(), out.data_ptr(),
                                          int(out.dtype == torch.float32), m, k, n, torch.get_num_threads())
        if status == -3:
            return None
        if status != 0:
            raise MemoryError("linear_bf16_amx could not allocate its scratch")
        return out

    def prefill_attention_amx(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              out: torch.Tensor | None = None, slots: torch.Tensor | None = None
                              ) -> torch.Tensor | None:
        """Causal attention of a prompt's chunk on AMX tiles (prefill_attention.c): q [qlen, heads, dim], k and v
        [rows, kv_heads, dim], bf16, each token's heads side by side (tokens may be strided: views into the q/k/v
        product) -> [qlen, heads, dim] bf16. The keys are k's rows in order, or with `slots` (int64 [t]) key j is row
        slots[j] (a layer's paged cache, flattened to rows); the queries are the last qlen of them: query i sees keys
        0..t - qlen + i; query head h reads KV head h // (heads // kv_heads). Written into `out` [qlen, heads, dim]
        (contiguous bf16) when given. None where it cannot run (no AMX here or in this build, dim not a multiple of
        32): the caller attends another way."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.bfloat16 or t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] \
                    or t.device.type != "cpu":
                raise ValueError(f"prefill_attention_amx: {name} must be [tokens, heads, dim] bf16 with each token's "
                                 "heads contiguous")
        tokens, heads, dim = q.shape
        if slots is not None and (slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous()):
            raise ValueError("prefill_attention_amx: slots must be a contiguous 1-D int64 tensor")
        keys = k.shape[0] if slots is None else slots.shape[0]
        if k.shape != v.shape or not 0 < tokens <= keys or k.shape[2] != dim or heads % k.shape[1] != 0:
            raise ValueError(f"prefill_attention_amx: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                             f"and {keys} keys do not match")
        if out is None:
            out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
        elif out.shape != q.shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"prefill_attention_amx: out must be a contiguous bf16 {tuple(q.shape)}")
        status = self.lib.prefill_attention_amx(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                                v.stride(0), out.data_ptr(), heads * dim, tokens, keys,
                                                None if slots is None else slots.data_ptr(), k.shape[0], heads,
                                                k.shape[1], dim, scale, torch.get_num_threads())
        if status == -3:
            return None
        if status == -2:
            raise ValueError(f"prefill_attention_amx: a slot is outside k's {k.shape[0]} rows")
        if status != 0:
            raise MemoryError("prefill_attention_amx could not allocate its scratch")
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

    def draw_tempered(self, logits: torch.Tensor, temperatures: torch.Tensor, min_p: torch.Tensor,
                      uniforms: torch.Tensor) -> torch.Tensor:
        """Per row of `logits` [rows, n] (fp32 CPU, contiguous rows), the index drawn with probability proportional
        to exp((x - max) / temperature), weights below min_p (of the best token's 1) removed, by inverse CDF with the
        row's uniform number (categorical_draw.c; engine/categorical.py's draw on those weights): int64 [rows], -1
        where a row has no finite logit. `temperatures` (> 0) and `min_p` fp32 [rows], `uniforms` fp64 [rows] in
        [0, 1)."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
            raise ValueError("draw_tempered wants 2-D fp32 CPU logits with contiguous rows")
        rows = logits.shape[0]
        temperatures = temperatures.to(torch.float32).contiguous()
        min_p = min_p.to(torch.float32).contiguous()
        uniforms = uniforms.to(torch.float64).contiguous()
        if temperatures.shape != (rows,) or min_p.shape != (rows,) or uniforms.shape != (rows,):
            raise ValueError(f"draw_tempered wants temperatures, min_p and uniforms of [{rows}]")
        if rows and not bool((temperatures > 0).all()):
            raise ValueError("draw_tempered: a temperature must be positive")
        chosen = torch.empty(rows, dtype=torch.int64)
        if self.lib.draw_tempered(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], temperatures.data_ptr(),
                                  min_p.data_ptr(), uniforms.data_ptr(), chosen.data_ptr(),
                                  torch.get_num_threads()) != 0:
            raise MemoryError("draw_tempered could not allocate its scratch")
        return chosen

    def argmax(self, values: torch.Tensor) -> torch.Tensor:
        """Per row of `values` [rows, n] (fp32 CPU, rows contiguous, n > 0), the index of its first largest entry, as
        torch.argmax (a NaN counts as the largest): a greedy row's token, in one pass (categorical_draw.c)."""
        if (values.dim() != 2 or values.dtype != torch.float32 or values.device.type != "cpu"
                or values.stride(1) != 1 or values.shape[1] == 0):
            raise ValueError("argmax wants 2-D fp32 CPU values with contiguous, non-empty rows")
        chosen = torch.empty(values.shape[0], dtype=torch.int64)
        self.lib.argmax_rows(values.data_ptr(), values.stride(0), values.shape[0], values.shape[1], chosen.data_ptr(),
                             torch.get_num_threads())
        return chosen

    def head_screen(self, x: torch.Tensor, approx: torch.Tensor, reach: torch.Tensor, span: torch.Tensor,
                    out: torch.Tensor | None, marks: torch.Tensor, panels: torch.Tensor, largest: int = 1) -> int:
        """The screened LM head's candidate panels (head_screen.c; models/screened_head.py): x [m, k] and approx
        [m, n] fp32, reach and span [n] fp32 (n a multiple of PANEL), `out` [m, n] fp32 filled with -inf (None: not),
        `marks` uint8 and `panels` int64 [n / PANEL] as scratch and result; the panels that may hold any of each
        row's `largest` highest logits. Returns how many panel indices it wrote to `panels` (ascending), or -1 where
        x or the bound is not finite."""
        m, k = x.shape
        n = approx.shape[1]
        _check_cpu_fp32("head_screen", x, approx, reach, span, *(() if out is None else (out,)))
        if (approx.shape[0] != m or n % PANEL or reach.numel() != n or span.numel() != n
                or (out is not None and out.shape != (m, n)) or marks.dtype != torch.uint8
                or panels.dtype != torch.int64 or marks.numel() < n // PANEL or panels.numel() < n // PANEL
                or not marks.is_contiguous() or not panels.is_contiguous() or not 1 <= largest <= n):
            raise ValueError("head_screen: x [m, k], approx and out [m, n], reach and span [n], marks and panels "
                             "[n / 16] uint8 and int64, 1 <= largest <= n")
        count = int(self.lib.head_screen(x.data_ptr(), m, k, approx.data_ptr(), n, reach.data_ptr(),
                                         span.data_ptr(), None if out is None else out.data_ptr(), marks.data_ptr(),
                                         panels.data_ptr(), largest, torch.get_num_threads()))
        if count == -2:
            raise MemoryError("head_screen: no memory for its scratch")
        return count

    def release_thread_pool(self) -> bool:
        """Hand back the calling thread's OpenMP worker threads (thread_pool.c): once a thread is done with parallel
        work, so that the threads that go on (an engine's compute loop) are not throttled as oversubscribed. False
        where this build cannot."""
        return bool(self.lib.release_thread_pool())

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

    def rms_norm_bf16(self, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of the rows of x [rows, n] (bf16, rows contiguous) with `weight` [n] bf16, rounded as transformers'
        bf16 forward (bf16_layer.c); into `out` (may be x) or a new tensor."""
        out = torch.empty(x.shape, dtype=torch.bfloat16) if out is None else out
        _check_bf16_rows("rms_norm_bf16", x, out)
        n = x.shape[1]
        if weight.dtype != torch.bfloat16 or weight.shape != (n,) or not weight.is_contiguous() or out.shape != x.shape:
            raise ValueError(f"rms_norm_bf16: weight must be bf16 [{n}] and out {tuple(x.shape)}")
        self.lib.rms_norm_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0],
                               n, eps, int(zero_centered), torch.get_num_threads())
        return out

    def qk_norm_rope_bf16(self, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                          zero_centered: bool = False) -> None:
        """In place, per token: the heads of q [rows, heads, dim] and k [rows, kv_heads, dim] (bf16, each row's heads
        contiguous; rows may be strided) normalised by q_weight / k_weight [dim] (None: no norm), then rotated by
        cos / sin [rows, rot] bf16 contiguous (the half-split rotation of each head's first rot values)."""
        rows, heads, dim = q.shape
        rot = cos.shape[-1]
        if cos.numel() != rows * rot or sin.shape != cos.shape:
            raise ValueError(f"qk_norm_rope_bf16 wants cos and sin of [{rows}, rot] for {rows} tokens")
        cos, sin = cos.reshape(rows, rot), sin.reshape(rows, rot)
        for t in (q, k):
            if t.dtype != torch.bfloat16 or t.dim() != 3 or t.shape[0] != rows or t.shape[2] != dim or t.stride(2) != 1 \
                    or t.stride(1) != dim or t.device.type != "cpu":
                raise ValueError("qk_norm_rope_bf16 wants bf16 CPU q and k of one head dim, each row's heads contiguous")
        for t in (cos, sin):
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or rot > dim or rot % 2:
                raise ValueError("qk_norm_rope_bf16 wants contiguous bf16 cos and sin [rows, rot], rot even, <= dim")
        for w in (q_weight, k_weight):
            if w is not None and (w.dtype != torch.bfloat16 or w.shape != (dim,) or not w.is_contiguous()):
                raise ValueError(f"qk_norm_rope_bf16: a norm weight must be bf16 [{dim}]")
        if (q_weight is None) != (k_weight is None):
            raise ValueError("qk_norm_rope_bf16: both norm weights or neither")
        self.lib.qk_norm_rope_bf16(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                   q_weight.data_ptr() if q_weight is not None else None,
                                   k_weight.data_ptr() if k_weight is not None else None, cos.data_ptr(), sin.data_ptr(),
                                   rot, rows, heads, k.shape[1], dim, rot, eps, int(zero_centered),
                                   torch.get_num_threads())

    def silu_mul_bf16(self, gate_up: torch.Tensor, n: int) -> torch.Tensor:
        """silu(gate) * up for gate_up [rows, 2n] bf16 (rows contiguous; gate then up), rounded as transformers' bf16
        forward: [rows, n] bf16."""
        _check_bf16_rows("silu_mul_bf16", gate_up)
        if gate_up.shape[1] != 2 * n:
            raise ValueError(f"silu_mul_bf16: gate_up has {gate_up.shape[1]} columns, not 2 x {n}")
        out = torch.empty(gate_up.shape[0], n, dtype=torch.bfloat16)
        self.lib.silu_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), n, gate_up.shape[0], n,
                               torch.get_num_threads())
        return out

    def decode_stack_bf16(self, stack: DecodeStack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          slots: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          context_lens: torch.Tensor, quant_amx_rows: int | None = None,
                          panel_amx_rows: int | None = None) -> None:
        """Every layer of `stack` over the decode rows x [m, hidden] bf16, in place (decode_stack.c): cos / sin [m, rot]
        bf16 at the rows' positions, slots [m] int64 where each row's K/V is stored, kv_cache [layers, 2, num_blocks,
        block_size, kv_heads, head_dim] bf16 (written at the slots), block_table [m, max_blocks] and context_lens [m]
        int64 as paged_decode_attention reads them; codes are multiplied on AMX tiles (linear_quant_amx) in steps of
        `quant_amx_rows` rows or more where it runs, bf16 weights with tiles (linear_bf16_amx) in steps of
        `panel_amx_rows` (None: never). IndexError, before anything is written, when a slot
        or block lies outside the cache. The GIL is released while it runs."""
        hidden, heads, kv_heads, head_dim, _, rot = stack.sizes
        m = x.shape[0] if x.dim() == 2 else -1
        if x.dtype != torch.bfloat16 or x.shape != (m, hidden) or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"decode_stack_bf16 wants x as contiguous bf16 CPU rows [m, {hidden}]")
        for t in (cos, sin):
            if t.dtype != torch.bfloat16 or t.numel() != m * rot or not t.is_contiguous():
                raise ValueError(f"decode_stack_bf16 wants cos and sin as contiguous bf16 [{m}, {rot}]")
        if (kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 6 or kv_cache.shape[0] < len(stack)
                or kv_cache.shape[1] != 2 or kv_cache.shape[4:] != (kv_heads, head_dim) or not kv_cache.is_contiguous()
                or kv_cache.device.type != "cpu"):
            raise ValueError(f"decode_stack_bf16 wants a contiguous bf16 CPU cache [>= {len(stack)}, 2, blocks, "
                             f"block_size, {kv_heads}, {head_dim}]")
        for t, shape in ((slots, (m,)), (context_lens, (m,)), (block_table, (m, block_table.shape[-1]))):
            if t.dtype != torch.int64 or t.shape != shape or not t.is_contiguous():
                raise ValueError("decode_stack_bf16 wants contiguous int64 slots [m], context_lens [m] and "
                                 "block_table [m, max_blocks]")
        num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
        shape = stack.shape(block_size, torch.get_num_threads(), quant_amx_rows, panel_amx_rows)
        status = self.lib.decode_stack_bf16(x.data_ptr(), m, ctypes.addressof(stack.layers), len(stack),
                                            ctypes.addressof(shape), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                                            kv_cache.data_ptr(), kv_cache[0].numel(), num_blocks,
                                            block_table.data_ptr(), block_table.shape[1], context_lens.data_ptr())
        if status == -2:
            raise IndexError(f"decode_stack_bf16: a slot or block lies outside the cache's {num_blocks} blocks, or a "
                             "block table is shorter than its context (a scheduler bug)")
        if status != 0:
            raise MemoryError("decode_stack_bf16 could not allocate its scratch")
