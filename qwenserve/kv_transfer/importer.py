"""The decode side of a handoff: fetch and verify the KV a handle names, then release the lease.

    kv = await importer.fetch(handle, expected=my_layout)   # [L, 2, T, H, D], verified
    engine.scatter_kv(request, kv)                          # read once
    await importer.release(handle, "imported")              # the exporter frees the bytes

For shared memory, `fetch` returns a view of the exporter's pages (zero copy): it stays valid
until `release` or lease expiry, so consume it first, or pass `out=` to get a private copy.

`token` (PrefilledStart.handoff_token) is presented to the exporter with every Fetch and Release. Shared
memory and Mooncake read the exporter's memory directly, where no exporter code runs to check it: there the
segment's owner-only mode, and Mooncake's network, guard the bytes; Release is still checked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar

import grpc
import torch

from qwenserve.addresses import endpoint_host, is_wildcard_host
from qwenserve.cpu_kernels import loader
from qwenserve.cpu_kernels.library import CpuKernels
from qwenserve.kv_layout import KVLayout, KVLayoutMismatch, LinearState
from qwenserve.kv_transfer.checksum import (
    KVSUM,
    NO_CHECKSUM,
    STEP_BYTES,
    check_checksum,
    fused_copy,
    hashes_at_memory_speed,
    kvsum_steps,
    verify_checksum,
)
from qwenserve.kv_transfer.errors import (
    KVEndpointUnreachable,
    KVHandleInvalid,
    KVHandoffGone,
    KVHandoffRefused,
    KVTransportUnavailable,
)
from qwenserve.kv_transfer.grpc_transport import (
    CHANNEL_OPTIONS,
    DEFAULT_CHUNK_BYTES,
    fetch_over_grpc,
    release_over_grpc,
)
from qwenserve.kv_transfer.handle import (
    MARKER_BYTES,
    MARKER_PAGE,
    KVHandle,
    KVTransport,
    describe,
    handoff_marker,
    lease_remaining_s,
)
from qwenserve.kv_transfer.mooncake_transport import MooncakeEndpoint
from qwenserve.kv_transfer.shm import SHM_DIR, map_segment
from qwenserve.protocol import kv_layout_from_proto

log = logging.getLogger(__name__)
T = TypeVar("T")

#: "host:port" or "[ipv6]:port": the only addresses a handle may make this importer connect to (no "unix:",
#: no other URI schemes, nothing that needs escaping).
ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}")
ALL_TRANSPORTS = frozenset({KVTransport.KV_TRANSPORT_SHM, KVTransport.KV_TRANSPORT_GRPC, KVTransport.KV_TRANSPORT_MOONCAKE})

@dataclass
class ImporterConfig:
    """Settings of a KVImporter."""

    #: Refuse handles published without a checksum ("none:"); disable only for benchmarks.
    require_checksum: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    fetch_timeout_s: float = 60.0
    release_timeout_s: float = 2.0
    #: Release attempts before giving up and leaving the bytes to lease expiry.
    release_attempts: int = 3
    #: kvsum handoffs are hashed on the event loop this many bytes at a time, other callbacks running between
    #: steps (each a fraction of a millisecond at memory speed): a hop to a worker thread and back would cost two
    #: thread wake-ups, and the worker's OpenMP team a third (handoff_bench.py measures both).
    hash_step_bytes: int = STEP_BYTES
    #: Shared-memory segments kept mapped between fetches.
    max_mapped_segments: int = 16
    mooncake_host: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"
    #: Transports this importer fetches over. A handle naming another one is refused before anything is opened:
    #: a handle must not make a worker start a Mooncake endpoint its deployment never asked for.
    transports: frozenset[int] = ALL_TRANSPORTS
    #: gRPC channels to exporters kept open; beyond this the least recently used one is closed.
    max_channels: int = 64


class KVImporter:
    """Fetches handoffs over whichever transport their handle names; one per decode process."""

    def __init__(self, config: ImporterConfig | None = None,
                 kernels: CpuKernels | None | Literal["process"] = "process") -> None:
        """`kernels`: the C kernels that hash and copy what arrives (None: NumPy's forms, the same digests;
        "process": the process's, cpu_kernels/loader.py)."""
        self.config = config or ImporterConfig()
        self.kernels = loader.load() if kernels == "process" else kernels
        self._segments: OrderedDict[str, torch.Tensor] = OrderedDict()
        # Algorithms without the C kernel hash far slower than memory: off the event loop, on threads of our own.
        self._hashers = ThreadPoolExecutor(2, thread_name_prefix="kv-verify")
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()  # channels evicted from the cache, closing
        self._mooncake: MooncakeEndpoint | None = None

    async def fetch(
        self,
        handle: KVHandle,
        expected: KVLayout,
        *,
        out: torch.Tensor | None = None,
        token: str = "",
    ) -> torch.Tensor:
        """The handoff's KV as an [L, 2, T, H, D] tensor, after checking layout and checksum: for a model without
        linear-attention layers (a hybrid model's handoff needs fetch_payload, which returns its state too).

        Raises KVLayoutMismatch (layout or model differs), KVChecksumMismatch (bytes corrupted),
        KVHandoffGone (released, expired, exporter gone), KVHandleInvalid (a transport or address this importer
        will not use) or KVTransportUnavailable.
        With `out` (a contiguous CPU tensor of the right shape and dtype) the bytes land there. `token`: the
        one the handoff is bound to (KVHandoffRefused when the exporter says it is not).
        """
        kv, _ = await self.fetch_payload(handle, expected, out=out, token=token)
        return kv

    async def fetch_payload(
        self,
        handle: KVHandle,
        expected: KVLayout,
        *,
        out: torch.Tensor | None = None,
        token: str = "",
    ) -> tuple[torch.Tensor, LinearState | None]:
        """The handoff's KV [L, 2, T, H, D] and, for a hybrid model, the linear-attention state after those tokens,
        checked as `fetch` says. `out`: as for fetch; for a hybrid model, a uint8 buffer of the handoff's length."""
        self._check_addresses(handle)
        layout = self._check_layout(handle, expected)
        shape, dtype = layout.token_shape(handle.num_tokens), layout.torch_dtype()
        if layout.has_linear_state:
            shape, dtype = (handle.length,), torch.uint8
        if out is not None and (
            tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu"
        ):
            raise ValueError(
                f"out must be a contiguous CPU tensor of shape {shape} and dtype {dtype}, "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if lease_remaining_s(handle) <= 0:
            raise KVHandoffGone(f"{describe(handle)}: its lease expired before the fetch")
        if handle.transport == KVTransport.KV_TRANSPORT_SHM:
            data = await self._fetch_shm(handle, out)
        elif handle.transport == KVTransport.KV_TRANSPORT_GRPC:
            data = await self._fetch_grpc(handle, out, token)
        elif handle.transport == KVTransport.KV_TRANSPORT_MOONCAKE:
            data = await self._fetch_mooncake(handle, out)
        else:
            raise KVTransportUnavailable(
                f"{describe(handle)}: this importer cannot read transport {handle.transport}"
            )
        return layout.split(data, handle.num_tokens)

    async def release(self, handle: KVHandle, reason: str = "imported", *, token: str = "") -> bool:
        """Tell the exporter it may free the bytes, presenting `token`. Idempotent; never raises for transport
        trouble or a refusal.

        Returns True when the exporter still held the handoff. When the exporter cannot be reached
        after a few attempts, or refuses the token, this returns False and the lease's expiry frees the bytes.
        """
        released = False
        if handle.control_endpoint and not ENDPOINT.fullmatch(handle.control_endpoint):
            log.warning("not releasing %s: its control endpoint is not host:port", describe(handle))
        elif handle.control_endpoint:
            channel = self._channel(handle.control_endpoint)
            for attempt in range(self.config.release_attempts):
                try:
                    released = await release_over_grpc(
                        channel, handle.handoff_id, reason,
                        endpoint=handle.control_endpoint, timeout_s=self.config.release_timeout_s, token=token,
                    )
                    break
                except KVHandoffRefused as e:
                    log.warning("%s; its lease will free it instead", e)
                    break
                except KVTransportUnavailable as e:
                    if attempt + 1 == self.config.release_attempts:
                        log.warning("%s; its lease will free it instead", e)
                    else:
                        await asyncio.sleep(0.05 * 2**attempt)
        self._forget_unlinked_segments()
        return released

    async def close(self) -> None:
        """Close channels and the Mooncake endpoint, drop mappings (tensors already returned stay valid)."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await asyncio.gather(*self._closing)
        self._segments.clear()
        self._hashers.shutdown(wait=False)
        if self._mooncake is not None:
            self._mooncake.close()
            self._mooncake = None

    # --- checks ----------------------------------------------------------------------------

    def _check_addresses(self, handle: KVHandle) -> None:
        if handle.transport not in self.config.transports:
            allowed = ", ".join(sorted(KVTransport.Name(t) for t in self.config.transports))
            raise KVHandleInvalid(f"{describe(handle)}: this importer fetches only over {allowed}")
        network = handle.transport in (KVTransport.KV_TRANSPORT_GRPC, KVTransport.KV_TRANSPORT_MOONCAKE)
        for what, address in (("location", handle.location if network else ""),
                              ("control_endpoint", handle.control_endpoint)):
            if address and not ENDPOINT.fullmatch(address):
                raise KVHandleInvalid(f"handoff {handle.handoff_id[:64]!r}: {what} {address[:64]!r} is not host:port")
            if address and is_wildcard_host(endpoint_host(address)):
                raise KVEndpointUnreachable(
                    f"{describe(handle)}: its {what} {address} is a wildcard address, which names no host to dial; "
                    "the prefill worker must advertise an address decode workers reach (--advertise-host)")

    @staticmethod
    def _check_layout(handle: KVHandle, expected: KVLayout) -> KVLayout:
        try:
            actual = kv_layout_from_proto(handle.layout)
        except ValueError as e:
            raise KVLayoutMismatch(f"{describe(handle)} carries an invalid layout: {e}") from e
        expected.check_accepts(actual, describe(handle))
        if handle.num_tokens < 1 or handle.length != actual.nbytes(handle.num_tokens):
            raise KVLayoutMismatch(
                f"{describe(handle)}: {handle.length} bytes cannot hold {handle.num_tokens} tokens of this "
                f"layout ({actual.nbytes(max(handle.num_tokens, 0))} bytes)"
            )
        return actual

    async def _verify(self, handle: KVHandle, data: torch.Tensor) -> None:
        algorithm = handle.checksum.partition(":")[0]
        if self._stepwise(algorithm):
            try:
                check_checksum(await self._run_steps(kvsum_steps(data, step_bytes=self.config.hash_step_bytes,
                                                                 kernels=self.kernels)),
                               handle.checksum)
            finally:
                self._release_workers()
            return
        verify = functools.partial(verify_checksum, data, handle.checksum,
                                   allow_none=not self.config.require_checksum, kernels=self.kernels)
        if algorithm == NO_CHECKSUM:
            verify()  # nothing to hash
        else:
            await asyncio.get_running_loop().run_in_executor(self._hashers, self._then_release(verify))

    async def _copy_verified(self, handle: KVHandle, target: torch.Tensor, data: torch.Tensor) -> None:
        """Copy `data` into `target`, hashing each chunk as it lands (the shared bytes are read once)."""
        algorithm = handle.checksum.partition(":")[0]
        if self._stepwise(algorithm):
            try:
                actual = await self._run_steps(kvsum_steps(target, data, self.config.hash_step_bytes,
                                                           kernels=self.kernels))
            finally:
                self._release_workers()
        else:
            actual = await asyncio.get_running_loop().run_in_executor(
                self._hashers,
                self._then_release(functools.partial(fused_copy, target, data, algorithm, kernels=self.kernels)))
        check_checksum(actual, handle.checksum)

    def _release_workers(self) -> None:
        """Hand back the calling thread's OpenMP workers (hashing and copying start them): while any thread but the
        engine's holds a pool, the process has more OpenMP threads than cores and libgomp sleeps at the end of
        every parallel region instead of spinning. A W4A16 decode stream on a 2-core Xeon after one handoff: ITL
        p50 32 ms, its two threads blocking 4,000-5,000 times a second, against 24 ms in a unified engine."""
        if self.kernels is not None:
            self.kernels.release_thread_pool()

    def _then_release(self, work: Callable[[], T]) -> Callable[[], T]:
        def run() -> T:
            try:
                return work()
            finally:
                self._release_workers()

        return run

    def _stepwise(self, algorithm: str) -> bool:
        return algorithm == KVSUM and hashes_at_memory_speed(algorithm, self.kernels)

    @staticmethod
    async def _run_steps(steps: Generator[None, None, T]) -> T:
        """Drive a generator to its result, letting the event loop run between its steps."""
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            await asyncio.sleep(0)

    @staticmethod
    def _check_marker(handle: KVHandle, marker: torch.Tensor) -> None:
        if bytes(marker.numpy()) != handoff_marker(handle.handoff_id, handle.length):
            raise KVHandoffGone(
                f"{describe(handle)}: the exporter freed these bytes (released or lease expired)"
            )

    # --- transports ------------------------------------------------------------------------

    async def _fetch_shm(self, handle: KVHandle, out: torch.Tensor | None) -> torch.Tensor:
        segment = self._segment(handle.location)
        start, end = handle.offset, handle.offset + handle.length
        if start < MARKER_PAGE or end > segment.numel():
            raise KVHandoffGone(
                f"{describe(handle)}: bytes [{start}, {end}) are outside segment {handle.location} "
                f"({segment.numel()} bytes)"
            )
        marker = segment[start - MARKER_PAGE : start - MARKER_PAGE + MARKER_BYTES]
        self._check_marker(handle, marker)
        data = segment[start:end]
        algorithm = handle.checksum.partition(":")[0]
        if out is not None and algorithm == KVSUM:
            # Hash each chunk as it lands in `out`: the shared bytes are read once.
            target = out.view(-1).view(torch.uint8)
            await self._copy_verified(handle, target, data)
            data = target
        else:
            if out is not None:
                data = out.view(-1).view(torch.uint8).copy_(data)
            await self._verify(handle, data)
        # Checked again after reading: had the exporter reused the bytes meanwhile, the checksum
        # might still have matched stale data by chance; this says why it failed plainly.
        self._check_marker(handle, marker)
        return data

    def _segment(self, name: str) -> torch.Tensor:
        segment = self._segments.get(name)
        if segment is None:
            segment = map_segment(name)
            self._segments[name] = segment
            while len(self._segments) > self.config.max_mapped_segments:
                # Dropping our reference is enough: tensors handed out keep their mapping alive.
                self._segments.popitem(last=False)
        self._segments.move_to_end(name)
        return segment

    def _forget_unlinked_segments(self) -> None:
        # An exporter's overflow segments are one-shot; don't keep their pages alive here.
        for name in [n for n in self._segments if not os.path.exists(SHM_DIR / n)]:
            del self._segments[name]

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = self._channels[endpoint] = self._new_channel(endpoint)
            while len(self._channels) > self.config.max_channels:
                # Handles come from the network: each new endpoint must not hold a channel forever.
                _, old = self._channels.popitem(last=False)
                task = asyncio.ensure_future(old.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        self._channels.move_to_end(endpoint)
        return channel

    def _new_channel(self, endpoint: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)

    async def _fetch_grpc(self, handle: KVHandle, out: torch.Tensor | None, token: str) -> torch.Tensor:
        data = torch.empty(handle.length, dtype=torch.uint8) if out is None else out.view(-1).view(torch.uint8)
        await fetch_over_grpc(
            self._channel(handle.location), handle.handoff_id, memoryview(data.numpy()),
            endpoint=handle.location, chunk_bytes=self.config.chunk_bytes,
            timeout_s=self.config.fetch_timeout_s, token=token,
        )
        await self._verify(handle, data)
        return data

    async def _fetch_mooncake(self, handle: KVHandle, out: torch.Tensor | None) -> torch.Tensor:
        if self._mooncake is None:
            self._mooncake = await asyncio.to_thread(
                MooncakeEndpoint, self.config.mooncake_host, self.config.mooncake_protocol
            )
        marker_address = handle.offset - int(handle.attributes.get("mooncake_marker_offset", MARKER_PAGE))
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)
        data = torch.empty(handle.length, dtype=torch.uint8) if out is None else out.view(-1).view(torch.uint8)
        await asyncio.to_thread(self._mooncake.read, handle.location, marker_address, marker)
        self._check_marker(handle, marker)
        await asyncio.to_thread(self._mooncake.read, handle.location, handle.offset, data)
        await self._verify(handle, data)
        await asyncio.to_thread(self._mooncake.read, handle.location, marker_address, marker)
        self._check_marker(handle, marker)
        return data
