"""Errors of the router's front door (auth, rate limits, HTTP bodies), each mapped once to gRPC and HTTP.

They extend `RouterError` so that both fronts map every error the same way: `grpc_code`,
`http_status`, a stable `code` and the `field` at fault. `headers` are sent with the error
(HTTP headers; lower-cased as gRPC trailing metadata).
"""

from __future__ import annotations

import grpc

from qwenserve.router.errors import InvalidRequest, RouterError


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


def error_headers(error: RouterError) -> dict[str, str]:
    """Headers that travel with an error (rate-limit headers on a 429), empty for most."""
    return dict(getattr(error, "headers", {}) or {})
