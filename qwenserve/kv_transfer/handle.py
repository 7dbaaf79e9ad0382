"""The handle that names a handoff, and the marker that proves its bytes are still live.

Every handoff's bytes are preceded by one page whose first bytes are a marker derived from the
handoff id and length. The exporter writes it on publish and wipes it when it frees the bytes,
so an importer reading memory directly (shm, Mooncake) can tell "still mine" from "reused by a
later handoff" by checking the marker before and after it reads.
"""

from __future__ import annotations

import hashlib
import struct
import time

from qwenserve.kv_transfer.pool import PAGE
from qwenserve.v1 import common_pb2

KVHandle = common_pb2.KVHandle
KVTransport = common_pb2.KVTransport

#: Bytes before a handoff's data that hold its marker.
MARKER_PAGE = PAGE
_MAGIC = b"QWKVLIVE"
MARKER_BYTES = len(_MAGIC) + 16 + 8


def handoff_marker(handoff_id: str, length: int) -> bytes:
    """The marker the exporter writes in front of a live handoff's bytes."""
    digest = hashlib.blake2b(handoff_id.encode(), digest_size=16).digest()
    return _MAGIC + digest + struct.pack("<Q", length)


def lease_remaining_s(handle: KVHandle, now_unix_s: float | None = None) -> float:
    """Seconds until the exporter frees the handle's bytes (negative once expired)."""
    now = time.time() if now_unix_s is None else now_unix_s
    return handle.lease_expires_unix_ms / 1000.0 - now


def describe(handle: KVHandle) -> str:
    """One line for logs and error messages."""
    return (
        f"handoff {handle.handoff_id} ({KVTransport.Name(handle.transport)}, {handle.length} bytes, "
        f"{handle.num_tokens} tokens at {handle.location or '?'})"
    )
