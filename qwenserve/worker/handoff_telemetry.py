"""Handoff observability from the worker side: transport labels, failure reasons, a traced importer.

The kv_transfer library stays free of metrics and tracing; the workers that use it record what
happened (bytes, duration, failure reason by transport) and give the importer's control channels
the tracing interceptors, so a network fetch and the release show up in the request's trace.
"""

from __future__ import annotations

import grpc

from qwenserve.kv_layout import KVLayoutMismatch
from qwenserve.kv_transfer.errors import (
    KVChecksumMismatch,
    KVEndpointUnreachable,
    KVHandleInvalid,
    KVHandoffGone,
    KVHandoffRefused,
    KVPoolExhausted,
    KVTransportUnavailable,
)
from qwenserve.kv_transfer.grpc_transport import CHANNEL_OPTIONS
from qwenserve.kv_transfer.importer import ImporterConfig, KVImporter
from qwenserve.stage_auth import credential_interceptors
from qwenserve.stage_secret import StageSecret
from qwenserve.telemetry.tracing import client_interceptors
from qwenserve.v1 import common_pb2

_TRANSPORTS = {
    common_pb2.KV_TRANSPORT_SHM: "shm",
    common_pb2.KV_TRANSPORT_GRPC: "grpc",
    common_pb2.KV_TRANSPORT_MOONCAKE: "mooncake",
}


def transport_label(transport: int) -> str:
    """The metric / span label of a KVTransport enum value ("shm", "grpc", "mooncake", "other")."""
    return _TRANSPORTS.get(transport, "other")


def failure_reason(error: BaseException) -> str:
    """The `reason` label of a failed handoff, from the error that ended it."""
    if isinstance(error, KVChecksumMismatch):
        return "checksum"
    if isinstance(error, KVHandoffRefused):
        return "refused"
    if isinstance(error, KVHandoffGone):
        return "lease_expired"
    if isinstance(error, KVEndpointUnreachable):
        return "unreachable"
    if isinstance(error, KVTransportUnavailable):
        return "connection"
    if isinstance(error, (KVLayoutMismatch, KVHandleInvalid)):
        return "protocol"
    if isinstance(error, KVPoolExhausted):
        return "no_space"
    return "other"


class TracedKVImporter(KVImporter):
    """A KVImporter whose gRPC channels (Fetch, Release) carry trace context and the request id, and the
    deployment's stage credential when it has one (the exporter's KVTransfer asks for it)."""

    def __init__(self, config: ImporterConfig | None = None, *, stage_secret: StageSecret | None = None) -> None:
        super().__init__(config)
        self._credential = credential_interceptors(stage_secret)

    def _new_channel(self, endpoint: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS,
                                         interceptors=[*self._credential, *client_interceptors()])
