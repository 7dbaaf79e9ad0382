"""The prefill side of a handoff: reserve memory, let the engine write KV into it, publish a lease.

    slot = exporter.reserve(handoff_id, layout, num_tokens)
    slot.gather(paged_cache, token_slots)               # the engine's one copy, hashed as it lands
    slot.write_state(state)                             # a hybrid model's linear-attention state, after the KV
    handle = slot.publish(lease_s=30)                   # lease (+ checksum, if written through slot.tensor)
    ...                                                 # decode fetches, then releases
The bytes stay until `release()` (the importer's ack, via KVTransfer.Release) or until the
lease expires, when the background sweeper reclaims them. A reservation never published is
reclaimed after `reserve_timeout_s`, so a crashed forward pass leaks nothing either.

A handoff reserved with a `binding` (binding.py) is fetched and released over KVTransfer only by a caller
presenting that token; any other is refused (KVHandoffRefused) and the handoff stays as it was.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from qwenserve.addresses import endpoint_host, is_wildcard_host
from qwenserve.cpu_kernels import loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.handoff_binding import refusal
from qwenserve.kv_layout import KVLayout, LinearState
from qwenserve.kv_transfer.checksum import (
    DEFAULT_ALGORITHM,
    NO_CHECKSUM,
    compute_checksum,
    fused_copy,
    gather_copy,
)
from qwenserve.kv_transfer.errors import KVHandoffExists, KVHandoffGone, KVHandoffRefused, KVLayoutInvalid
from qwenserve.kv_transfer.handle import (
    MARKER_BYTES,
    MARKER_PAGE,
    KVHandle,
    KVTransport,
    handoff_marker,
)
from qwenserve.kv_transfer.mooncake_transport import MooncakeEndpoint
from qwenserve.kv_transfer.pool import BufferPool, Extent, MemoryRegion, PrivateRegion
from qwenserve.kv_transfer.shm import DEFAULT_PREFIX, ShmSegment, reap_orphaned_segments
from qwenserve.protocol import kv_layout_to_proto

log = logging.getLogger(__name__)

MiB = 1 << 20
# Names cancelled before they were reserved, remembered at most this many at once (the oldest go first).
CANCELLED_NAMES_MAX = 4096


@dataclass
class ExporterConfig:
    """Settings of a KVExporter (the prefill service fills them from its flags: --kv-pool-mib, --kv-max-mib...)."""

    #: Transport written into handles: KV_TRANSPORT_SHM, _GRPC or _MOONCAKE.
    transport: int = KVTransport.KV_TRANSPORT_SHM
    #: "host:port" of this process's KVTransfer service (Release, and Fetch for gRPC).
    control_endpoint: str = ""
    #: Pre-faulted memory kept for handoffs; larger handoffs get a region of their own.
    pool_bytes: int = 256 * MiB
    #: Upper bound on memory held by unreleased handoffs.
    max_bytes: int = 4096 * MiB
    #: Memory in /dev/shm (needed for shm handoffs) or private to the process.
    use_shm: bool = True
    segment_prefix: str = DEFAULT_PREFIX
    checksum: str = DEFAULT_ALGORITHM
    #: A reservation not published within this time is reclaimed (the engine failed mid-write).
    reserve_timeout_s: float = 60.0
    sweep_interval_s: float = 0.5
    #: Touch the pool's pages at start-up so that handoffs write at memcpy speed.
    prefault: bool = True
    #: Remove segments under segment_prefix left by processes that died (kill -9) at start-up.
    reap_orphans: bool = True
    #: Address Mooncake listens on and advertises.
    mooncake_host: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"


@dataclass(frozen=True)
class ExportCounters:
    """A snapshot of an exporter's handoffs, for metrics and leak checks."""

    outstanding: int  # reserved or published, not yet freed
    outstanding_bytes: int
    published: int
    released: int  # acknowledged by an importer (or cancelled by the owner)
    reclaimed: int  # freed by the sweeper: lease or reservation timed out
    aborted: int
    bytes_published: int


@dataclass
class _Handoff:
    handoff_id: str
    extent: Extent
    layout: KVLayout
    num_tokens: int
    nbytes: int
    deadline: float  # time.monotonic(): reservation timeout, then lease expiry
    published: bool = False
    freed: bool = False  # no longer fetchable; memory returns to the pool once unpinned
    pins: int = 0
    #: Set by ExportSlot.write, which hashes while copying; publish then need not read the bytes again.
    checksum: str | None = None
    handle: KVHandle | None = field(default=None, repr=False)
    #: The token Fetch and Release must present ("": unbound); never logged.
    binding: str = field(default="", repr=False)

    @property
    def data(self) -> torch.Tensor:
        start = self.extent.offset + MARKER_PAGE
        return self.extent.region.bytes[start : start + self.nbytes]


class ExportSlot:
    """Reserved memory for one handoff; the engine writes `tensor`, then publishes or aborts."""

    def __init__(self, exporter: KVExporter, entry: _Handoff) -> None:
        self._exporter = exporter
        self._entry = entry
        self.handoff_id = entry.handoff_id
        self.nbytes = entry.nbytes
        kv, state = entry.layout.split(entry.data, entry.num_tokens)
        #: Writable [L, 2, T, H, D] tensor of the layout's dtype, directly over the transport's memory.
        self.tensor = kv
        #: A hybrid model's linear-attention state, after the KV in the same memory (None for other models).
        self.state = state

    def write(self, src: torch.Tensor) -> None:
        """Copy a contiguous [L, 2, T, H, D] CPU tensor into the slot, hashing each chunk as it lands.

        Cheaper than `tensor.copy_(src)` followed by `publish()`, which must read the bytes again.
        Don't write through `tensor` afterwards: the checksum is already taken."""
        if src.shape != self.tensor.shape or src.dtype != self.tensor.dtype:
            raise KVLayoutInvalid(
                f"handoff {self.handoff_id}: cannot write {src.dtype} {tuple(src.shape)} into a slot of "
                f"{self.tensor.dtype} {tuple(self.tensor.shape)}"
            )
        self._entry.checksum = None
        checksum = fused_copy(self.tensor, src.contiguous(), self._copy_algorithm(), kernels=self._exporter.kernels)
        self._keep_checksum(checksum)

    def gather(self, planes: torch.Tensor, rows: torch.Tensor) -> None:
        """Fill the slot from an engine's paged cache, hashing as the bytes land: tensor[l, k, t] = planes[l, k,
        rows[t]] for `planes` [L, 2, S, H, D] (contiguous, on the CPU) and `rows` the request's S-indices.

        The engine's one copy out of its cache; like `write`, publish then need not read the bytes again."""
        shape = tuple(self.tensor.shape)
        if planes.dim() != 5 or (planes.shape[:2], planes.shape[3:]) != (shape[:2], shape[3:]) or (
            planes.dtype != self.tensor.dtype
        ):
            raise KVLayoutInvalid(
                f"handoff {self.handoff_id}: cannot gather {planes.dtype} {tuple(planes.shape)} into a slot of "
                f"{self.tensor.dtype} {shape}"
            )
        self._entry.checksum = None
        layers, kv = shape[:2]
        checksum = gather_copy(self.tensor.view(layers * kv, *shape[2:]), planes.view(layers * kv, *planes.shape[2:]),
                               rows, self._copy_algorithm(), kernels=self._exporter.kernels)
        self._keep_checksum(checksum)

    def write_state(self, state: LinearState) -> None:
        """Copy a hybrid model's linear-attention state in after the KV; publish then hashes the whole handoff."""
        if self.state is None:
            raise KVLayoutInvalid(f"handoff {self.handoff_id}: its layout has no linear-attention state")
        self._entry.layout.check_state(state, f"handoff {self.handoff_id}")
        self._entry.checksum = None
        self.state.recurrent.copy_(state.recurrent)
        self.state.conv.copy_(state.conv)

    def _copy_algorithm(self) -> str:
        # With linear-attention state after the KV, publish hashes the whole handoff once: a hash taken while
        # copying would cover the KV only, so the copy takes none.
        return self._exporter.config.checksum if self.state is None else NO_CHECKSUM

    def _keep_checksum(self, checksum: str) -> None:
        self._entry.checksum = checksum if self.state is None else None

    def publish(self, lease_s: float = 30.0) -> KVHandle:
        """Checksum the bytes, start a lease of `lease_s` seconds and return the handle for the importer."""
        return self._exporter._publish(self._entry, lease_s)

    def abort(self) -> None:
        """Give the memory back without publishing (the forward pass failed or was cancelled)."""
        self._exporter._abort(self._entry)


class KVExporter:
    """Owns a prefill process's handoff memory and leases; thread-safe."""

    def __init__(self, config: ExporterConfig | None = None,
                 kernels: CpuKernels | None | Literal["process"] = "process") -> None:
        """`kernels`: the C kernels that copy and hash the handoff bytes (None: NumPy's forms, the same digests;
        "process": the process's, cpu_kernels/loader.py)."""
        self.config = config or ExporterConfig()
        self.kernels = loader.load() if kernels == "process" else kernels
        transport = self.config.transport
        if transport == KVTransport.KV_TRANSPORT_SHM and not self.config.use_shm:
            raise ValueError("shared-memory handoffs need use_shm=True")
        if transport in (KVTransport.KV_TRANSPORT_GRPC,) and not self.config.control_endpoint:
            raise ValueError("gRPC handoffs need control_endpoint, the address of this KVTransfer service")
        # Every address a handle carries is dialled by another process, maybe on another host: never a wildcard.
        if self.config.control_endpoint and is_wildcard_host(endpoint_host(self.config.control_endpoint)):
            raise ValueError(f"control_endpoint {self.config.control_endpoint} is a wildcard address, which no "
                             "decode worker can dial; advertise this host's address (--advertise-host)")
        if transport == KVTransport.KV_TRANSPORT_MOONCAKE and is_wildcard_host(self.config.mooncake_host):
            raise ValueError(f"mooncake_host {self.config.mooncake_host!r} is a wildcard address, which no decode "
                             "worker can dial; advertise this host's address (--advertise-host)")
        self._mooncake = (
            MooncakeEndpoint(self.config.mooncake_host, self.config.mooncake_protocol)
            if transport == KVTransport.KV_TRANSPORT_MOONCAKE
            else None
        )
        self._pool = BufferPool(
            self._new_region,
            self.config.pool_bytes,
            self.config.max_bytes,
            on_region_added=self._mooncake.register if self._mooncake else None,
            on_region_removed=self._mooncake.unregister if self._mooncake else None,
        )
        self._lock = threading.Lock()
        self._handoffs: dict[str, _Handoff] = {}
        # A caller that gave up may cancel a handoff by name before the engine reserves it (the release
        # overtakes a slow or stopped prefill): the name is refused when it comes, until reserve_timeout_s.
        self._cancelled: dict[str, float] = {}
        # The same by binding token: a caller that gave up before learning the (random) handoff id.
        self._cancelled_bindings: dict[str, float] = {}
        self._counts = {"published": 0, "released": 0, "reclaimed": 0, "aborted": 0, "bytes_published": 0}
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    def _new_region(self, size: int, prefault: bool) -> MemoryRegion:
        prefault = prefault and self.config.prefault
        if self.config.use_shm:
            return ShmSegment.create(size, self.config.segment_prefix, prefault)
        return PrivateRegion(size, prefault)

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> KVExporter:
        """Reap orphans, pre-fault the pool and start the lease sweeper. Returns self."""
        if self.config.reap_orphans and self.config.use_shm:
            for name in reap_orphaned_segments(self.config.segment_prefix):
                log.warning("removed shared-memory segment %s left by a process that died", name)
        self._pool.start()
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep_forever, name="kv-lease-sweeper", daemon=True)
            self._sweeper.start()
        return self

    def close(self) -> None:
        """Stop the sweeper and free every handoff and region (importers' mappings stay valid)."""
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join()
        with self._lock:
            self._handoffs.clear()
        self._pool.close()

    def __enter__(self) -> KVExporter:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the engine's side -----------------------------------------------------------------

    def reserve(self, handoff_id: str, layout: KVLayout, num_tokens: int, binding: str = "") -> ExportSlot:
        """Reserve memory for `num_tokens` tokens of KV; write it through `slot.tensor`. With `binding`, only a
        KVTransfer caller presenting that token may fetch or release it."""
        if num_tokens < 1:
            raise KVLayoutInvalid(f"a KV handoff needs at least one token, got {num_tokens}")
        nbytes = layout.nbytes(num_tokens)
        with self._lock:
            now = time.monotonic()
            cancelled = self._cancelled.pop(handoff_id, 0.0) > now
            if binding and self._cancelled_bindings.pop(binding, 0.0) > now:
                cancelled = True
            if cancelled:
                raise KVHandoffGone(f"handoff {handoff_id} was cancelled by its caller before it was made")
            if handoff_id in self._handoffs:
                raise KVHandoffExists(f"handoff id {handoff_id!r} is already reserved on this exporter")
        extent = self._pool.allocate(MARKER_PAGE + nbytes)
        entry = _Handoff(
            handoff_id, extent, layout, num_tokens, nbytes, time.monotonic() + self.config.reserve_timeout_s,
            binding=binding,
        )
        with self._lock:
            if handoff_id in self._handoffs:
                self._pool.free(extent)
                raise KVHandoffExists(f"handoff id {handoff_id!r} is already reserved on this exporter")
            self._handoffs[handoff_id] = entry
        return ExportSlot(self, entry)

    def _publish(self, entry: _Handoff, lease_s: float) -> KVHandle:
        with self._lock:
            if entry.freed or entry.published:
                state = "already published" if entry.published and not entry.freed else "freed"
                raise KVHandoffGone(f"cannot publish handoff {entry.handoff_id}: it is {state}")
        checksum = entry.checksum or compute_checksum(entry.data, self.config.checksum, kernels=self.kernels)
        header = entry.extent.region.bytes[entry.extent.offset : entry.extent.offset + MARKER_BYTES]
        header.copy_(torch.frombuffer(bytearray(handoff_marker(entry.handoff_id, entry.nbytes)), dtype=torch.uint8))
        handle = KVHandle(
            handoff_id=entry.handoff_id,
            transport=self.config.transport,
            layout=kv_layout_to_proto(entry.layout),
            num_tokens=entry.num_tokens,
            length=entry.nbytes,
            checksum=checksum,
            lease_expires_unix_ms=int((time.time() + lease_s) * 1000),
            control_endpoint=self.config.control_endpoint,
        )
        data_offset = entry.extent.offset + MARKER_PAGE
        if self.config.transport == KVTransport.KV_TRANSPORT_SHM:
            handle.location, handle.offset = entry.extent.region.name, data_offset
        elif self.config.transport == KVTransport.KV_TRANSPORT_GRPC:
            handle.location, handle.offset = self.config.control_endpoint, 0
        else:
            handle.location = self._mooncake.session
            handle.offset = entry.extent.region.bytes.data_ptr() + data_offset
            handle.attributes["mooncake_marker_offset"] = str(MARKER_PAGE)
        with self._lock:
            if entry.freed:
                raise KVHandoffGone(f"handoff {entry.handoff_id} was reclaimed before it was published")
            entry.published, entry.handle = True, handle
            entry.deadline = time.monotonic() + lease_s
            self._counts["published"] += 1
            self._counts["bytes_published"] += entry.nbytes
        return handle

    def _abort(self, entry: _Handoff) -> None:
        if self._free(entry.handoff_id, expect=entry):
            with self._lock:
                self._counts["aborted"] += 1

    # --- the importer's side ---------------------------------------------------------------

    def release(self, handoff_id: str, reason: str = "imported", *, token: str | None = None) -> bool:
        """Free a handoff now. Idempotent: False when it was unknown, released or expired.

        `token`: what a KVTransfer caller presented ("" for nothing); None for this process's own calls, which
        need none. Raises KVHandoffRefused, freeing nothing, when it is not the token the handoff is bound to.
        A "cancelled" release of a name not reserved yet makes a later reserve of that name fail."""
        freed = self._free(handoff_id, presented=token)
        if freed:
            with self._lock:
                self._counts["released"] += 1
            log.debug("released handoff %s (%s)", handoff_id, reason)
        elif reason == "cancelled":
            with self._lock:
                if len(self._cancelled) >= CANCELLED_NAMES_MAX:
                    del self._cancelled[next(iter(self._cancelled))]
                self._cancelled[handoff_id] = time.monotonic() + self.config.reserve_timeout_s
        return freed

    def cancel(self, token: str) -> int:
        """Free the handoffs bound to `token`, or, when there are none yet, refuse a later reserve with it
        (until reserve_timeout_s): for a caller that gave up on a prefill before learning the handoff's id.
        Returns how many it freed."""
        if not token:
            raise ValueError("cancel needs the token a handoff is bound to")
        with self._lock:
            names = [e.handoff_id for e in self._handoffs.values() if e.binding and refusal(e.binding, token) is None]
            if not names:
                if len(self._cancelled_bindings) >= CANCELLED_NAMES_MAX:
                    del self._cancelled_bindings[next(iter(self._cancelled_bindings))]
                self._cancelled_bindings[token] = time.monotonic() + self.config.reserve_timeout_s
        return sum(self.release(name, "cancelled", token=token) for name in names)

    @contextlib.contextmanager
    def pinned(self, handoff_id: str, *, token: str | None = None) -> Iterator[memoryview]:
        """The published bytes of a handoff, kept from being freed until the block exits.

        Raises KVHandoffGone when the handoff is unknown, unpublished, released or expired; KVHandoffRefused when
        `token` (as for `release`) is not the one it is bound to.
        """
        with self._lock:
            entry = self._handoffs.get(handoff_id)
            if entry is None or not entry.published or entry.freed:
                raise KVHandoffGone(
                    f"handoff {handoff_id} is not available on this exporter (never published, "
                    "released, or its lease expired)"
                )
            _check_binding(entry, token, "fetch")
            entry.pins += 1
        try:
            yield memoryview(entry.data.numpy())
        finally:
            with self._lock:
                entry.pins -= 1
                give_back = entry.freed and entry.pins == 0
            if give_back:
                self._give_back(entry)

    # --- leases ----------------------------------------------------------------------------

    def sweep(self, now: float | None = None) -> int:
        """Reclaim expired leases and stale reservations (the sweeper calls this); returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [e for e in self._handoffs.values() if e.deadline <= now and not e.freed]
            for cancelled in (self._cancelled, self._cancelled_bindings):
                for name in [n for n, until in cancelled.items() if until <= now]:
                    del cancelled[name]
        reclaimed = 0
        for entry in expired:
            if self._free(entry.handoff_id, expect=entry):
                reclaimed += 1
                log.info("reclaimed handoff %s: its %s expired", entry.handoff_id,
                         "lease" if entry.published else "reservation")
        with self._lock:
            self._counts["reclaimed"] += reclaimed
        return reclaimed

    def _sweep_forever(self) -> None:
        while not self._stop.wait(self.config.sweep_interval_s):
            self.sweep()

    def _free(self, handoff_id: str, expect: _Handoff | None = None, presented: str | None = None) -> bool:
        with self._lock:
            entry = self._handoffs.get(handoff_id)
            if entry is None or entry.freed or (expect is not None and entry is not expect):
                return False
            _check_binding(entry, presented, "release")
            entry.freed = True
            del self._handoffs[handoff_id]
            give_back = entry.pins == 0
        if give_back:
            self._give_back(entry)
        return True

    def _give_back(self, entry: _Handoff) -> None:
        # Wipe the marker first: a direct reader that checks it afterwards knows the bytes moved on.
        offset = entry.extent.offset
        entry.extent.region.bytes[offset : offset + MARKER_BYTES].zero_()
        self._pool.free(entry.extent)

    # --- observability ---------------------------------------------------------------------

    def counters(self) -> ExportCounters:
        """Current counts (outstanding handoffs and bytes, and totals since start)."""
        with self._lock:
            live = list(self._handoffs.values())
            return ExportCounters(
                outstanding=len(live),
                outstanding_bytes=sum(e.nbytes for e in live),
                **self._counts,
            )


def _check_binding(entry: _Handoff, presented: str | None, what: str) -> None:
    """Raise KVHandoffRefused when `presented` may not touch the entry (see binding.refusal)."""
    why = refusal(entry.binding, presented)
    if why is not None:
        raise KVHandoffRefused(
            f"cannot {what} handoff {entry.handoff_id}: the token it is bound to was {why} "
            "(only the decode worker the router sent it to may)", why)
