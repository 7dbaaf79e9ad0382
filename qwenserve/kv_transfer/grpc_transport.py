"""The KVTransfer gRPC service (exporter side) and its client calls (importer side).

Every exporter serves Release; Fetch streams a handoff's bytes for importers on other hosts. A bound handoff
(binding.py) is fetched or released only with its token: any other call is PERMISSION_DENIED, counted in
`qwenserve_handoff_refusals_total`, and leaves the handoff as it was. Add the servicer to the prefill
process's grpc.aio server:

    add_kv_transfer_service(server, exporter)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from qwenserve.kv_transfer.errors import (
    KVChecksumMismatch,
    KVEndpointUnreachable,
    KVHandoffGone,
    KVHandoffRefused,
    KVTransportUnavailable,
)
from qwenserve.kv_transfer.exporter import KVExporter
from qwenserve.rpc_errors import abort, error_detail
from qwenserve.telemetry.metrics import HandoffMetrics, handoff_metrics
from qwenserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 4 * MiB
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 32 * MiB
#: Channel options an importer needs to receive the largest chunks.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + MiB),
    ("grpc.max_send_message_length", MAX_CHUNK_BYTES + MiB),
    # An exporter back from a restart is reachable again within a second: gRPC's own backoff grows towards two
    # minutes while it is down, and every Fetch and Release on the channel fails at once until the next attempt.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    """Serves an exporter's handoffs: Fetch streams bytes, Release frees them."""

    def __init__(self, exporter: KVExporter, default_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 metrics: HandoffMetrics | None = None) -> None:
        """`metrics`: where refusals are counted (default: the process's handoff metrics)."""
        self._exporter = exporter
        self._default_chunk = default_chunk_bytes
        self._metrics = metrics or handoff_metrics()

    async def Fetch(  # noqa: N802 (the RPC's name)
        self, request: kv_transfer_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_transfer_pb2.KVChunk]:
        chunk = min(max(request.chunk_bytes or self._default_chunk, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
        try:
            # The pin holds the bytes even if the lease expires mid-stream; a cancelled stream
            # closes this generator, which unpins.
            with self._exporter.pinned(request.handoff_id, token=request.handoff_token) as view:
                for offset in range(0, len(view), chunk):
                    yield kv_transfer_pb2.KVChunk(offset=offset, data=bytes(view[offset : offset + chunk]))
        except KVHandoffGone as e:
            await abort(context, grpc.StatusCode.NOT_FOUND, error_detail("kv_handoff_gone", str(e)))
        except KVHandoffRefused as e:
            await self._refuse(context, "Fetch", e)

    async def Release(  # noqa: N802 (the RPC's name)
        self, request: kv_transfer_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.ReleaseResponse:
        reason = request.reason or "unspecified"
        try:
            if not request.handoff_id and request.handoff_token and reason == "cancelled":
                released = self._exporter.cancel(request.handoff_token) > 0
            else:
                released = self._exporter.release(request.handoff_id, reason, token=request.handoff_token)
        except KVHandoffRefused as e:
            await self._refuse(context, "Release", e)
        return kv_transfer_pb2.ReleaseResponse(released=released)

    async def _refuse(self, context: grpc.aio.ServicerContext, rpc: str, error: KVHandoffRefused) -> None:
        self._metrics.record_refusal(rpc, error.reason)
        log.warning("KVTransfer %s refused: %s", rpc, error)
        await abort(context, grpc.StatusCode.PERMISSION_DENIED, error_detail(error.code, str(error)))


def add_kv_transfer_service(server: grpc.aio.Server, exporter: KVExporter,
                            metrics: HandoffMetrics | None = None) -> KVTransferServicer:
    """Register the KVTransfer service for `exporter` on a grpc.aio server (before it starts)."""
    servicer = KVTransferServicer(exporter, metrics=metrics)
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
    return servicer


def _as_transfer_error(error: grpc.aio.AioRpcError, handoff_id: str, endpoint: str) -> Exception:
    if error.code() == grpc.StatusCode.NOT_FOUND:
        return KVHandoffGone(f"exporter at {endpoint} no longer has handoff {handoff_id}: {error.details()}")
    if error.code() == grpc.StatusCode.PERMISSION_DENIED:
        return KVHandoffRefused(f"exporter at {endpoint} refused handoff {handoff_id}: {error.details()}", "refused")
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        return KVEndpointUnreachable(
            f"cannot reach the exporter at {endpoint} for handoff {handoff_id} ({error.details()}); is that "
            "address one this worker can dial (prefill's --advertise-host)?")
    return KVTransportUnavailable(
        f"KVTransfer at {endpoint} failed for handoff {handoff_id}: {error.code().name} {error.details()}"
    )


async def fetch_over_grpc(
    channel: grpc.aio.Channel,
    handoff_id: str,
    into: memoryview,
    *,
    endpoint: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    timeout_s: float | None = None,
    token: str = "",
) -> None:
    """Stream a handoff's bytes into `into` (a writable byte view of exactly its length), presenting `token`."""
    stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
    request = kv_transfer_pb2.FetchRequest(handoff_id=handoff_id, chunk_bytes=chunk_bytes, handoff_token=token)
    received = 0
    try:
        async for chunk in stub.Fetch(request, timeout=timeout_s):
            end = chunk.offset + len(chunk.data)
            if chunk.offset != received or end > len(into):
                raise KVChecksumMismatch(
                    f"exporter at {endpoint} sent bytes [{chunk.offset}, {end}) of handoff {handoff_id} "
                    f"out of order (expected offset {received} of {len(into)})"
                )
            into[chunk.offset : end] = chunk.data
            received = end
    except grpc.aio.AioRpcError as e:
        raise _as_transfer_error(e, handoff_id, endpoint) from e
    if received != len(into):
        raise KVChecksumMismatch(
            f"exporter at {endpoint} sent {received} of {len(into)} bytes of handoff {handoff_id}"
        )


async def release_over_grpc(
    channel: grpc.aio.Channel, handoff_id: str, reason: str, *, endpoint: str = "", timeout_s: float = 5.0,
    token: str = "",
) -> bool:
    """Ask the exporter to free a handoff, presenting `token`; True when it was still held."""
    stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
    try:
        response = await stub.Release(
            kv_transfer_pb2.ReleaseRequest(handoff_id=handoff_id, reason=reason, handoff_token=token),
            timeout=timeout_s,
        )
    except grpc.aio.AioRpcError as e:
        raise _as_transfer_error(e, handoff_id, endpoint) from e
    return response.released
