"""Worker-side request errors; the servicers map each to one gRPC status code."""

from __future__ import annotations

import grpc


class WorkerError(Exception):
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class BadRequest(WorkerError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class HandoffRefused(WorkerError):
    """The KV handoff cannot be used (layout, fingerprint, checksum, or it is gone)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(WorkerError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
