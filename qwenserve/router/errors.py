"""Errors the router raises before a stream starts; each maps once to one gRPC status and one HTTP status.

Both fronts (gRPC Generate and the OpenAI HTTP app) map every error the same way: `grpc_code`,
`http_status`, a stable `code` and the `field` at fault. `headers` are sent with the error
(HTTP headers; lower-cased as gRPC trailing metadata).
"""

from __future__ import annotations

import grpc

from qwenserve.request_limits import RequestOutOfLimits
from qwenserve.rpc_errors import RETRYABLE_CODES, error_detail
from qwenserve.v1 import common_pb2


class RouterError(Exception):
    """Base: carries the gRPC code, an HTTP status, a stable error code and the field at fault."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500
    code: str = "internal_error"
    retry_after_s: float | None = None  # how long the caller should wait before retrying, when known

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def detail(self) -> common_pb2.ErrorDetail:
        """The ErrorDetail a gRPC status carries for this error."""
        retryable = self.grpc_code in RETRYABLE_CODES
        return error_detail(self.code, self.message, field=self.field, retryable=retryable)


class InvalidRequest(RouterError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ServiceUnavailable(RouterError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    code = "service_unavailable"


class UnknownModel(InvalidRequest):
    """The request names a model this deployment does not serve (an empty name means its model).

    INVALID_ARGUMENT over gRPC; the HTTP front answers OpenAI's 404 `model_not_found`.
    """

    http_status = 404
    code = "model_not_found"


class ModelNotAllowed(RouterError):
    """The tenant's API key may not use the model it named (its `models` in the key file)."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    code = "model_not_allowed"


class AuthenticationFailed(RouterError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    code = "invalid_api_key"


class RateLimited(RouterError):
    """Over the tenant's requests or tokens per window; `headers` say when to come back."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    code = "rate_limit_exceeded"

    def __init__(
        self, message: str, headers: dict[str, str], limited_by: tuple[str, ...],
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.limited_by = limited_by
        self.retry_after_s = retry_after_s


class LimiterUnavailable(RouterError):
    """The rate limiter's backend is down and it is configured to fail closed."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    code = "rate_limiter_unavailable"


class ModelNotFound(RouterError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    code = "model_not_found"


class BodyTooLarge(InvalidRequest):
    http_status = 413
    code = "request_too_large"


class BodyReadTimeout(InvalidRequest):
    """The client did not send the whole request body in time (a stalled or trickling upload)."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 408
    code = "request_timeout"


class NotFound(RouterError):
    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 404
    code = "not_found"


class MethodNotAllowed(RouterError):
    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 405
    code = "method_not_allowed"


def out_of_limits(error: RequestOutOfLimits) -> InvalidRequest:
    """The router's error for a request the model's limits refuse (request_limits.py): a context that does not
    fit is `context_length_exceeded`, any other limit `invalid_request`; both INVALID_ARGUMENT / HTTP 400."""
    kind = ContextLengthExceeded if error.code == ContextLengthExceeded.code else InvalidRequest
    return kind(error.message, error.field)


def error_headers(error: RouterError) -> dict[str, str]:
    """Headers that travel with an error (rate-limit headers on a 429), empty for most."""
    return dict(getattr(error, "headers", {}) or {})
