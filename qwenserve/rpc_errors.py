"""Errors on the wire: a gRPC status whose details carry our `ErrorDetail` (google.rpc's rich status model).

Every servicer ends a failed call with `abort(context, code, detail)`: the usual status code and message,
plus `grpc-status-details-bin` trailing metadata holding a `google.rpc.Status` whose `details` are the
`qwenserve.v1.ErrorDetail` (and a `google.rpc.RetryInfo` when the caller is told how long to wait). Any
client reads it back with `grpc_status.rpc_status.from_call(error)`; ours use `detail_of(error)`.

    await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                error_detail("invalid_argument", "top_p must be in (0, 1]", field="sampling.top_p"))
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from qwenserve.untrusted_input import MAX_FIELD_CHARS, MAX_MESSAGE_CHARS, bounded
from qwenserve.v1 import common_pb2

#: Codes that say "the same request may succeed later or elsewhere" unless the error says otherwise.
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
})

Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class WireStatus(grpc.Status):
    """A `grpc.Status` (what `abort_with_status` takes): code, message and trailing metadata."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


def error_detail(
    code: str, message: str, *, field: str = "", retryable: bool = False
) -> common_pb2.ErrorDetail:
    """Our ErrorDetail: a stable snake_case `code`, a `message` a user can act on, the request `field`
    at fault (a dotted path, or "") and whether the same request may succeed if retried.

    Message and field are bounded: they may repeat what the client sent, and gRPC carries them in trailing
    metadata, whose size is limited (a client over it sees RESOURCE_EXHAUSTED instead of this error)."""
    return common_pb2.ErrorDetail(code=code, message=bounded(message, MAX_MESSAGE_CHARS),
                                  field=bounded(field, MAX_FIELD_CHARS), retryable=retryable)


def rich_status(
    grpc_code: grpc.StatusCode,
    detail: common_pb2.ErrorDetail,
    *,
    retry_after_s: float | None = None,
    metadata: Metadata = (),
) -> WireStatus:
    """The status a call ends with: `grpc_code`, the detail's message, and the google.rpc.Status (detail,
    plus RetryInfo when `retry_after_s` is given) in `grpc-status-details-bin`, after `metadata`."""
    status = status_pb2.Status(code=grpc_code.value[0], message=detail.message)
    status.details.add().Pack(detail)
    if retry_after_s is not None:
        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromTimedelta(datetime.timedelta(seconds=max(0.0, retry_after_s)))
        status.details.add().Pack(info)
    wire = rpc_status.to_status(status)
    return WireStatus(wire.code, wire.details, (*metadata, *wire.trailing_metadata))


async def abort(
    context: grpc.aio.ServicerContext,
    grpc_code: grpc.StatusCode,
    detail: common_pb2.ErrorDetail,
    *,
    retry_after_s: float | None = None,
    metadata: Metadata = (),
) -> NoReturn:
    """End the call with `rich_status(...)`; raises, as `context.abort` does."""
    await context.abort_with_status(
        rich_status(grpc_code, detail, retry_after_s=retry_after_s, metadata=metadata)
    )
    raise AssertionError("unreachable: abort_with_status raises")


def detail_of(error: grpc.Call) -> common_pb2.ErrorDetail | None:
    """The ErrorDetail a failed call (an `AioRpcError`, a sync `RpcError`) carries; None when it has none
    (an error gRPC itself raised, a deadline, a peer that does not attach one)."""
    status = _status_of(error)
    if status is None:
        return None
    for any_detail in status.details:
        if any_detail.Is(common_pb2.ErrorDetail.DESCRIPTOR):
            detail = common_pb2.ErrorDetail()
            any_detail.Unpack(detail)
            return detail
    return None


def retry_after_of(error: grpc.Call) -> float | None:
    """Seconds the server asked the caller to wait (a RetryInfo detail), or None."""
    status = _status_of(error)
    for any_detail in status.details if status is not None else ():
        if any_detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            any_detail.Unpack(info)
            return info.retry_delay.ToTimedelta().total_seconds()
    return None


def _status_of(error: grpc.Call) -> status_pb2.Status | None:
    try:
        return rpc_status.from_call(error)
    except ValueError:  # a status proto that contradicts the call's code or message: not one to trust
        return None
