"""KV handoff from prefill to decode: shared memory on one host, gRPC or Mooncake across hosts.

The exporter (prefill) reserves memory, the engine writes the prompt's KV into it, and a
published KVHandle leases the bytes; the importer (decode) fetches and verifies them, then
releases the lease. See exporter.py and importer.py for the flow.
"""

from qwenserve.kv_layout import KVLayout, KVLayoutMismatch
from qwenserve.kv_transfer.checksum import compute_checksum, verify_checksum
from qwenserve.kv_transfer.errors import (
    KVChecksumMismatch,
    KVEndpointUnreachable,
    KVHandleInvalid,
    KVHandoffExists,
    KVHandoffGone,
    KVHandoffRefused,
    KVLayoutInvalid,
    KVPoolExhausted,
    KVTransferError,
    KVTransportUnavailable,
)
from qwenserve.kv_transfer.exporter import ExportCounters, ExporterConfig, ExportSlot, KVExporter
from qwenserve.kv_transfer.grpc_transport import KVTransferServicer, add_kv_transfer_service
from qwenserve.kv_transfer.handle import KVHandle, KVTransport, describe, lease_remaining_s
from qwenserve.kv_transfer.importer import ImporterConfig, KVImporter
from qwenserve.kv_transfer.mooncake_transport import mooncake_unavailable_reason
from qwenserve.kv_transfer.shm import leaked_segments, reap_orphaned_segments

__all__ = [
    "ExportCounters",
    "ExportSlot",
    "ExporterConfig",
    "ImporterConfig",
    "KVChecksumMismatch",
    "KVEndpointUnreachable",
    "KVExporter",
    "KVHandle",
    "KVHandleInvalid",
    "KVHandoffExists",
    "KVHandoffGone",
    "KVHandoffRefused",
    "KVImporter",
    "KVLayout",
    "KVLayoutInvalid",
    "KVLayoutMismatch",
    "KVPoolExhausted",
    "KVTransferError",
    "KVTransferServicer",
    "KVTransport",
    "KVTransportUnavailable",
    "add_kv_transfer_service",
    "compute_checksum",
    "describe",
    "lease_remaining_s",
    "leaked_segments",
    "mooncake_unavailable_reason",
    "reap_orphaned_segments",
    "verify_checksum",
]
