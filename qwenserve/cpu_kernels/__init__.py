"""C kernels for what PyTorch's CPU ops leave slow, each kept because bench/kernels_bench.py measures a gain that
shows in a step: decode attention read straight from the paged KV cache (paged_decode.c); the linear layers'
x · Wᵀ on weights packed in panels of 16 output columns (linear.c, `PackedWeight`); structured output's token
mask applied to the logits without unpacking it (token_bitmask.c); a hybrid model's recurrent update at decode, in
place in the state slots (gated_delta.c); and the KV handoff's checksum, with the
copy, the gather and the scatter that compute it or move the bytes (kv_checksum.c; kv_transfer/checksum.py
defines the algorithm). They are loaded with ctypes: no Python or torch headers, so no ABI to keep.

They are built at install time: `python -m qwenserve.cpu_kernels build` (scripts/setup.sh and the image build
run it) compiles one shared object per instruction-set level (VARIANTS) into `kernel_dir()`, and `load()` opens
the best one this CPU supports, so a pod never compiles. Only where none was built does `load()` compile at
first use (-march=native, cached under cache_root()/kernels). Where that fails too, or QWENSERVE_CPU_KERNEL=0,
it says so once with a WARNING, the qwenserve_cpu_kernels_available gauge reads 0, and the engine runs
PyTorch's ops instead (same tokens, slower). Objects are named by a digest of the sources: an edit never
loads a stale build, and a half-written file is never loaded (it is renamed into place).
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
from dataclasses import dataclass
from pathlib import Path

import torch

from qwenserve import progress
from qwenserve.cache import cache_root

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel of a packed weight (linear.c's PANEL)
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_decode.c", "linear.c", "kv_checksum.c", "token_bitmask.c", "gated_delta.c"))
HEADERS = (Path(__file__).with_name("vec8.h"),)  # included by the sources: part of what names a build
ENV_SWITCH = "QWENSERVE_CPU_KERNEL"
ENV_DIR = "QWENSERVE_CPU_KERNEL_DIR"
# -fopenmp: the library then needs libgomp.so.1, which torch has already loaded, so both share one pool. A
# compiler without OpenMP builds the single-threaded form.
_COMMON_FLAGS = (["-O3", "-fopenmp", "-std=gnu11", "-fPIC", "-shared"], ["-O3", "-std=gnu11", "-fPIC", "-shared"])


@dataclass(frozen=True, slots=True)
class Variant:
    """One prebuilt object: the compiler flags that target an instruction-set level and the /proc/cpuinfo
    flags a CPU needs to run it."""

    name: str
    march: tuple[str, ...]
    needs: frozenset[str]


_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"})
# Best first. x86-64-v4 has 32 vector registers, for which linear.c uses its wide tiles.
VARIANTS: dict[str, tuple[Variant, ...]] = {
    "x86_64": (
        Variant("x86-64-v4", ("-march=x86-64-v4",), _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
        Variant("x86-64-v3", ("-march=x86-64-v3",), _V3),
        Variant("x86-64", ("-march=x86-64",), frozenset()),
    ),
}
_GENERIC = (Variant("generic", (), frozenset()),)  # other machines: the compiler's default target

_loaded: str | None = None  # which object load() opened, for the start-up line and the bench


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def kernel_dir() -> Path:
    """Where the prebuilt objects live: $QWENSERVE_CPU_KERNEL_DIR, else this package's build/ folder."""
    return Path(os.environ.get(ENV_DIR) or Path(__file__).with_name("build"))


def _source_digest() -> str:
    return hashlib.sha256(b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))).hexdigest()[:16]


def machine_variants() -> tuple[Variant, ...]:
    """Every variant built for this machine's architecture, best first."""
    return VARIANTS.get(platform.machine(), _GENERIC)


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    if line:
        return frozenset(line.split(":", 1)[1].split())
    # No /proc (another OS): torch's own detection, mapped onto the same levels.
    capability = torch.backends.cpu.get_cpu_capability()
    return VARIANTS["x86_64"][0 if capability.startswith("AVX512") else 1].needs if "AVX" in capability else frozenset()


def supported_variants() -> list[Variant]:
    """The variants this CPU can run, best first."""
    flags = _cpu_flags()
    return [variant for variant in machine_variants() if variant.needs <= flags]


def variant_path(variant: Variant, directory: Path | None = None) -> Path:
    return (directory or kernel_dir()) / f"qwenserve-cpu-{variant.name}-{_source_digest()}.so"


def build(cc: str, flags: list[str], target: Path) -> None:
    """Compile the kernels with `cc` and `flags` into the shared object `target` (atomically)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_first_working(cc: str, extra: list[str], target: Path) -> bool:
    for common in _COMMON_FLAGS:
        try:
            build(cc, [*common, *extra], target)
            return True
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building the CPU kernels with %s %s failed: %s", cc, " ".join([*common, *extra]), detail)
    return False


def build_variants(directory: Path | None = None, cc: str | None = None) -> list[Path]:
    """Build every variant of this machine's architecture into `directory` (default `kernel_dir()`), whatever
    this CPU supports: an image built here runs on nodes with other CPUs. Returns the objects built."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang, or $CC) to build the CPU kernels with")
    built = []
    for variant in machine_variants():
        target = variant_path(variant, directory)
        if _build_first_working(cc, list(variant.march), target):
            built.append(target)
    return built


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [pointer] * 3 + [i64, pointer, i64, pointer, pointer] + [i64] * 5 + [
        ctypes.c_float, i64]
    lib.linear_packed.restype = None
    lib.linear_packed.argtypes = [pointer] * 3 + [i64] * 4
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


def _open_prebuilt() -> ctypes.CDLL | None:
    global _loaded
    for variant in supported_variants():
        path = variant_path(variant)
        if path.is_file() and (lib := _open(path, "prebuilt")) is not None:
            _loaded = f"{variant.name} (prebuilt)"
            return lib
    return None


def _open(path: Path, what: str) -> ctypes.CDLL | None:
    """The library at `path` with its functions declared; None (and why, logged) when it will not load."""
    try:
        return _declare(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        log.warning("cannot load the %s CPU kernels %s: %s", what, path, exc)
        return None


def _build_here() -> ctypes.CDLL | None:
    """The fallback where nothing was built at install time: compile for this CPU, cached by machine."""
    global _loaded
    cc = compiler()
    if cc is None:
        return None
    log.warning("no prebuilt CPU kernels in %s (run `python -m qwenserve.cpu_kernels build` at install time): "
                "building them now with %s", kernel_dir(), cc)
    try:
        identity = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        identity = cc
    for march in (["-march=native"], []):
        key = b"\0".join([_source_digest().encode(), " ".join(march).encode(), identity.encode(),
                          platform.machine().encode(), " ".join(sorted(_cpu_flags())).encode()])
        target = cache_root() / "kernels" / f"qwenserve-cpu-{hashlib.sha256(key).hexdigest()[:16]}.so"
        if not target.is_file():
            with progress.step(f"building the CPU kernels with {os.path.basename(cc)} (once per machine)"):
                if not _build_first_working(cc, march, target):
                    continue
        if (lib := _open(target, "first-use")) is None:
            continue
        _loaded = f"{' '.join(march) or 'default target'} (built at first use)"
        return lib
    return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded kernels, or None: then one WARNING says why, and callers run PyTorch's ops."""
    global _loaded
    _loaded = None
    if os.environ.get(ENV_SWITCH, "1").lower() in ("0", "false", "no", "off"):
        log.warning("CPU kernels off (%s=0): PyTorch's ops run instead, slower", ENV_SWITCH)
        return None
    lib = _open_prebuilt() or _build_here()
    if lib is None:
        log.warning("CPU kernels unavailable (none prebuilt in %s and none could be built): PyTorch's ops run "
                    "instead, slower", kernel_dir())
    else:
        log.info("CPU kernels: %s", _loaded)
    return lib


def available() -> bool:
    return load() is not None


def loaded_variant() -> str | None:
    """Which object `load()` opened (e.g. 'x86-64-v3 (prebuilt)'), or None."""
    return _loaded if available() else None


def _loaded_lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are unavailable (see the WARNING logged at start-up)")
    return lib


def _check_cpu_fp32(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} wants contiguous fp32 CPU tensors")


def paged_decode_attention(
    q: torch.Tensor,  # [batch, heads, dim] fp32 contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, dim] of one layer, contiguous
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [batch, max_blocks] int64 contiguous
    context_lens: torch.Tensor,  # [batch] int64
    out: torch.Tensor,  # [batch, heads, dim] fp32 contiguous, written
    scale: float,
) -> None:
    """softmax(q·K^T · scale)·V over each sequence's first context_lens[b] cached tokens, every tensor on CPU.
    IndexError, before anything is read, when a block id is outside the cache. The GIL is released while it runs."""
    lib = _loaded_lib()
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    _check_cpu_fp32("paged_decode_attention", q, k_cache, v_cache, out)
    if block_table.dtype != torch.int64 or context_lens.dtype != torch.int64 or not block_table.is_contiguous():
        raise ValueError("block_table and context_lens must be contiguous int64")
    if (heads % kv_heads or out.shape != q.shape or block_table.shape[0] != batch or context_lens.numel() != batch
            or v_cache.shape != k_cache.shape):
        raise ValueError("paged_decode_attention: inconsistent shapes")
    status = lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_table.data_ptr(),
        block_table.shape[1], context_lens.contiguous().data_ptr(), out.data_ptr(), batch, heads, kv_heads, dim,
        block_size, scale, torch.get_num_threads(),
    )
    if status == -2:
        raise IndexError(f"paged_decode_attention: a block table names a block outside [0, {num_blocks}) or is "
                         "shorter than its context (a scheduler bug)")
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch")


def packable(weight: torch.Tensor) -> bool:
    """Whether `weight` [..., n, k] can be packed: fp32 on CPU with n a multiple of PANEL."""
    return (weight.dim() >= 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[-2] % PANEL == 0)


class PackedWeight:
    """A weight [..., n, k] held as panels [..., n / PANEL, k, PANEL] for `linear_packed`: panel q holds output
    columns PANEL*q.. side by side for every input column, so the product broadcasts one x value against a whole
    panel (see linear.c). Stacked weights (MoE experts) pack each matrix on its own; index one out with [e]."""

    __slots__ = ("panels",)

    def __init__(self, panels: torch.Tensor) -> None:
        self.panels = panels

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        if not packable(weight):
            raise ValueError(f"PackedWeight.pack wants fp32 CPU weights with rows a multiple of {PANEL}, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
        *lead, n, k = weight.shape
        return cls(weight.reshape(*lead, n // PANEL, PANEL, k).transpose(-1, -2).contiguous())

    @property
    def shape(self) -> tuple[int, ...]:
        """The unpacked shape [..., n, k]."""
        *lead, panels, k, width = self.panels.shape
        return (*lead, panels * width, k)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def __getitem__(self, index: int) -> PackedWeight:
        return PackedWeight(self.panels[index])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the unpacked matrix (an embedding lookup in a tied, packed LM head): row v is column
        v % PANEL of panel v // PANEL."""
        return self.panels[ids // PANEL, :, ids % PANEL]


def linear_packed(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ Wᵀ -> [m, n], contiguous fp32 CPU tensors, written into `out` [m, n] when given. The GIL is
    released while it runs."""
    lib = _loaded_lib()
    packed = weight.panels
    _check_cpu_fp32("linear_packed", x, packed)
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
    lib.linear_packed(x.data_ptr(), packed.data_ptr(), out.data_ptr(), m, k, n, torch.get_num_threads())
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf where bit t of mask[i] is 0, in place: `logits` 2-D fp32 CPU with contiguous
    rows, `rows` int64, `mask` int32 [len(rows), words] contiguous (32 tokens a word, least significant bit
    first)."""
    lib = _loaded_lib()
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
    of a copy. Rows must lie in [0, S) (checked). The GIL is released while it runs."""
    lib = _loaded_lib()
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


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule for B sequences, as models.gated_delta.recurrent_gated_delta_step: q, k
    [B, H, dk], v [B, H, dv], g and beta [B, H] fp32 CPU; `states` [slots, H, dk, dv] fp32 contiguous, updated in
    place at `slots` [B]. Returns the outputs [B, H, dv]. IndexError when a slot is outside the states. The GIL is
    released while it runs."""
    lib = _loaded_lib()
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
    status = lib.gated_delta_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                  states.data_ptr(), states.shape[0], slots.data_ptr(), out.data_ptr(), batch, heads,
                                  dk, dv, torch.get_num_threads())
    if status == -2:
        raise IndexError(f"gated_delta_step: a slot is outside [0, {states.shape[0]}) (a scheduler bug)")
    if status != 0:
        raise ValueError(f"gated_delta_step: value head dim {dv} is larger than the kernel's scratch")
    return out
