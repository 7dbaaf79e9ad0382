"""A start-up measurement of this CPU's linear products, from which `--dtype auto` chooses an engine's precision
(engine/precision.py).

Which product is fastest depends on the CPU and on a step's row count, and no flag in /proc/cpuinfo says it:
bf16 panels halve the bytes a decode step streams and win wherever decode is memory-bound, while at prefill's
hundreds of rows oneDNN's bf16 product (AMX tiles, AVX512_BF16 dot products) can run several times our fp32
panels on one CPU and far slower on another (AVX2 only). So it is measured, once per process, on a matrix the
model's shape: our fp32 and bf16 panels at one row, and our bf16 panels against PyTorch's bf16 `F.linear` at
`ROWS` rows, and, on a CPU with AMX, our own bf16 product on AMX tiles (linear_amx.c) at those rows too: the
faster of the two many-row products is the one an engine keeps its weights for. About a second of both cores, so a result is kept on disk (cache.py's folder, `linear-probe/`) under
a key naming the CPU, its flags, the kernels' sources, PyTorch's version, the shape and the thread count: a second
start on the same machine reads it (every stage of `qwen-serve up`, every restart), and prefill and decode workers of
one host choose alike. Remove the folder to measure again.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwenserve.cache import cache_root
from qwenserve.cpu_kernels import amx_weight, onednn_weight
from qwenserve.cpu_kernels.builder import cpu_flags, source_digest
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.cpu_kernels.packed_weight import PANEL, PackedWeight

# Row counts where our bf16 panels and PyTorch's bf16 product are compared: decode batches to prefill chunks.
ROWS = (4, 8, 16, 32, 64, 256)
# The probe's matrix is the model's MLP input projection, capped so the probe stays short and small.
MAX_PROBE_N, MAX_PROBE_K = 6144, 2048
# Each timing is the best of this many runs (a one-off stall is not the product's speed) ...
REPEATS = 5
# ... of a loop at least this long (a 0.1 ms product is timed over many calls).
MIN_LOOP_S = 0.004
# Whole probes, at most, this far apart: the best time of each product over them counts.
TRIES, SETTLE_S = 3, 0.2
# Part of the cache key: a change to what is measured or how makes earlier results stale.
PROBE_VERSION = 3  # 2: PyTorch's bf16 product on a weight prepacked once (onednn_weight.py); 3: our AMX product
# Row counts from which a many-row product is weighed against the other (decode batches and prefill chunks).
DENSE_CHOICE_ROWS = 16

log = logging.getLogger("qwenserve.cpu_kernels")


@dataclass(frozen=True)
class LinearProbe:
    """Milliseconds per product on an n x k matrix: `fp32_ms` and `bf16_ms` our panels at one row; `panels_ms`,
    `onednn_ms` and `amx_ms` our bf16 panels, PyTorch's bf16 product and ours on AMX tiles at each of `ROWS` rows
    (keys; `amx_ms` empty where that product cannot run)."""

    n: int
    k: int
    fp32_ms: float
    bf16_ms: float
    panels_ms: dict[int, float]
    onednn_ms: dict[int, float]
    seconds: float  # what the probe took (0: read from the cache)
    amx_ms: dict[int, float] = field(default_factory=dict)

    def bf16_speedup(self) -> float:
        """fp32 panels' time over bf16 panels' at one row: above 1, bf16 weights decode faster."""
        return self.fp32_ms / self.bf16_ms

    def dense_product(self) -> str:
        """The many-row product to keep weights for: 'amx' where ours on AMX tiles ran and took less time than
        PyTorch's over the probed counts from DENSE_CHOICE_ROWS rows up (the geometric mean of the ratios, so a
        32-row decode step weighs as much as a prefill chunk), 'onednn' otherwise."""
        many = [rows for rows in self.onednn_ms if rows >= DENSE_CHOICE_ROWS]
        if not self.amx_ms or not many:
            return "onednn"
        log_ratio = sum(math.log(self.amx_ms[rows] / self.onednn_ms[rows]) for rows in many) / len(many)
        return "amx" if log_ratio < 0 else "onednn"

    def dense_ms(self) -> dict[int, float]:
        """The chosen many-row product's times (dense_product)."""
        return self.amx_ms if self.dense_product() == "amx" else self.onednn_ms

    def dense_from(self, margin: float = 0.9) -> int | None:
        """The fewest probed rows from which the many-row product (dense_product) beats our bf16 panels (takes at
        most `margin` of their time) at that count and every larger one probed; None where it never does."""
        start, dense = None, self.dense_ms()
        for rows in sorted(self.panels_ms, reverse=True):
            if dense[rows] > margin * self.panels_ms[rows]:
                break
            start = rows
        return start

    def summary(self) -> str:
        """One line for the start-up log."""
        rows = ", ".join(f"{r} rows {self.panels_ms[r]:.2f}/{self.onednn_ms[r]:.2f}"
                         + (f"/{self.amx_ms[r]:.2f}" if self.amx_ms else "") for r in sorted(self.panels_ms))
        return (f"{self.n}x{self.k} at 1 row: fp32 panels {self.fp32_ms:.3f} ms, bf16 panels {self.bf16_ms:.3f} ms; "
                f"bf16 panels/oneDNN bf16{'/AMX tiles' if self.amx_ms else ''} ms: {rows} "
                + (f"({self.seconds:.2f} s)" if self.seconds else "(measured before)"))


def _best_ms(*runs: Callable[[], object]) -> list[float]:
    """Each run's best time per call, in ms. The runs' loops alternate, so a burst of load from another process
    (a sibling stage loading its weights at the same start) weighs on every run alike, not on whichever was timed
    then."""
    calls = []
    for run in runs:
        run()  # first call: page faults, oneDNN's primitive creation
        start = time.perf_counter()
        run()
        calls.append(max(1, int(MIN_LOOP_S / max(time.perf_counter() - start, 1e-6))))
    best = [float("inf")] * len(runs)
    for _ in range(REPEATS):
        for i, (run, count) in enumerate(zip(runs, calls, strict=True)):
            start = time.perf_counter()
            for _ in range(count):
                run()
            best[i] = min(best[i], (time.perf_counter() - start) / count)
    return [b * 1e3 for b in best]


def probe_shape(hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    """The probe's n x k for a model: its gate/up projection, capped at MAX_PROBE_N x MAX_PROBE_K, n a whole
    number of panels."""
    n = min(2 * max(intermediate_size, hidden_size), MAX_PROBE_N) // PANEL * PANEL
    return max(n, PANEL), max(1, min(hidden_size, MAX_PROBE_K))


@functools.cache
def measure(kernels: CpuKernels, n: int, k: int, threads: int) -> LinearProbe:
    """The products' times on an n x k matrix with `threads` threads: read from the disk cache where this machine
    measured them before, else measured (`measure_now`) and written there.

    A measurement taken while the machine was busy (a test suite beside it) is kept marked so, and used while the
    machine is still busy; the first start on a quiet machine measures again and replaces it. Kept as the truth for
    good, one such probe had oneDNN's product win only from 64 rows where quiet it wins from 16, and a 32-request
    batch decoded on the slower product ever after."""
    path = cache_path(kernels, n, k, threads)
    # One process of this machine measures at a time: stages that start together (`qwen-serve up`) measured each
    # other's probes, and on the AMX Xeon two such chose their many-row product from 8 and from 32 rows.
    with _one_at_a_time(path.with_name(f"{path.name}.lock")):
        cached = _read_cached(path, n, k)
        return cached if cached is not None else _measure_and_keep(kernels, n, k, threads, path)


@contextlib.contextmanager
def _one_at_a_time(lock: Path) -> Iterator[None]:
    """An exclusive lock on `lock` (created) while the block runs; no lock where the folder cannot hold one."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a")  # noqa: SIM115 - held across the yield
    except OSError as e:
        log.warning("linear probe lock %s unavailable (%s): measuring without it", lock, e)
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _read_cached(path: Path, n: int, k: int) -> LinearProbe | None:
    """The probe kept at `path`, or None where there is none, it is torn, or it was measured busy and the machine is
    quiet now."""
    try:
        fields = json.loads(path.read_text())
        if fields.get("quiet") is not True and not machine_busy():
            raise LookupError("measured on a busy machine, and this one is quiet now")
        cached = LinearProbe(n, k, float(fields["fp32_ms"]), float(fields["bf16_ms"]),
                             {r: float(fields["panels_ms"][str(r)]) for r in ROWS},
                             {r: float(fields["onednn_ms"][str(r)]) for r in ROWS}, 0.0,
                             {r: float(fields["amx_ms"][str(r)]) for r in ROWS} if fields["amx_ms"] else {})
    except FileNotFoundError:
        return None
    except LookupError as e:
        log.info("linear probe cache %s %s: measuring again", path, e)
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # a torn or foreign file is measured again
        log.warning("linear probe cache %s unreadable (%s): measuring again", path, e)
        return None
    log.info("linear products: this machine's measurement from %s", path)
    return cached


def _measure_and_keep(kernels: CpuKernels, n: int, k: int, threads: int, path: Path) -> LinearProbe:
    """Measured now and written to `path`."""
    busy_before = machine_busy()
    measured = measure_now(kernels, n, k, threads)
    fields = {"quiet": not (busy_before or machine_busy()), "fp32_ms": measured.fp32_ms, "bf16_ms": measured.bf16_ms,
              "panels_ms": {str(r): t for r, t in measured.panels_ms.items()},
              "onednn_ms": {str(r): t for r, t in measured.onednn_ms.items()},
              "amx_ms": {str(r): t for r, t in measured.amx_ms.items()}, "seconds": measured.seconds,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:  # written whole or not at all
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(fields, indent=1))
        os.replace(temporary, path)
    except OSError as e:
        log.warning("linear probe cache %s not written (%s)", path, e)
    return measured


def machine_busy() -> bool:
    """Whether other work loads this machine's cores (the last minute's load average above three quarters of them,
    the starting process itself counting for about one): a probe
    measured then is not this CPU's own figure."""
    try:
        cores = len(os.sched_getaffinity(0))
        return os.getloadavg()[0] > 0.75 * cores
    except (AttributeError, OSError):
        return False


def cache_path(kernels: CpuKernels, n: int, k: int, threads: int) -> Path:
    """Where a probe of this shape and thread count on this CPU, kernels and PyTorch is kept."""
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
                 platform.processor())
    key = json.dumps([PROBE_VERSION, model, sorted(cpu_flags()), kernels.variant, source_digest(), torch.__version__,
                      n, k, threads])
    return cache_root() / "linear-probe" / f"{n}x{k}-t{threads}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []


def measure_now(kernels: CpuKernels, n: int, k: int, threads: int) -> LinearProbe:
    """The products' times measured now: the best of up to TRIES probes SETTLE_S apart, stopping once another
    probe improves no time by more than a tenth. One probe alone was not enough: under `qwen-serve up` a stage
    probing while its sibling loads its weights saw every product 8x slower and chose fp32."""
    best = _probe_once(kernels, n, k, threads)
    for _ in range(TRIES - 1):
        time.sleep(SETTLE_S)
        again = _probe_once(kernels, n, k, threads)
        merged = LinearProbe(n, k, min(best.fp32_ms, again.fp32_ms), min(best.bf16_ms, again.bf16_ms),
                             {r: min(best.panels_ms[r], again.panels_ms[r]) for r in ROWS},
                             {r: min(best.onednn_ms[r], again.onednn_ms[r]) for r in ROWS},
                             best.seconds + SETTLE_S + again.seconds,
                             {r: min(best.amx_ms[r], again.amx_ms[r]) for r in best.amx_ms if r in again.amx_ms})
        settled = all(new >= 0.9 * old for new, old in zip(_times(merged), _times(best), strict=True))
        best = merged
        if settled:
            break
    return best


def _times(probe: LinearProbe) -> list[float]:
    return [probe.fp32_ms, probe.bf16_ms, *probe.panels_ms.values(), *probe.onednn_ms.values(),
            *probe.amx_ms.values()]


def _probe_once(kernels: CpuKernels, n: int, k: int, threads: int) -> LinearProbe:
    started = time.perf_counter()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(n, k, generator=generator) / k**0.5
        fp32, bf16 = PackedWeight.pack(weight), PackedWeight.pack(weight, torch.bfloat16)
        dense = onednn_weight.prepack(weight.to(torch.bfloat16))
        x = torch.randn(max(ROWS), k, generator=generator)
        tiles = _amx_tiles(kernels, weight, x)
        del weight
        one = x[:1].contiguous()
        fp32_ms, bf16_ms = _best_ms(functools.partial(kernels.linear_packed, one, fp32),
                                    functools.partial(kernels.linear_packed, one, bf16))
        del fp32  # a model-sized fp32 matrix need not outlive its timing
        panels_ms, onednn_ms, amx_ms = {}, {}, {}
        for rows in ROWS:
            xs = x[:rows].contiguous()
            xb = xs.to(torch.bfloat16)
            # Each many-row product as the engine calls it: x rounded to bf16, the result widened.
            runs = [functools.partial(kernels.linear_packed, xs, bf16),
                    lambda xb=xb: onednn_weight.linear(xb, dense).float()]
            if tiles is not None:
                runs.append(lambda xb=xb: kernels.linear_bf16_amx(xb, tiles).float())
            panels_ms[rows], onednn_ms[rows], *amx = _best_ms(*runs)
            if amx:
                amx_ms[rows] = amx[0]
    finally:
        torch.set_num_threads(previous)
    return LinearProbe(n, k, fp32_ms, bf16_ms, panels_ms, onednn_ms, time.perf_counter() - started, amx_ms)


def _amx_tiles(kernels: CpuKernels, weight: torch.Tensor, x: torch.Tensor) -> amx_weight.AmxWeight | None:
    """`weight` in AMX tile order where our AMX product runs here (the CPU has AMX, the build has the kernel, the
    kernel gets the tile state, the shape tiles), else None."""
    if "amx_bf16" not in cpu_flags() or not amx_weight.tileable(weight):
        return None
    tiles = amx_weight.pack(weight)
    return tiles if kernels.linear_bf16_amx(x[:1].to(torch.bfloat16), tiles) is not None else None
