"""C kernels for fp32 on CPU, where PyTorch's own ops leave speed unused: decode attention straight from the
paged KV cache (paged_decode.c); the linear layers' x · Wᵀ (linear.c), on weights as checkpoints store them or
packed in panels of 16 output columns (`pack_weight`), the layout the fastest product wants; RMSNorm
(rms_norm.c) and rotary embeddings (rotary.c) in one pass each, where PyTorch makes five or six; greedy
decoding's argmax over the vocabulary (argmax.c) at cache speed, where PyTorch's runs ten times slower;
structured output's token mask applied to the logits rows (token_bitmask.c) without unpacking it.
Beside them, the KV handoff's checksum, the copy and the gather that compute it on the way, and the scatter of
an import into the paged cache (kv_checksum.c; kv_transfer/checksum.py defines the algorithm and calls it).

They are compiled once per machine with its C compiler and loaded with ctypes (no Python or torch headers,
so no ABI to keep). They accelerate, never required: where no C compiler exists, the build fails, or
QWENSERVE_CPU_KERNEL=0, `load()` returns None and callers keep their portable PyTorch path. The shared object
is cached under cache_root()/kernels, named by a digest of the sources, the flags, the compiler and the CPU's
features, so an edit, a new compiler or another CPU rebuilds it; concurrent processes never load a
half-written file (it is renamed into place).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from qwenserve import progress
from qwenserve.cache import cache_root

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel of a packed weight (linear.c's PANEL)
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("paged_decode.c", "linear.c", "rms_norm.c", "rotary.c", "argmax.c",
                                            "kv_checksum.c", "token_bitmask.c")
)
ENV_SWITCH = "QWENSERVE_CPU_KERNEL"
# -march=native: the object is built on the machine that runs it; a compiler that refuses it builds generic.
# -fopenmp: the library then needs libgomp.so.1, which torch has already loaded, so both share one pool.
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-std=gnu11", "-fPIC", "-shared"],
    ["-O3", "-fopenmp", "-std=gnu11", "-fPIC", "-shared"],
    ["-O3", "-std=gnu11", "-fPIC", "-shared"],
)


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compiler_identity(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc


def _cpu_identity() -> str:
    """What -march=native compiles for: a cache shared by hosts of other CPUs must not hand them this object."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def build(cc: str, flags: list[str], target: Path) -> None:
    """Compile the kernels with `cc` and `flags` into the shared object `target` (atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded kernel, or None (and a logged reason) where it cannot be had."""
    if os.environ.get(ENV_SWITCH, "1").lower() in ("0", "false", "no", "off"):
        return None
    cc = compiler()
    if cc is None:
        log.info("no C compiler found: the portable PyTorch paths are used")
        return None
    identity = _compiler_identity(cc)
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    for flags in _FLAG_SETS:
        digest = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), identity.encode(),
                                             platform.machine().encode(), _cpu_identity().encode()])).hexdigest()[:16]
        target = cache_root() / "kernels" / f"qwenserve-cpu-{digest}.so"
        try:
            if not target.is_file():
                with progress.step(f"building the CPU kernels with {os.path.basename(cc)} (once per machine)"):
                    build(cc, flags, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building the CPU kernels with %s %s failed: %s", cc, " ".join(flags), detail)
            continue
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.paged_decode_attention.restype = ctypes.c_int
        lib.paged_decode_attention.argtypes = [pointer] * 4 + [i64] + [pointer] * 2 + [i64] * 5 + [ctypes.c_float, i64]
        lib.linear_nt.restype = None
        lib.linear_nt.argtypes = [pointer] * 3 + [i64] * 4
        lib.linear_packed.restype = None
        lib.linear_packed.argtypes = [pointer] * 3 + [i64] * 4
        lib.rms_norm.restype = None
        lib.rms_norm.argtypes = [pointer] * 3 + [i64] * 2 + [ctypes.c_float, i64]
        lib.rotary.restype = None
        lib.rotary.argtypes = [pointer] * 4 + [i64] * 6
        lib.argmax_rows.restype = None
        lib.argmax_rows.argtypes = [pointer] + [i64] * 3 + [pointer, i64]
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
        return lib
    log.warning("the portable PyTorch paths are used")
    return None


def available() -> bool:
    return load() is not None


def paged_decode_attention(
    q: torch.Tensor,  # [batch, heads, dim] fp32 contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, dim] of one layer, contiguous
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [batch, max_blocks] int64 contiguous
    context_lens: torch.Tensor,  # [batch] int64
    out: torch.Tensor,  # [batch, heads, dim] fp32 contiguous, written
    scale: float,
) -> None:
    """softmax(q·K^T · scale)·V over each sequence's first context_lens[b] cached tokens (the kernel must be
    available; every tensor on CPU). The GIL is released while it runs."""
    lib = load()
    assert lib is not None, "CPU kernels unavailable"
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    for t in (q, k_cache, v_cache, out):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("paged_decode_attention wants contiguous fp32 CPU tensors")
    if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64 or not block_table.is_contiguous():
        raise ValueError("block_table and context_lens must be contiguous int64")
    if heads % kv_heads or out.shape != q.shape or block_table.shape[0] != batch or context_lens.numel() != batch:
        raise ValueError("paged_decode_attention: inconsistent shapes")
    status = lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), block_table.shape[1],
        context_lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, dim, block_size, scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch")


def linear_nt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ weight[n, k]ᵀ -> [m, n], like F.linear without bias, for contiguous fp32 CPU tensors (the
    kernels must be available). The GIL is released while it runs."""
    lib = load()
    assert lib is not None, "CPU kernels unavailable"
    m, k = x.shape
    n = weight.shape[0]
    for t in (x, weight):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("linear_nt wants contiguous fp32 CPU tensors")
    if weight.shape[1] != k:
        raise ValueError(f"linear_nt: x has {k} columns, weight {weight.shape[1]}")
    y = torch.empty(m, n, dtype=torch.float32)
    lib.linear_nt(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads())
    return y


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` [..., n, k] can be packed: fp32 on CPU with n a multiple of PANEL."""
    return (weight.dim() >= 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[-2] % PANEL == 0)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[..., n, k] -> [..., n / PANEL, k, PANEL]: panel q holds output columns PANEL*q.. side by side for every
    input column, so the product broadcasts one x value against a whole panel (see linear.c)."""
    if not packable(weight):
        raise ValueError(f"pack_weight wants fp32 CPU weights with rows a multiple of {PANEL}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    *lead, n, k = weight.shape
    return weight.reshape(*lead, n // PANEL, PANEL, k).transpose(-1, -2).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_weight (a copy)."""
    *lead, panels, k, width = packed.shape
    return packed.transpose(-1, -2).reshape(*lead, panels * width, k).contiguous()


def linear_packed(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ Wᵀ -> [m, n] for W packed by pack_weight into [n / PANEL, k, PANEL]; contiguous fp32 CPU
    tensors (the kernels must be available), written into `out` [m, n] when given. The GIL is released while
    it runs."""
    lib = load()
    assert lib is not None, "CPU kernels unavailable"
    for t in (x, packed):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("linear_packed wants contiguous fp32 CPU tensors")
    if x.dim() != 2 or packed.dim() != 3 or packed.shape[2] != PANEL:
        raise ValueError(f"linear_packed wants x [m, k] and a packed weight [n/{PANEL}, k, {PANEL}]")
    m, k = x.shape
    if packed.shape[1] != k:
        raise ValueError(f"linear_packed: x has {k} columns, the weight {packed.shape[1]}")
    n = packed.shape[0] * PANEL
    if out is None:
        y = torch.empty(m, n, dtype=torch.float32)
    elif out.shape != (m, n) or out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"linear_packed: out must be a contiguous fp32 CPU tensor of shape {(m, n)}")
    else:
        y = out
    lib.linear_packed(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads())
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x², last dim) + eps) * weight for a contiguous fp32 CPU tensor (the kernels must be
    available); one pass per row instead of PyTorch's six elementwise ops. The GIL is released while it runs."""
    lib = load()
    assert lib is not None, "CPU kernels unavailable"
    for t in (x, weight):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("rms_norm wants contiguous fp32 CPU tensors")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: x has {dim} features, the weight {tuple(weight.shape)}")
    y = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // dim if dim else 0, dim, eps,
                 torch.get_num_threads())
    return y


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, dim] (fp32 on CPU, its last dimension contiguous) by cos and sin [tokens, dim]
    (contiguous) in the half-split convention; a new contiguous tensor, equal to PyTorch's
    x * cos + cat(-x2, x1) * sin (the kernels must be available)."""
    lib = load()
    assert lib is not None, "CPU kernels unavailable"
    tokens, heads, dim = x.shape
    for t in (x, cos, sin):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError("rotary wants fp32 CPU tensors with a contiguous last dimension")
    if cos.shape != (tokens, dim) or sin.shape != (tokens, dim) or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError(f"rotary: cos and sin must be contiguous [{tokens}, {dim}]")
    if dim % 2:
        raise ValueError("rotary: head_dim must be even")
    y = torch.empty(tokens, heads, dim, dtype=torch.float32)
    lib.rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), tokens, heads, dim, x.stride(0),
               x.stride(1), torch.get_num_threads())
    return y


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for 2-D fp32 CPU `x` whose rows are contiguous (the kernels must be available):
    the first index of each row's largest value, or of its first NaN. int64 [rows]. The GIL is released while
    it runs."""
    lib = load()
    assert lib is not None, "CPU kernels unavailable"
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError("argmax_rows wants a 2-D fp32 CPU tensor with contiguous rows")
    rows, cols = x.shape
    if cols == 0:
        raise ValueError("argmax_rows: rows are empty")
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        lib.argmax_rows(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf where bit t of mask[i] is 0, in place: `logits` 2-D fp32 CPU with contiguous
    rows, `rows` int64, `mask` int32 [len(rows), words] contiguous (32 tokens a word, least significant bit
    first). The kernels must be available."""
    lib = load()
    assert lib is not None, "CPU kernels unavailable"
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
        raise ValueError("apply_token_bitmask wants 2-D fp32 CPU logits with contiguous rows")
    rows = rows.to(torch.int64).contiguous()
    if mask.dtype != torch.int32 or not mask.is_contiguous() or mask.dim() != 2 or mask.shape[0] != rows.numel():
        raise ValueError("apply_token_bitmask wants an int32 [rows, words] contiguous mask")
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < logits.shape[0]):
        raise ValueError("apply_token_bitmask: a row index is outside the logits")
    lib.apply_token_bitmask(logits.data_ptr(), logits.stride(0), mask.data_ptr(), mask.shape[1], rows.data_ptr(),
                            rows.numel(), logits.shape[1])


def scatter_rows(dst: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[p, rows[t]] = src[p, t] for dst [P, S, ...] contiguous and src [P, T, ...] of the same dtype whose
    rows are contiguous (planes may be strided), both on the CPU: `dst.index_copy_(1, rows, src)` at the speed
    of a copy, where PyTorch's runs three to four times slower. Rows must lie in [0, S) (checked). The kernels
    must be available; the GIL is released while it runs."""
    lib = load()
    assert lib is not None, "CPU kernels unavailable"
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
    lib.kv_scatter_rows(src.data_ptr(), src.stride(0) * size, dst.data_ptr(), dst.stride(0) * size, dst.shape[0],
                        rows.data_ptr(), rows.numel(), row * size, torch.get_num_threads())
