"""Loading the C kernels: the best prebuilt object this CPU runs, else one built for it at first use (-march=native,
cached under cache_root()/kernels), else none, said once with a WARNING (callers then run PyTorch's or NumPy's
forms: the same results, slower).

`load()` is the process's one copy: whether an engine uses it is the engine's choice (EngineConfig.cpu_kernel,
engine/kernels.py), and the KV checksum's callers hand it to kv_transfer/checksum.py.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

from qwenserve import progress
from qwenserve.cpu_kernels import builder
from qwenserve.cpu_kernels.library import CpuKernels, declare

log = logging.getLogger("qwenserve.cpu_kernels")


def _open(path: Path, what: str) -> ctypes.CDLL | None:
    """The library at `path` with its functions declared; None (and why, logged) when it will not load."""
    try:
        return declare(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        log.warning("cannot load the %s CPU kernels %s: %s", what, path, exc)
        return None


def _open_prebuilt() -> CpuKernels | None:
    for variant in builder.supported_variants():
        path = builder.variant_path(variant)
        if path.is_file() and (lib := _open(path, "prebuilt")) is not None:
            return CpuKernels(lib, f"{variant.name} (prebuilt)")
    return None


def _build_here() -> CpuKernels | None:
    """The fallback where nothing was built at install time: compile for this CPU, cached by machine."""
    cc = builder.compiler()
    if cc is None:
        return None
    log.warning("no prebuilt CPU kernels in %s (run `python -m qwenserve.cpu_kernels build` at install time): "
                "building them now with %s", builder.kernel_dir(), cc)
    for march in (["-march=native"], []):
        target = builder.first_use_target(cc, march)
        if not target.is_file():
            with progress.step(f"building the CPU kernels with {os.path.basename(cc)} (once per machine)"):
                if not builder.build_first_working(cc, march, target):
                    continue
        if (lib := _open(target, "first-use")) is None:
            continue
        return CpuKernels(lib, f"{' '.join(march) or 'default target'} (built at first use)")
    return None


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, loaded once per process, or None: then one WARNING says why."""
    kernels = _open_prebuilt() or _build_here()
    if kernels is None:
        log.warning("CPU kernels unavailable (none prebuilt in %s and none could be built): PyTorch's ops run "
                    "instead, slower", builder.kernel_dir())
    else:
        log.info("CPU kernels: %s", kernels.variant)
    return kernels
