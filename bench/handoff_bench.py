"""KV handoff bandwidth: shared memory vs a plain in-process memcpy, plus the network transports.

    .venv/bin/python bench/handoff_bench.py [--min-mib 64] [--max-mib 1024] [--reps 5]

For each size (doubling from --min-mib to --max-mib), all in one run:
  memcpy          one libc memcpy() of the bytes into an already-touched buffer, in-process
  copy_           torch's dst.copy_(src), the same move (it splits the copy across the threads)
  memcpy x2       two memcpy() calls on the two halves from two threads at once: the copy on both cores
  shm             exporter reserve + engine write (slot.write: copy, hashing each chunk as it lands)
                  + publish + importer fetch (map + verify); the importer ends holding a verified
                  zero-copy view
  shm, paged      the same from a paged cache, as an engine exports: slot.gather of the request's tokens
                  from a cache of 16-token blocks in shuffled order (2 KiB rows), hashed as they land
  shm, no csum    the same without checksums (exporter "none", importer require_checksum=False)
  shm -> out      shm plus the importer copying into a buffer of its own (fetch(out=...))
  grpc fetch      the importer's Fetch over loopback from an exporter in another process
                  (chunks + checksum), once the exporter has published
  mooncake fetch  the same through Mooncake Transfer Engine over TCP, where installed
Interleaved columns would inherit unequal caches (a copy with ordinary stores leaves the last level full of
dirty lines that the next column pays to write back), so --cache sets what every timed local run starts from:
"steady" (default) runs the same column once, untimed, just before, as back-to-back handoffs or copies meet
the cache; "cold" reads 256 MiB just before, so every run starts cold and clean (which also evicts the Python
code the handoff's calls run through). Bandwidths are bytes / best time of --reps runs (median beside it).
Ratios in the cells are against memcpy, the plain in-process copy that the target (>= 70%) names; the last
columns put shm against copy_ (the fastest in-process copy here, both cores) and memcpy x2 as well.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ctypes
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from qwenserve.cpu_kernels import loader
from qwenserve.kv_transfer import (
    ExporterConfig,
    ImporterConfig,
    KVExporter,
    KVHandle,
    KVImporter,
    KVLayout,
    KVTransport,
    add_kv_transfer_service,
    mooncake_unavailable_reason,
)
from qwenserve.kv_transfer.checksum import DEFAULT_ALGORITHM

MiB = 1 << 20
# A Llama-8B-like layout: 128 KiB of KV per token, so every size is a whole number of tokens.
LAYOUT = KVLayout("float16", 16, 32, 8, 128, "bench")
PER_TOKEN = LAYOUT.nbytes(1)
#: Read before every local run: several times any last-level cache, so what was there is gone.
FLUSH_BYTES = 256 * MiB


def sizes(min_mib: int, max_mib: int) -> list[int]:
    out, mib = [], min_mib
    while mib <= max_mib:
        out.append(mib * MiB)
        mib *= 2
    return out


# --- the exporter process for network transports -----------------------------------------------


async def serve_exporter(transport: str, max_bytes: int) -> None:
    """Child mode: read "publish <tokens> <id>" lines, answer with base64 handles."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * MiB)])
    port = server.add_insecure_port("127.0.0.1:0")
    exporter = KVExporter(
        ExporterConfig(
            transport=KVTransport.Value(f"KV_TRANSPORT_{transport.upper()}"),
            control_endpoint=f"127.0.0.1:{port}",
            use_shm=False,
            pool_bytes=max_bytes + MiB,
            max_bytes=2 * max_bytes + 2 * MiB,
            segment_prefix="qwenserve-kvbench",
        )
    ).start()
    add_kv_transfer_service(server, exporter)
    await server.start()
    source = torch.randint(-(2**15), 2**15, (max_bytes // 2,), dtype=torch.int16)
    print("ready", flush=True)
    while line := (await asyncio.to_thread(sys.stdin.readline)).split():
        _, tokens, handoff_id = line
        slot = exporter.reserve(handoff_id, LAYOUT, int(tokens))
        slot.tensor.view(-1).view(torch.int16).copy_(source[: slot.nbytes // 2])
        print(base64.b64encode(slot.publish(lease_s=120).SerializeToString()).decode(), flush=True)
    await server.stop(grace=None)
    exporter.close()


class ExporterProcess:
    def __init__(self, transport: str, max_bytes: int) -> None:
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--serve-exporter", transport, "--max-mib", str(max_bytes // MiB)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.child.stdout.readline().strip() == "ready"
        self.count = 0

    def publish(self, nbytes: int) -> KVHandle:
        self.count += 1
        self.child.stdin.write(f"publish {nbytes // PER_TOKEN} h{self.count}\n")
        self.child.stdin.flush()
        return KVHandle.FromString(base64.b64decode(self.child.stdout.readline()))

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait(timeout=30)


# --- the measurements ---------------------------------------------------------------------------


async def measure_size(
    nbytes: int,
    src: torch.Tensor,
    dst: torch.Tensor,
    out: torch.Tensor,
    flush: torch.Tensor | None,
    exporters: dict[str, KVExporter],
    importer: KVImporter,
    network: dict[str, ExporterProcess],
    reps: int,
) -> dict[str, tuple[float, float]]:
    """(best, median) seconds per column for one handoff size."""
    tokens = nbytes // PER_TOKEN
    results: dict[str, tuple[float, float]] = {}

    async def memcpy() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)

    async def copy_() -> None:
        dst.copy_(src)

    half = nbytes // 2

    async def memcpy_x2() -> None:
        # ctypes releases the GIL during the call: the two halves move at once.
        await asyncio.gather(
            asyncio.to_thread(ctypes.memmove, dst.data_ptr(), src.data_ptr(), half),
            asyncio.to_thread(ctypes.memmove, dst.data_ptr() + half, src.data_ptr() + half, nbytes - half),
        )

    # The request's tokens sit in 16-token blocks scattered over the cache: src read as that cache.
    blocks = torch.randperm(tokens // 16, generator=torch.Generator().manual_seed(tokens))
    rows = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)

    def shm(checksum: str, into: torch.Tensor | None, paged: bool = False) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            slot = exporters[checksum].reserve(f"s{time.perf_counter_ns()}", LAYOUT, tokens)
            if paged:
                slot.gather(src, rows)  # the engine's one copy out of its cache, hashed as it lands
            else:
                slot.write(src)  # the same from contiguous memory
            handle = slot.publish(lease_s=60)
            await importer.fetch(handle, LAYOUT, out=into)
            exporters[checksum].release(handle.handoff_id)  # the ack (an RPC, after the engine consumed)

        return run

    # Interleaved rounds, so that every column sees the same background load on a shared machine.
    local = {"memcpy": memcpy, "copy_": copy_, "memcpy x2": memcpy_x2, "shm": shm(DEFAULT_ALGORITHM, None),
             "shm paged": shm(DEFAULT_ALGORITHM, None, paged=True), "shm no csum": shm("none", None),
             "shm -> out": shm(DEFAULT_ALGORITHM, out)}
    times: dict[str, list[float]] = {name: [] for name in local}
    for round_ in range(reps + 1):
        for name, fn in local.items():
            if flush is None:
                await fn()  # the state this column leaves for the next of its kind
            else:
                flush.sum()  # evict: a cold, clean cache
            t0 = time.perf_counter()
            await fn()
            if round_:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
    results.update({name: (min(t), statistics.median(t)) for name, t in times.items()})
    assert torch.equal(out, src)
    for name, process in network.items():
        # The exporter publishes before the clock starts: this column is the network leg alone.
        times = []
        for _ in range(1 + (reps if nbytes <= 256 * MiB else max(1, reps // 2))):
            handle = process.publish(nbytes)
            t0 = time.perf_counter()
            await importer.fetch(handle, LAYOUT, out=dst)
            times.append(time.perf_counter() - t0)
            await importer.release(handle)
        results[f"{name} fetch"] = (min(times[1:]), statistics.median(times[1:]))
    return results


async def bench(args: argparse.Namespace) -> None:
    all_sizes = sizes(args.min_mib, args.max_mib)
    top = all_sizes[-1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; layout {PER_TOKEN // 1024} KiB/token; "
          f"best of {args.reps} (median); cache {args.cache}\n")
    src_all = torch.randn(top // 2).to(torch.float16)
    dst_all = torch.zeros(top // 2, dtype=torch.float16)
    out_all = torch.zeros(top // 2, dtype=torch.float16)
    flush = torch.ones(FLUSH_BYTES // 8, dtype=torch.int64) if args.cache == "cold" else None

    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    exporters = {
        checksum: KVExporter(ExporterConfig(control_endpoint=f"127.0.0.1:{port}", pool_bytes=top + MiB,
                                            max_bytes=2 * top + 2 * MiB, checksum=checksum,
                                            segment_prefix="qwenserve-kvbench")).start()
        for checksum in (DEFAULT_ALGORITHM, "none")
    }
    add_kv_transfer_service(server, exporters[DEFAULT_ALGORITHM])
    await server.start()
    importer = KVImporter(ImporterConfig(require_checksum=False, chunk_bytes=args.chunk_mib * MiB))
    network = {"grpc": ExporterProcess("grpc", top)}
    if mooncake_unavailable_reason() is None and not args.no_mooncake:
        network["mooncake"] = ExporterProcess("mooncake", top)
    else:
        print(f"mooncake: skipped ({mooncake_unavailable_reason() or '--no-mooncake'})")

    columns = ["memcpy", "copy_", "memcpy x2", "shm", "shm paged", "shm no csum", "shm -> out",
               *[f"{n} fetch" for n in network]]
    print(f"checksum {DEFAULT_ALGORITHM}; C kernels {'loaded' if loader.load() is not None else 'unavailable'}")
    print(f"{'size':>8} | " + " | ".join(f"{c:>22}" for c in columns) + " | shm vs copy_ | shm vs memcpy x2")
    for nbytes in all_sizes:
        views = [t[: nbytes // 2].view(LAYOUT.token_shape(nbytes // PER_TOKEN)) for t in (src_all, dst_all, out_all)]
        results = await measure_size(nbytes, *views, flush, exporters, importer, network, args.reps)
        base = results["memcpy"][0]
        cells = [
            f"{nbytes / best / 1e9:6.2f} ({nbytes / med / 1e9:5.2f}) GB/s" + ("" if col == "memcpy" else f" {base / best:4.0%}")
            for col, (best, med) in ((c, results[c]) for c in columns)
        ]
        fastest, both = (results[c][0] / results["shm"][0] for c in ("copy_", "memcpy x2"))
        print(f"{nbytes // MiB:>5}MiB | " + " | ".join(f"{c:>22}" for c in cells) + f" | {fastest:12.0%} | {both:16.0%}",
              flush=True)

    for process in network.values():
        process.close()
    await importer.close()
    await server.stop(grace=None)
    for exporter in exporters.values():
        exporter.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-mib", type=int, default=64)
    parser.add_argument("--max-mib", type=int, default=1024, help="largest handoff (memory: about 7x this)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cache", choices=["steady", "cold"], default="steady",
                        help="what each timed local run starts from (see above)")
    parser.add_argument("--chunk-mib", type=int, default=4, help="gRPC Fetch chunk size")
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--serve-exporter", choices=["grpc", "mooncake"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_exporter:
        asyncio.run(serve_exporter(args.serve_exporter, args.max_mib * MiB))
    else:
        asyncio.run(bench(args))


if __name__ == "__main__":
    main()
