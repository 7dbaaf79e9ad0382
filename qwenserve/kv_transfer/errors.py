"""Errors of the KV handoff, each with a stable code for ErrorDetail and a retry hint.

Services map these once at their edge: a handoff that cannot be used is FAILED_PRECONDITION (never decode
garbage), a gone handoff or an unreachable exporter is retryable by prefilling again. A layout that does not
match is `qwenserve.kv_layout.KVLayoutMismatch`, shared with the engine.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base of every KV handoff error."""

    #: Stable snake_case code, as carried in `qwenserve.v1.ErrorDetail.code`.
    code: str = "kv_transfer_error"
    #: True when the same request may succeed on another worker or after a fresh prefill.
    retryable: bool = False


class KVLayoutInvalid(KVTransferError, ValueError):
    """KV that does not fit the slot it is written into, or a handoff of no tokens: the exporter's caller erred."""

    code = "kv_layout_invalid"


class KVChecksumMismatch(KVTransferError):
    """The bytes that arrived are not the bytes the exporter published."""

    code = "kv_checksum_mismatch"
    retryable = True


class KVHandoffGone(KVTransferError):
    """The handoff is unknown to its exporter: released, lease expired, or the exporter died."""

    code = "kv_handoff_gone"
    retryable = True


class KVHandleInvalid(KVTransferError):
    """A handle names a transport or an address this importer will not use (malformed, or not allowed here)."""

    code = "kv_handle_invalid"


class KVHandoffRefused(KVTransferError):
    """A Fetch or Release did not present the token the handoff is bound to; the handoff stays held for the
    importer that has it (or until its lease expires)."""

    code = "kv_handoff_refused"

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        #: "missing" (no token presented) or "wrong" (another one), for the refusal counter.
        self.reason = reason


class KVHandoffExists(KVTransferError):
    """A handoff id was reserved twice on the same exporter."""

    code = "kv_handoff_exists"


class KVPoolExhausted(KVTransferError):
    """The exporter has no room for another handoff until leases are released or expire."""

    code = "kv_pool_exhausted"
    retryable = True


class KVTransportUnavailable(KVTransferError):
    """The transport cannot be used: its library is missing or the exporter is unreachable."""

    code = "kv_transport_unavailable"
    retryable = True


class KVEndpointUnreachable(KVTransportUnavailable):
    """The address a handle names cannot be dialled from here: a wildcard (0.0.0.0, ::), or nothing answers there.
    Usually the prefill worker advertises the wrong address (its --advertise-host)."""
