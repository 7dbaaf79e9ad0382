"""OpenAI's error object: router errors and failed generations as the HTTP status and body OpenAI clients
expect (`{"error": {"message", "type", "param", "code"}}`), with Retry-After where a retry helps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from qwenserve.router.errors import (
    BodyReadTimeout,
    BodyTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    RouterError,
    error_headers,
)
from qwenserve.untrusted_input import MAX_FIELD_CHARS, MAX_MESSAGE_CHARS, bounded

log = logging.getLogger(__name__)

ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
# Terminal error codes of a generation (ErrorDetail.code) that mean "try again", for the HTTP status.
RETRYABLE_CODES = {"unavailable", "no_decode_worker", "cold_start_timeout", "resource_exhausted", "deadline_exceeded"}
# Terminal error codes that mean the request itself cannot be served (a worker's own checks refused it).
CLIENT_FAULT_CODES = {"context_length_exceeded", "invalid_argument"}
# The app's body limit, named in the 413 of a larger body.
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """Every error becomes OpenAI's error shape with the status its type maps to."""
    try:
        return await handler(request)
    except BodyReadTimeout as e:
        return await answer_and_close(request, error_response(e))
    except RouterError as e:
        return error_response(e)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_KEY]
        return error_response(BodyTooLarge(f"the request body is larger than the limit of {limit} bytes", "body"))
    except web.HTTPNotFound:
        return error_response(NotFound(f"no route {request.method} {request.path}; see /v1/models"))
    except web.HTTPMethodNotAllowed as e:
        return error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.path}; "
                                               f"use {', '.join(sorted(e.allowed_methods))}"))
    except web.HTTPException as e:
        return error_json(e.status, e.reason, "http_error", None)
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_json(500, "internal server error; the request id is in the logs", "internal_error", None)


async def answer_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Send `response`, then close the connection: the rest of a stalled body is not waited for
    (aiohttp would otherwise linger reading it before closing)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None:
        request.transport.close()
    return response


def error_response(error: RouterError, param: str | None = None) -> web.Response:
    """OpenAI's error body for a RouterError, with its status and headers (Retry-After on a 429)."""
    field_name = param if param is not None else (error.field or None)
    limited_by = getattr(error, "limited_by", None)
    # OpenAI's 429 names the limit as its type: "requests" or "tokens".
    kind = limited_by[0] if limited_by else None
    response = error_json(error.http_status, error.message, error.code, field_name, kind)
    response.headers.update(error_headers(error))
    return response


def error_json(status: int, message: str, code: str, param: str | None, kind: str | None = None) -> web.Response:
    """OpenAI's error body; its message and param bounded, as they may repeat what the client sent."""
    if param is not None:
        param = bounded(param, MAX_FIELD_CHARS)
    body = {"error": {"message": bounded(message, MAX_MESSAGE_CHARS), "type": kind or error_type(status),
                      "param": param, "code": code}}
    return web.json_response(body, status=status)


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def retry_after(status: int, error: dict[str, Any]) -> dict[str, str]:
    """A 503's Retry-After: longer while a stage scaled to zero is still starting."""
    if status != 503:
        return {}
    return {"Retry-After": "10" if error.get("code") == "cold_start_timeout" else "2"}


def with_openai_param(error: InvalidRequest, kind: str) -> InvalidRequest:
    """The router names fields as in the proto ("sampling.top_p"); OpenAI clients expect "top_p"."""
    name = error.field.removeprefix("sampling.")
    if name == "input":
        name = "messages" if kind == "chat" else "prompt"
    error.field = name
    return error
