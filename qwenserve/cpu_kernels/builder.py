"""Building the C kernels: one shared object per instruction-set level (VARIANTS), compiled at install time by
`python -m qwenserve.cpu_kernels build` into `kernel_dir()`, or for this CPU alone at first use (loader.py) where
none was built. Objects are named by a digest of the sources and of this module (the flags), so an edit never loads
a stale build and an unchanged one is not built again, and written under a temporary name then renamed into place,
so a half-written file is never loaded. The sources compile side by side, one compiler process per core."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("qwenserve.cpu_kernels")

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_decode.c", "linear.c", "linear_quant.c", "kv_checksum.c", "token_bitmask.c",
                             "gated_delta.c", "bf16_layer.c", "decode_stack.c", "linear_amx.c",
                             "prefill_attention.c", "categorical_draw.c", "thread_pool.c", "head_screen.c"))
# Included by the sources: part of what names a build.
HEADERS = tuple(Path(__file__).with_name(name)
                for name in ("vec8.h", "vexp.h", "linear_tiles.h", "paged_attend.h", "paged_attend_dp.h",
                             "amx_tiles.h"))
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
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Best first. x86-64-v4 has 32 vector registers, for which linear.c uses its wide tiles; AVX512_BF16's dot product
# serves a bf16 model's decode attention (paged_attend_dp.h), AVX512_VNNI's 16-bit one the 4-bit product
# (linear_quant.c): every CPU with the first has the second.
VARIANTS: dict[str, tuple[Variant, ...]] = {
    "x86_64": (
        Variant("x86-64-v4-bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
                _V4 | {"avx512_bf16", "avx512_vnni"}),
        Variant("x86-64-v4", ("-march=x86-64-v4",), _V4),
        Variant("x86-64-v3", ("-march=x86-64-v3",), _V3),
        Variant("x86-64", ("-march=x86-64",), frozenset()),
    ),
}
_GENERIC = (Variant("generic", (), frozenset()),)  # other machines: the compiler's default target


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def kernel_dir() -> Path:
    """Where the prebuilt objects live: $QWENSERVE_CPU_KERNEL_DIR, else this package's build/ folder."""
    return Path(os.environ.get(ENV_DIR) or Path(__file__).with_name("build"))


def source_digest() -> str:
    """What names a build: the sources, their headers, and this module (the flags each variant is built with)."""
    return hashlib.sha256(b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS, Path(__file__)))).hexdigest()[:16]


def machine_variants() -> tuple[Variant, ...]:
    """Every variant built for this machine's architecture, best first."""
    return VARIANTS.get(platform.machine(), _GENERIC)


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags, as /proc/cpuinfo names them."""
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
    flags = cpu_flags()
    return [variant for variant in machine_variants() if variant.needs <= flags]


def variant_path(variant: Variant, directory: Path | None = None) -> Path:
    return (directory or kernel_dir()) / f"qwenserve-cpu-{variant.name}-{source_digest()}.so"


def _jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def build(cc: str, flags: list[str], target: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """Compile the kernels (`sources`: all of them) with `cc` and `flags` into the shared object `target`
    (atomically): each source to an object in a compiler process of its own, as many at once as this process has
    cores, then one link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        objects = [Path(work) / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]

        def compile_one(source: Path, obj: Path) -> None:
            subprocess.run([cc, *flags, "-c", str(source), "-o", str(obj)], check=True, capture_output=True,
                           text=True, timeout=300)

        with ThreadPoolExecutor(max(1, min(_jobs(), len(sources)))) as pool:
            for done in [pool.submit(compile_one, source, obj) for source, obj in zip(sources, objects, strict=True)]:
                done.result()  # the first failure raises, with the compiler's message
        tmp = Path(work) / "linked.so"
        subprocess.run([cc, *flags, *map(str, objects), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(tmp, target)


def build_first_working(cc: str, extra: list[str], target: Path) -> bool:
    """Build `target` with OpenMP, else without; False (each failure logged) when neither compiles."""
    for common in _COMMON_FLAGS:
        try:
            build(cc, [*common, *extra], target)
            return True
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building the CPU kernels with %s %s failed: %s", cc, " ".join([*common, *extra]), detail)
    return False


def build_variants(directory: Path | None = None, cc: str | None = None, force: bool = False) -> list[Path]:
    """Build every variant of this machine's architecture into `directory` (default `kernel_dir()`), whatever
    this CPU supports: an image built here runs on nodes with other CPUs. One already built from these sources is
    kept unless `force`. Returns the objects there."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang, or $CC) to build the CPU kernels with")
    built = []
    for variant in machine_variants():
        target = variant_path(variant, directory)
        if (target.is_file() and not force) or build_first_working(cc, list(variant.march), target):
            built.append(target)
    return built


def first_use_target(cc: str, march: list[str]) -> Path:
    """Where a build for this CPU at first use is cached: named by the sources, the flags, the compiler and the
    CPU, so that another machine sharing the cache folder never loads it."""
    from qwenserve.cache import cache_root

    try:
        identity = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        identity = cc
    key = b"\0".join([source_digest().encode(), " ".join(march).encode(), identity.encode(),
                      platform.machine().encode(), " ".join(sorted(cpu_flags())).encode()])
    return cache_root() / "kernels" / f"qwenserve-cpu-{hashlib.sha256(key).hexdigest()[:16]}.so"
