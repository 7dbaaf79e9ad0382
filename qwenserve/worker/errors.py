"""Worker-side request errors, and the one place where every error a servicer meets becomes a gRPC status.

What the router does with each code: INVALID_ARGUMENT goes back to the client; FAILED_PRECONDITION (a handoff
that cannot be used) makes it prefill again on the decode worker; RESOURCE_EXHAUSTED and UNAVAILABLE send the
request to another worker; INTERNAL is a fault of this worker on this request. Each status carries an
ErrorDetail (`qwenserve.rpc_errors`) whose `code` names the error (`context_length_exceeded`, ...).
"""

from __future__ import annotations

import logging

import grpc

from qwenserve.engine.errors import EngineShutdownError, RequestError
from qwenserve.request_limits import RequestOutOfLimits
from qwenserve.rpc_errors import RETRYABLE_CODES, error_detail
from qwenserve.v1 import common_pb2

log = logging.getLogger(__name__)


class WorkerError(Exception):
    """Base: the gRPC code, the ErrorDetail code, and the request field at fault ("" when none)."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    code: str = "internal_error"

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class BadRequest(WorkerError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    code = "invalid_argument"


class HandoffRefused(WorkerError):
    """The KV handoff cannot be used (layout, fingerprint, checksum, or it is gone)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    code = "kv_handoff_refused"


class Overloaded(WorkerError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    code = "overloaded"


class WorkerUnavailable(WorkerError):
    """This worker cannot take requests: its engine is shutting down or has died."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    code = "unavailable"


class PrefillFailed(WorkerError):
    """The prompt could not be computed or handed off here; another worker, or the decode worker itself, may."""

    grpc_code = grpc.StatusCode.INTERNAL
    code = "prefill_failed"


# A request that does not fit the context or this worker's KV cache: the router answers the client
# `context_length_exceeded` (HTTP 400) and tries no other worker.
_OUT_OF_LIMITS_CODES = {"context_length_exceeded": grpc.StatusCode.OUT_OF_RANGE}
# Engine errors a servicer meets, each as (types, gRPC code, ErrorDetail code); the first match wins.
_ENGINE_ERRORS: tuple[tuple[tuple[type[Exception], ...], grpc.StatusCode, str], ...] = (
    ((RequestError,), grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    ((EngineShutdownError,), grpc.StatusCode.UNAVAILABLE, "unavailable"),
)


def grpc_status(error: Exception) -> tuple[grpc.StatusCode, common_pb2.ErrorDetail]:
    """The status code and ErrorDetail a servicer answers `error` with. Faults nobody anticipated are
    logged with their traceback here, once, and answered INTERNAL (never a bare UNKNOWN without a reason)."""
    if isinstance(error, WorkerError):
        return error.grpc_code, _detail(error.grpc_code, error.code, str(error), error.field)
    if isinstance(error, RequestOutOfLimits):
        grpc_code = _OUT_OF_LIMITS_CODES.get(error.code, grpc.StatusCode.INVALID_ARGUMENT)
        code = error.code if error.code in _OUT_OF_LIMITS_CODES else "invalid_argument"
        return grpc_code, _detail(grpc_code, code, error.message, error.field)
    for types, grpc_code, code in _ENGINE_ERRORS:
        if isinstance(error, types):
            return grpc_code, _detail(grpc_code, code, str(error))
    log.error("request failed on an unexpected error", exc_info=error)
    message = f"internal error: {type(error).__name__}: {error}"
    return grpc.StatusCode.INTERNAL, _detail(grpc.StatusCode.INTERNAL, "internal_error", message)


def _detail(grpc_code: grpc.StatusCode, code: str, message: str, field: str = "") -> common_pb2.ErrorDetail:
    return error_detail(code, message, field=field, retryable=grpc_code in RETRYABLE_CODES)
