"""Worker-side request errors, and the one place where every error a servicer meets becomes a gRPC status.

What the router does with each code: INVALID_ARGUMENT goes back to the client; FAILED_PRECONDITION (a handoff
that cannot be used) makes it prefill again on the decode worker; RESOURCE_EXHAUSTED and UNAVAILABLE send the
request to another worker; INTERNAL is a fault of this worker on this request.
"""

from __future__ import annotations

import logging

import grpc

from qwenserve.engine.errors import (
    ContextLengthExceededError,
    EngineShutdownError,
    RequestError,
    RequestTooLargeError,
)

log = logging.getLogger(__name__)


class WorkerError(Exception):
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class BadRequest(WorkerError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class ContextTooLong(BadRequest):
    """Prompt plus output budget do not fit in the context or in this worker's KV cache; the router
    answers the client `context_length_exceeded` (HTTP 400)."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE


class HandoffRefused(WorkerError):
    """The KV handoff cannot be used (layout, fingerprint, checksum, or it is gone)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(WorkerError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class WorkerUnavailable(WorkerError):
    """This worker cannot take requests: its engine is shutting down or has died."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class PrefillFailed(WorkerError):
    """The prompt could not be computed or handed off here; another worker, or the decode worker itself, may."""

    grpc_code = grpc.StatusCode.INTERNAL


def grpc_status(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a servicer answers `error` with. Faults nobody anticipated are logged
    with their traceback here, once, and answered INTERNAL (never a bare UNKNOWN without a reason)."""
    if isinstance(error, WorkerError):
        return error.grpc_code, str(error)
    if isinstance(error, ContextLengthExceededError | RequestTooLargeError):
        return grpc.StatusCode.OUT_OF_RANGE, str(error)
    if isinstance(error, RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, EngineShutdownError):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    log.error("request failed on an unexpected error", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
