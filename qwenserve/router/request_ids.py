"""Request ids: which ids a client may choose, and the unique id the router uses inside.

A client's id (gRPC `GenerateRequest.request_id`, HTTP `X-Request-Id`) is echoed in every answer
and tags logs and traces, so it travels to the stages as gRPC metadata (`x-request-id`). Only
1 to 128 characters of `A-Z a-z 0-9 . _ : -` are accepted: anything else could be an invalid
metadata value (a newline, a non-ASCII letter) or a log-injection vector. gRPC refuses other ids
with INVALID_ARGUMENT; an unusable `x-request-id` header is ignored and a new id made instead.

The stages never see the client's id as the request's key: every prefill and decode call carries
`internal_id(client_id)`, the client's id plus a random suffix, so two requests in flight that
reuse one id never collide in an engine (which would refuse the second, or abort both on cancel).
"""

from __future__ import annotations

import re
import uuid

MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
REQUEST_ID_RULE = f"1 to {MAX_REQUEST_ID_CHARS} characters of A-Z a-z 0-9 . _ : -"


def valid_request_id(value: str) -> bool:
    """Whether a client may use `value` as its request id (safe as gRPC metadata and in logs)."""
    return REQUEST_ID_PATTERN.fullmatch(value) is not None


def new_request_id(prefix: str = "req") -> str:
    """A fresh id for a request that came without one."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def internal_id(client_id: str) -> str:
    """The unique id the stages know a request by: the client's id (for grepping logs) plus a suffix."""
    return f"{client_id}.{uuid.uuid4().hex[:8]}"
