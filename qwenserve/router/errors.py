"""Errors the router raises before a stream starts; each maps to one gRPC status and HTTP status."""

from __future__ import annotations

import grpc

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
