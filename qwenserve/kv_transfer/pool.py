"""The exporter's handoff memory: page-aligned extents carved out of pre-faulted regions.

Fresh memory is slow to write (page faults run at a tenth of memcpy speed here), so the
exporter keeps a base region touched once at start-up and reuses it. A handoff that does not
fit gets an overflow region of its own, returned to the system as soon as it is free.
"""

from __future__ import annotations

import bisect
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from qwenserve.kv_transfer.errors import KVPoolExhausted

PAGE = mmap.PAGESIZE


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


class MemoryRegion(Protocol):
    """A contiguous block of host memory: a shm segment or private anonymous memory."""

    name: str  # the /dev/shm segment name; "" for private memory
    size: int
    bytes: torch.Tensor  # uint8 view of the whole region

    def close(self) -> None: ...


class PrivateRegion:
    """Anonymous memory only this process maps (network transports)."""

    def __init__(self, size: int, prefault: bool = True) -> None:
        self.name = ""
        self.size = size
        self.bytes = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
        if prefault:
            self.bytes.zero_()

    def close(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)


class ExtentAllocator:
    """First-fit allocation of page-aligned byte ranges in [0, size), coalescing on free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size else []  # sorted (offset, length)
        self.used = 0

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free range of round_up(nbytes) bytes, or None when none is large enough."""
        need = round_up(nbytes)
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self.used += need
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a range obtained from allocate(offset of, same nbytes)."""
        length = round_up(nbytes)
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] < offset + length or (
            i > 0 and sum(self._free[i - 1]) > offset
        ):
            raise ValueError(f"double free of extent at {offset} (+{length})")
        if i < len(self._free) and self._free[i][0] == offset + length:
            length += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:
            offset, prev = self._free.pop(i - 1)
            length += prev
            i -= 1
        self._free.insert(i, (offset, length))
        self.used -= round_up(nbytes)


@dataclass(frozen=True)
class Extent:
    """A range of one region; `tensor` is its uint8 view."""

    region: MemoryRegion
    offset: int
    length: int

    @property
    def tensor(self) -> torch.Tensor:
        return self.region.bytes[self.offset : self.offset + self.length]


class BufferPool:
    """Thread-safe extents over a base region of `capacity_bytes` plus overflow regions.

    `new_region(size, prefault)` makes a region; the hooks let a transport register memory
    (e.g. with Mooncake) as it comes and goes.
    """

    def __init__(
        self,
        new_region: Callable[[int, bool], MemoryRegion],
        capacity_bytes: int,
        max_bytes: int,
        on_region_added: Callable[[MemoryRegion], None] | None = None,
        on_region_removed: Callable[[MemoryRegion], None] | None = None,
    ) -> None:
        self._new_region = new_region
        self._capacity = round_up(capacity_bytes)
        self._max = max(max_bytes, self._capacity)
        self._on_added = on_region_added or (lambda region: None)
        self._on_removed = on_region_removed or (lambda region: None)
        self._lock = threading.Lock()
        self._base: MemoryRegion | None = None
        self._base_extents = ExtentAllocator(self._capacity)
        self._overflow: dict[int, MemoryRegion] = {}  # id(region) -> region

    def _make_region(self, size: int, prefault: bool) -> MemoryRegion:
        # Regions outlive the thread that asks for them. An engine reserves from its compute thread, inside
        # torch.inference_mode(), where a new tensor would be an inference tensor that nothing outside that mode
        # may ever write (publish writes the handoff's marker from the event loop).
        with torch.inference_mode(False):
            return self._new_region(size, prefault)

    def _ensure_base(self) -> None:
        if self._base is None and self._capacity:
            self._base = self._make_region(self._capacity, True)
            self._on_added(self._base)

    def start(self) -> None:
        """Create and pre-fault the base region now rather than on the first allocation."""
        with self._lock:
            self._ensure_base()

    @property
    def reserved_bytes(self) -> int:
        """Bytes held by live extents."""
        with self._lock:
            return self._base_extents.used + sum(r.size for r in self._overflow.values())

    @property
    def regions(self) -> list[MemoryRegion]:
        with self._lock:
            return ([self._base] if self._base else []) + list(self._overflow.values())

    def allocate(self, nbytes: int) -> Extent:
        """An extent of at least `nbytes`; raises KVPoolExhausted beyond max_bytes."""
        with self._lock:
            self._ensure_base()
            offset = self._base_extents.allocate(nbytes)
            if offset is not None:
                return Extent(self._base, offset, round_up(nbytes))
            held = self._capacity + sum(r.size for r in self._overflow.values())
            if held + round_up(nbytes) > self._max:
                raise KVPoolExhausted(
                    f"KV export memory is full ({held} of {self._max} bytes held by unreleased "
                    f"handoffs; {nbytes} more requested): raise the pool's max_bytes or release "
                    "handoffs sooner"
                )
            # A dedicated region: touching it costs as much as one copy, so don't pre-fault it.
            region = self._make_region(round_up(nbytes), False)
            self._overflow[id(region)] = region
        self._on_added(region)
        return Extent(region, 0, region.size)

    def free(self, extent: Extent) -> None:
        """Give an extent back; an overflow region is unlinked and unmapped at once."""
        with self._lock:
            if extent.region is self._base:
                self._base_extents.free(extent.offset, extent.length)
                return
            region = self._overflow.pop(id(extent.region))
        self._on_removed(region)
        region.close()

    def close(self) -> None:
        """Release every region (live extents included)."""
        with self._lock:
            regions = ([self._base] if self._base else []) + list(self._overflow.values())
            self._base, self._overflow = None, {}
            self._base_extents = ExtentAllocator(self._capacity)
        for region in regions:
            self._on_removed(region)
            region.close()
