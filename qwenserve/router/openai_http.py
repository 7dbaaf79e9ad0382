"""The OpenAI-compatible HTTP front of the router: /v1/chat/completions, /v1/completions, /v1/models.

One request: authenticate (401 before any work) -> parse and check the body (400/404/413) ->
`Router.prepare()` (exact prompt tokens) -> `Gatekeeper.admit()` (429 before prefill) -> `n`
generations per prompt, concurrently -> a JSON answer or an SSE stream -> `Gatekeeper.finish()`
(refund the unused budget, meter the usage), whatever way the request ends.

Streaming follows OpenAI's format: each choice opens with a chunk carrying the role, content
deltas follow, each choice ends with a chunk carrying its `finish_reason`; with
`stream_options.include_usage` a last chunk with empty `choices` carries the usage (as OpenAI
sends it), and with the qwen-serve extension `stream_options.continuous_usage_stats` every chunk
carries the running usage; then `data: [DONE]`.

Every message from the router becomes a chunk at once, even when its tokens decode to no visible
text yet (an empty delta, with the running usage when asked for): the client sees each token
arrive. A stream's headers wait for the router's first message, so a request that fails before
its first token gets a plain HTTP error, as without streaming (a 400 when a worker refuses it as
larger than its KV cache, a 503 when no worker can take it).

A choice's `finish_reason` is only ever an OpenAI one (`stop`, `length`). A failure after the
stream started cannot change the HTTP status, so the stream ends with an error event, `data:
{"error": {...}}` (OpenAI's error object, as OpenAI and vLLM send it), then `data: [DONE]`; the
official clients raise it as an APIError. Without streaming, a failure is an HTTP error: 400 when
the request was at fault (`context_length_exceeded`, `invalid_argument`), else 500/503.

A request body must arrive within `body_timeout_s` (408 and the connection closed otherwise), so
a stalled upload does not hold a connection open. The `X-Request-Id` header, when it is a safe
token of at most 128 characters, is the request's id (echoed back; the stages know each run by a
unique internal id, so two requests may share one).

A client that disconnects cancels its generations, so the decode workers free the KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from qwenserve.protocol import FINISH_REASON_NAMES
from qwenserve.router.errors import (
    AuthenticationFailed,
    BodyReadTimeout,
    BodyTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    RouterError,
    UnknownModel,
    error_headers,
)
from qwenserve.router.gatekeeper import Gatekeeper, Ticket, api_key_from_headers
from qwenserve.router.generation import PreparedRequest, Router
from qwenserve.router.grpc_generate import outcome_for
from qwenserve.router.models import ModelRoutes
from qwenserve.router.openai_request import (
    ParsedRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json_body,
    parse_tokenize,
)
from qwenserve.router.request_ids import valid_request_id
from qwenserve.telemetry.metrics import StreamTimer, metrics_page
from qwenserve.telemetry.tracing import Attr, get_tracer, server_span
from qwenserve.tenancy.tenants import Tenant
from qwenserve.v1 import common_pb2, router_pb2

log = logging.getLogger(__name__)
tracer = get_tracer("qwenserve.router")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
# How often a request checks whether its client is still connected (between writes).
DISCONNECT_POLL_S = 0.2
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
# Terminal error codes of a generation (ErrorDetail.code) that mean "try again", for the HTTP status.
RETRYABLE_CODES = {"unavailable", "no_decode_worker", "cold_start_timeout", "resource_exhausted", "deadline_exceeded"}
# Terminal error codes that mean the request itself cannot be served (a worker's own checks refused it).
CLIENT_FAULT_CODES = {"context_length_exceeded", "invalid_argument"}
# The finish reasons OpenAI clients know that this server produces; any other ending is a failure.
OPENAI_FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter"}

TokenBytes = Callable[[int], bytes]
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """Limits of the HTTP front."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # A request body not fully received within this many seconds gets a 408 and the connection closes.
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S


# -- the application ---------------------------------------------------------------------------


def build_app(
    router: Router | ModelRoutes,
    gatekeeper: Gatekeeper,
    model_name: str = "",
    *,
    token_bytes: TokenBytes | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> web.Application:
    """The aiohttp application over one model's router (served as `model_name`, `token_bytes(id)` naming
    tokens in logprobs) or over several models' (`ModelRoutes`)."""
    if isinstance(router, Router):
        if token_bytes is not None:
            router.token_bytes = token_bytes
        router = ModelRoutes({model_name or router.config.model_name: router}, model_name or router.config.model_name)
    front = OpenAIFront(router, gatekeeper, HttpConfig(max_body_bytes, body_timeout_s))
    # aiohttp enforces the body limit while reading; a little slack lets our own check say 413 first.
    app = web.Application(middlewares=[_error_middleware], client_max_size=max_body_bytes + 1)
    app[MAX_BODY_KEY] = max_body_bytes
    app.router.add_post("/v1/chat/completions", front.chat_completions)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_get("/v1/models", front.list_models)
    app.router.add_get("/v1/models/{model:.+}", front.get_model)
    app.router.add_post("/tokenize", front.tokenize)
    app.router.add_post("/detokenize", front.detokenize)
    app.router.add_get("/health", front.health)
    app.router.add_get("/metrics", front.prometheus_metrics)
    return app


async def serve_http(app: web.Application, host: str, port: int,
                     ssl_context: ssl.SSLContext | None = None) -> web.AppRunner:
    """Start serving `app` on host:port (TLS with `ssl_context`); stop with `await runner.cleanup()`.

    Handlers are cancelled when their client disconnects (the stream's watcher would notice
    within DISCONNECT_POLL_S anyway; cancelling frees the decode worker at once).
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner


@web.middleware
async def _error_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """Every error becomes OpenAI's error shape with the status its type maps to."""
    try:
        return await handler(request)
    except BodyReadTimeout as e:
        return await _answer_and_close(request, error_response(e))
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
        return _error_json(e.status, e.reason, "http_error", None)
    except (ConnectionError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return _error_json(500, "internal server error; the request id is in the logs", "internal_error", None)


async def _answer_and_close(request: web.Request, response: web.Response) -> web.Response:
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
    response = _error_json(error.http_status, error.message, error.code, field_name, kind)
    response.headers.update(error_headers(error))
    return response


def _error_json(status: int, message: str, code: str, param: str | None, kind: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind or _error_type(status), "param": param, "code": code}}
    return web.json_response(body, status=status)


def _error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class OpenAIFront:
    """The handlers: everything between an HTTP request and the router's generations."""

    def __init__(self, routes: ModelRoutes, gatekeeper: Gatekeeper, config: HttpConfig) -> None:
        self.routes = routes
        self.gatekeeper = gatekeeper
        self.config = config
        self.created = int(time.time())

    # -- simple endpoints ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """Liveness of the HTTP front itself (no auth)."""
        return web.json_response({"status": "ok"})

    async def prometheus_metrics(self, request: web.Request) -> web.Response:
        """`GET /metrics`: the router's registry, as on its --metrics-port (no auth, as vLLM's)."""
        body, content_type = metrics_page(self.routes.routers[self.routes.default].metrics.registry,
                                          request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def list_models(self, request: web.Request) -> web.Response:
        """`GET /v1/models`: the models this router serves that the caller's key may use."""
        tenant = self._tenant(request)
        names = [n for n in self.routes.names if tenant.models is None or n in tenant.models]
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in names]})

    async def get_model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{model}`."""
        tenant = self._tenant(request)
        name = request.match_info["model"]
        if name not in self.routes.routers or (tenant.models is not None and name not in tenant.models):
            raise ModelNotFound(f"the model {name!r} does not exist", "model")
        return web.json_response(self._model_card(name))

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "qwen-serve",
            "max_model_len": self.routes.routers[name].config.max_model_len,
        }

    def _named(self, model: str | None) -> Router:
        """The router of the model a request names (no canary or fallback: tokens are a model's own)."""
        name = model or self.routes.default
        if name not in self.routes.routers:
            raise ModelNotFound(f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(self.routes.names)}", "model")
        return self.routes.routers[name]

    def _choose(self, model: str | None, tenant: Tenant, user: str | None) -> tuple[str, Router]:
        """The model that answers (canary and fallback applied) and its router."""
        try:  # a request's `user` splits canaries within a tenant (one shared tenant when auth is off)
            return self.routes.choose(model, tenant.models, key=user or tenant.id)
        except UnknownModel as e:
            raise ModelNotFound(e.message, "model") from None

    def _tenant(self, request: web.Request) -> Tenant:
        key = api_key_from_headers(request.headers.get("Authorization"), request.headers.get("X-Api-Key"))
        if key is not None and not _is_text(key):
            # aiohttp keeps header bytes that are not UTF-8 as lone surrogates; no key is made of those.
            raise AuthenticationFailed("the API key is not valid UTF-8 text")
        return self.gatekeeper.authenticate(key)

    # -- tokens ----------------------------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        """`POST /tokenize` (vLLM's): a prompt or conversation's token ids, as a generation would see them."""
        self._tenant(request)
        model, req, want_strs = parse_tokenize(parse_json_body(await self._read_body(request)))
        router = self._named(model)
        ids = await router.tokenize(req)
        strs = [_token_text(router, i) for i in ids] if want_strs else None
        return web.json_response({"count": len(ids), "max_model_len": router.config.max_model_len,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """`POST /detokenize` (vLLM's): the text of token ids."""
        self._tenant(request)
        model, ids = parse_detokenize(parse_json_body(await self._read_body(request)))
        return web.json_response({"prompt": self._named(model).detokenize(ids)})

    # -- completions -----------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """`POST /v1/chat/completions`."""
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """`POST /v1/completions` (the legacy text API)."""
        return await self._generate(request, "completion")

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BodyTooLarge(f"the request body is {request.content_length} bytes; the limit is {limit}", "body")
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                raw = await request.read()
        except TimeoutError as e:
            raise BodyReadTimeout(f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                                  "body") from e
        if len(raw) > limit:
            raise BodyTooLarge(f"the request body is larger than the limit of {limit} bytes", "body")
        return raw

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        """One completion request in its own trace: a SERVER span (parented to the caller's
        `traceparent`, if any) around a `router.request` span, with the request id bound."""
        request_id = _request_id(request, "chatcmpl" if kind == "chat" else "cmpl")
        with server_span(f"POST {request.path}", request.headers.items(), request_id), \
                tracer.start_as_current_span("router.request") as span:
            try:
                return await self._generate_traced(request, kind, request_id)
            except RouterError as e:
                # Refused before any answer started: the error middleware turns it into the response.
                if self.gatekeeper.metrics is not None:
                    self.gatekeeper.metrics.record_finished(outcome_for(e), "none")
                span.set_attribute("qwenserve.outcome", outcome_for(e))
                # One line, no traceback: the client's mistake (or a refusal), not a fault of ours.
                log.info("%s refused: %d %s (param %s): %.300s", request_id, e.http_status, e.code,
                         e.field or "-", e.message)
                raise

    async def _generate_traced(self, request: web.Request, kind: str, request_id: str) -> web.StreamResponse:
        arrived = time.monotonic()
        tenant = self._tenant(request)
        body = parse_json_body(await self._read_body(request))
        parsed = parse_chat(body) if kind == "chat" else parse_completion(body)
        model, router = self._choose(parsed.model, tenant, parsed.user)
        if parsed.logprobs and router.token_bytes is None:
            raise InvalidRequest("logprobs are not available: this server was started without a vocabulary",
                                 "logprobs")
        preps: list[PreparedRequest] = []
        for i, req in enumerate(parsed.prompts):
            req.request_id = request_id if len(parsed.prompts) == 1 else f"{request_id}-p{i}"
            try:
                self.gatekeeper.check_request(tenant, req)
                preps.append(await router.prepare(req, content_filter=tenant.content_filter))
            except InvalidRequest as e:
                raise _with_openai_param(e, kind) from e
        with tracer.start_as_current_span("rate_limit", attributes={Attr.TENANT: tenant.id}):
            ticket = await self.gatekeeper.admit(tenant, preps, copies=parsed.n, model=model)
        answer = _Answer(parsed, request_id, model, preps, router.token_bytes)
        if parsed.echo:  # the prompt as given, or as its token ids read
            for choice in answer.choices:
                given = parsed.prompts[choice.prompt_index]
                choice.echo = given.prompt if given.HasField("prompt") else router.detokenize(
                    preps[choice.prompt_index].prompt_ids)
        generations = _Generations(functools.partial(self.routes.run, model, allowed=tenant.models), answer.runs(),
                                   self._timer(arrived))
        watcher = asyncio.create_task(_watch_disconnect(request, generations))
        outcome = "cancelled"
        try:
            if parsed.stream:
                response = await self._stream(request, answer, generations, ticket)
            else:
                response = await self._respond(answer, generations, ticket)
            outcome = "cancelled" if generations.disconnected else answer.outcome()
            return response
        finally:
            watcher.cancel()
            try:
                await generations.cancel()
                ticket.model = answer.answered_by
                await self.gatekeeper.finish(ticket, answer.usage())
            finally:
                # A client leaving while we settle cancels this handler again (aiohttp's handler
                # cancellation): the gauges must still come down.
                self._record(generations, outcome, answer)
            log.info("%s tenant=%s %s n=%d prompt=%d completion=%d finish=%s %.3fs", request_id,
                     tenant.id, kind, parsed.n, answer.prompt_tokens, answer.completion_tokens(),
                     ",".join(c.summary() for c in answer.choices), time.monotonic() - arrived)

    def _timer(self, arrived: float) -> StreamTimer | None:
        metrics = self.gatekeeper.metrics
        if metrics is None:
            return None
        metrics.in_flight.inc()
        return metrics.stream_timer(arrived)

    def _record(self, generations: _Generations, outcome: str, answer: _Answer) -> None:
        metrics = self.gatekeeper.metrics
        if metrics is None or generations.timer is None:
            return
        metrics.in_flight.dec()
        generations.timer.finish()
        for choice in answer.choices:
            metrics.record_finished(outcome, choice.finish_reason or "")

    async def _respond(self, answer: _Answer, generations: _Generations, ticket: Ticket) -> web.Response:
        """Collect every choice, then answer once."""
        async for index, msg in generations.events():
            answer.choices[index].add(msg)
        if generations.disconnected:
            return web.Response(status=499, text="client closed the request")  # nobody reads it
        failed = next((c for c in answer.choices if c.failed), None)
        if failed is not None:
            status, error = failed.failure()
            response = web.json_response({"error": error}, status=status, headers=_retry_after(status, error))
        else:
            response = web.json_response(answer.full_body())
        response.headers.update(ticket.headers())
        response.headers["X-Request-Id"] = answer.request_id
        return response

    async def _stream(self, request: web.Request, answer: _Answer, generations: _Generations,
                      ticket: Ticket) -> web.StreamResponse:
        """Server-sent events as the tokens arrive; the headers wait for the router's first message."""
        events = generations.events()
        event = await anext(events, None)
        if event is not None and _ends_badly(event[1]):
            # Failed before anything was generated: still time for a plain HTTP error (a 400 for a
            # request no worker can hold; a 503 the client's retry logic understands).
            choice = answer.choices[event[0]]
            choice.add(event[1])
            status, error = choice.failure()
            return web.json_response({"error": error}, status=status,
                                     headers={"X-Request-Id": answer.request_id, **ticket.headers(),
                                              **_retry_after(status, error)})
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": answer.request_id,
            **ticket.headers(),
        })
        await response.prepare(request)
        try:
            if answer.parsed.kind == "chat":
                for choice in answer.choices:
                    await _send(response, answer.chunk([choice.opening()]))
            failure = None
            while event is not None and failure is None:
                index, msg = event
                answer.choices[index].add(msg)
                failure = await _relay(response, answer, index, msg)
                event = await anext(events, None) if failure is None else None
            if generations.disconnected:
                return response
            if failure is not None:
                # OpenAI's mid-stream error: an event with only the error object; no finish_reason,
                # no usage chunk (the official clients raise at this event).
                await _send(response, {"error": failure})
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            # Settled before [DONE], so a client's next request already sees the refund.
            ticket.model = answer.answered_by
            await self.gatekeeper.finish(ticket, answer.usage())
            if answer.parsed.include_usage:
                await _send(response, answer.chunk([], usage=answer.usage_json()))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            log.info("%s: the client disconnected mid-stream", answer.request_id)
        return response


def _retry_after(status: int, error: dict[str, Any]) -> dict[str, str]:
    """A 503's Retry-After: longer while a stage scaled to zero is still starting."""
    if status != 503:
        return {}
    return {"Retry-After": "10" if error.get("code") == "cold_start_timeout" else "2"}


async def _relay(response: web.StreamResponse, answer: _Answer, index: int,
                 msg: router_pb2.GenerateResponse) -> dict[str, Any] | None:
    """Send the chunks of one message already added to its choice; the error object if it failed."""
    choice = answer.choices[index]
    # Tokens that decode to no text yet (a partial character, special tokens, a possible stop
    # string) still get their chunk: the client sees them arrive and, with usage, counts them.
    if msg.token_ids or msg.text or msg.logprobs:
        chunk = answer.chunk([choice.delta(msg)])
        if answer.parsed.kind == "chat" and answer.parsed.prompt_logprobs is not None and msg.prompt_logprobs:
            chunk["prompt_logprobs"] = choice.prompt_logprobs_json()  # the first chunk with tokens, as vLLM
        await _send(response, chunk)
    if choice.failed:
        return choice.failure()[1]
    if msg.finish_reason:
        await _send(response, answer.chunk([choice.closing()]))
    return None


def _token_text(router: Router, token_id: int) -> str:
    return router.token_bytes(token_id).decode("utf-8", errors="replace") if router.token_bytes else ""


def _ends_badly(msg: router_pb2.GenerateResponse) -> bool:
    """A terminal message whose finish reason is not an OpenAI one (an error, an abort)."""
    return bool(msg.finish_reason) and FINISH_REASON_NAMES.get(msg.finish_reason) not in OPENAI_FINISH_REASONS


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _request_id(request: web.Request, prefix: str) -> str:
    """The client's X-Request-Id when it is a safe token (it travels as gRPC metadata and into
    logs), else a new id. Reusing one in flight is fine: the stages know each run by a unique id."""
    given = request.headers.get("X-Request-Id", "")
    return given if valid_request_id(given) else f"{prefix}-{uuid.uuid4().hex[:24]}"


async def _watch_disconnect(request: web.Request, generations: _Generations) -> None:
    """Cancel the generations when the client goes away, even while nothing is being written."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        transport = request.transport
        if transport is None or transport.is_closing():
            generations.disconnect()
            return


def _with_openai_param(error: InvalidRequest, kind: str) -> InvalidRequest:
    """The router names fields as in the proto ("sampling.top_p"); OpenAI clients expect "top_p"."""
    name = error.field.removeprefix("sampling.")
    if name == "input":
        name = "messages" if kind == "chat" else "prompt"
    error.field = name
    return error


# -- running the generations -------------------------------------------------------------------


class _Generations:
    """The request's generations as concurrent tasks, merged into one stream of (choice index, message)."""

    def __init__(self, run: Callable[[PreparedRequest], AsyncIterator[router_pb2.GenerateResponse]],
                 runs: Sequence[tuple[int, PreparedRequest]], timer: StreamTimer | None = None) -> None:
        self._run = run
        self.timer = timer
        self._queue: asyncio.Queue[tuple[int, router_pb2.GenerateResponse | None]] = asyncio.Queue()
        self._open = len(runs)
        self.disconnected = False
        self._tasks = [asyncio.create_task(self._pump(index, prep)) for index, prep in runs]

    async def _pump(self, index: int, prep: PreparedRequest) -> None:
        stream = self._run(prep)
        try:
            async for msg in stream:
                self._queue.put_nowait((index, msg))
                if msg.finish_reason:
                    return
            raise RuntimeError("the router's stream ended without a finish reason")
        except Exception as e:  # any failure still ends this choice with exactly one terminal message
            log.exception("%s: generation failed", prep.request_id)
            self._queue.put_nowait((index, router_pb2.GenerateResponse(
                request_id=prep.request_id,
                finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=common_pb2.ErrorDetail(code="internal_error", message=str(e) or type(e).__name__),
            )))
        finally:
            await stream.aclose()  # closes the decode stream now, not when the generator is collected

    def disconnect(self) -> None:
        """The client went away: stop `events()` at once (the caller then cancels the tasks)."""
        self.disconnected = True
        self._queue.put_nowait((-1, None))

    async def events(self) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
        """Messages as they arrive, until every choice has its terminal message or the client left."""
        while self._open:
            index, msg = await self._queue.get()
            if msg is None:
                return
            if msg.finish_reason:
                self._open -= 1
            if msg.token_ids and self.timer is not None:
                self.timer.token()
            yield index, msg

    async def cancel(self) -> None:
        """Stop whatever still runs (a disconnect, or an error on our side) and wait for it to stop."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# -- shaping the answer ------------------------------------------------------------------------


@dataclass(slots=True)
class _Choice:
    """One answer being assembled: text, logprobs, token counts, finish reason."""

    index: int
    prompt_index: int
    kind: str
    token_bytes: TokenBytes | None
    top_logprobs: int
    want_logprobs: bool
    parallel_tool_calls: bool = True
    echo: str = ""  # the prompt, sent before the first token's text (the legacy API's echo)
    model: str = ""  # the model that answered, when it is not the one chosen at admission
    want_prompt_logprobs: bool = False  # vLLM's prompt_logprobs: shown per choice (chat: on the response)
    echo_logprobs: bool = False  # legacy echo with logprobs: the prompt's tokens lead `logprobs`
    first_prompt_token: int = 0  # the prompt's first token, which has no logprob
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_tokens: int = 0
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: str | None = None
    error: common_pb2.ErrorDetail | None = None

    def add(self, msg: router_pb2.GenerateResponse) -> None:
        self.text.append(msg.text)
        if msg.model:
            self.model = msg.model  # a fallback took over after admission
        self.reasoning.append(msg.reasoning_text)
        self.tool_calls.extend(self._calls(msg))
        self.logprobs.extend(msg.logprobs)
        if msg.prompt_logprobs:
            self.prompt_logprobs = list(msg.prompt_logprobs)
        self.completion_tokens += len(msg.token_ids)
        if msg.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES.get(msg.finish_reason, "error")
            if msg.HasField("usage"):
                self.completion_tokens = msg.usage.completion_tokens
                self.cached_prompt_tokens = msg.usage.cached_prompt_tokens
                self.reasoning_tokens = msg.usage.reasoning_tokens
            if msg.HasField("error"):
                self.error = msg.error

    def opening(self) -> dict[str, Any]:
        """The first chunk of a streamed chat choice: the role."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, msg: router_pb2.GenerateResponse) -> dict[str, Any]:
        """A streamed chunk's choice for one message's text and logprobs."""
        leading = self._leading_prompt_logprobs() if msg.prompt_logprobs else None
        logprobs = self._logprobs(msg.logprobs, leading) if self.want_logprobs else None
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            calls = self._calls(msg)
            if msg.reasoning_text:
                delta["reasoning_content"] = msg.reasoning_text
            if msg.text or not (msg.reasoning_text or calls):
                delta["content"] = msg.text
            if calls:
                delta["tool_calls"] = calls
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        echo, self.echo = self.echo, ""  # streamed once, before the first token's text
        out = {"index": self.index, "text": echo + msg.text, "logprobs": logprobs, "finish_reason": None}
        if self.want_prompt_logprobs and msg.prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs_json()
        return out

    def _calls(self, msg: router_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """A message's tool calls as OpenAI writes them (only the first of an answer without parallel calls)."""
        return [{"index": c.index, "id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in msg.tool_calls if self.parallel_tool_calls or c.index == 0]

    @property
    def failed(self) -> bool:
        """Ended other than by `stop` or `length` (an error, or an abort such as a passed deadline)."""
        return self.finish_reason is not None and self.finish_reason not in OPENAI_FINISH_REASONS

    def failure(self) -> tuple[int, dict[str, Any]]:
        """The HTTP status and OpenAI error object of a failed choice: 4xx when the request was at fault."""
        detail = self.error or common_pb2.ErrorDetail(code="internal_error",
                                                      message=f"generation ended: {self.finish_reason}")
        code = detail.code or "internal_error"
        if code in CLIENT_FAULT_CODES:
            status, message = 400, detail.message
        else:
            status = 503 if detail.retryable or code in RETRYABLE_CODES else 500
            message = f"generation failed: {detail.message}"
        param = detail.field.removeprefix("sampling.") or None
        return status, {"message": message, "type": _error_type(status), "param": param, "code": code}

    def summary(self) -> str:
        """How the choice ended, for the request's log line: "length", "error:no_decode_worker", "-"."""
        if self.failed and self.error is not None and self.error.code:
            return f"{self.finish_reason}:{self.error.code}"
        return self.finish_reason or "-"

    def closing(self) -> dict[str, Any]:
        """The last chunk of a streamed choice that ended well: its finish reason."""
        if self.kind == "chat":
            return {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason}
        return {"index": self.index, "text": "", "logprobs": None, "finish_reason": self.finish_reason}

    def full(self) -> dict[str, Any]:
        """The choice of a non-streamed answer."""
        text = "".join(self.text)
        logprobs = self._logprobs(self.logprobs, self._leading_prompt_logprobs()) if self.want_logprobs else None
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reasoning = "".join(self.reasoning)
            if reasoning:
                message["reasoning_content"] = reasoning
            if self.tool_calls:
                message["tool_calls"] = self.tool_calls
                if not text.strip():  # the whitespace around the calls is not an answer
                    message["content"] = None
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason}
        out = {"index": self.index, "text": self.echo + text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        if self.want_prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs_json()
        return out

    def prompt_logprobs_json(self) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then for each position its token and the
        most likely alternatives by id (as a string), with logprob, rank and decoded text."""
        out: list[dict[str, Any] | None] = [None]
        for lp in self.prompt_logprobs:
            entries = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                          "decoded_token": self._token(lp.token_id)[0]}}
            for rank, top in enumerate(lp.top, start=1):
                entries.setdefault(str(top.token_id), {"logprob": top.logprob, "rank": rank,
                                                       "decoded_token": self._token(top.token_id)[0]})
            out.append(entries)
        return out

    def _leading_prompt_logprobs(self) -> list[common_pb2.TokenLogprob | None] | None:
        """The echoed prompt's entries that lead a legacy `logprobs` (once); None when not asked for."""
        if not self.echo_logprobs or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return [common_pb2.TokenLogprob(token_id=self.first_prompt_token), *self.prompt_logprobs]

    def _logprobs(self, items: Sequence[common_pb2.TokenLogprob],
                  leading: Sequence[common_pb2.TokenLogprob] | None = None) -> dict[str, Any]:
        name = self._token
        if self.kind == "chat":
            content = []
            for lp in items:
                token, raw = name(lp.token_id)
                content.append({
                    "token": token, "logprob": lp.logprob, "bytes": list(raw),
                    "top_logprobs": [
                        {"token": t, "logprob": top.logprob, "bytes": list(b)}
                        for top in lp.top[: self.top_logprobs]
                        for t, b in [name(top.token_id)]
                    ],
                })
            return {"content": content, "refusal": None}
        # With echo, the prompt's tokens come first; the very first has no logprob (null, as OpenAI writes it).
        entries = [*(leading or []), *items]
        tokens = [name(lp.token_id)[0] for lp in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        none_first = bool(leading)
        return {
            "tokens": tokens,
            "token_logprobs": [None if none_first and i == 0 else lp.logprob for i, lp in enumerate(entries)],
            "top_logprobs": [None if none_first and i == 0 else
                             {name(t.token_id)[0]: t.logprob for t in lp.top[: self.top_logprobs]}
                             for i, lp in enumerate(entries)] if self.top_logprobs else None,
            "text_offset": offsets,
        }

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """A token as OpenAI shows it: its text (invalid UTF-8 replaced) and its exact bytes."""
        raw = self.token_bytes(token_id) if self.token_bytes is not None else b""
        return raw.decode("utf-8", errors="replace"), raw


class _Answer:
    """The whole response: choices, ids, usage, chunk envelopes."""

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str, preps: Sequence[PreparedRequest],
                 token_bytes: TokenBytes | None) -> None:
        self.parsed = parsed
        self.request_id = request_id
        self.model = model
        self.preps = list(preps)
        self.created = int(time.time())
        self.object = "chat.completion" if parsed.kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"
        # OpenAI bills a prompt once however many answers it gets.
        self.prompt_tokens = sum(len(p.prompt_ids) for p in preps)
        self.choices = [
            _Choice(index=p * parsed.n + j, prompt_index=p, kind=parsed.kind, token_bytes=token_bytes,
                    top_logprobs=parsed.top_logprobs, want_logprobs=parsed.logprobs,
                    parallel_tool_calls=parsed.parallel_tool_calls,
                    want_prompt_logprobs=parsed.prompt_logprobs is not None and parsed.kind == "completion",
                    echo_logprobs=parsed.echo_logprobs,
                    first_prompt_token=preps[p].prompt_ids[0] if preps[p].prompt_ids else 0)
            for p in range(len(preps))
            for j in range(parsed.n)
        ]

    @property
    def answered_by(self) -> str:
        """The model chosen at admission, or the fallback that took over when its workers failed the request."""
        return next((c.model for c in self.choices if c.model), self.model)

    def runs(self) -> list[tuple[int, PreparedRequest]]:
        """(choice index, prepared request) for every generation; copies get their own seeds and ids."""
        runs = []
        for choice in self.choices:
            prep = self.preps[choice.prompt_index]
            copy = choice.index % self.parsed.n
            runs.append((choice.index, prep if copy == 0 else _copy_for_choice(prep, copy)))
        return runs

    def outcome(self) -> str:
        """The metrics' outcome label: "invalid" / "error" when a choice failed (by the request's
        fault or ours), else "ok"."""
        failed = next((c for c in self.choices if c.failed), None)
        if failed is None:
            return "ok"
        return "invalid" if failed.failure()[0] < 500 else "error"

    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> common_pb2.Usage:
        """Usage so far: each prompt once; cached tokens counted once per prompt (the least of its copies)."""
        cached = 0
        for p in range(len(self.preps)):
            copies = [c.cached_prompt_tokens for c in self.choices if c.prompt_index == p]
            cached += min(copies) if copies else 0
        completion = self.completion_tokens()
        return common_pb2.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                                cached_prompt_tokens=cached, total_tokens=self.prompt_tokens + completion,
                                reasoning_tokens=sum(c.reasoning_tokens for c in self.choices))

    def usage_json(self) -> dict[str, Any]:
        usage = self.usage()
        out = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        }
        if self.parsed.kind == "chat":
            out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
        return out

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                               "model": self.answered_by, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        elif self.parsed.continuous_usage:
            out["usage"] = self.usage_json()
        elif self.parsed.include_usage:
            out["usage"] = None
        return out

    def full_body(self) -> dict[str, Any]:
        body = {"id": self.request_id, "object": self.object, "created": self.created, "model": self.answered_by,
                "choices": [c.full() for c in self.choices], "usage": self.usage_json()}
        if self.parsed.kind == "chat" and self.parsed.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.choices[0].prompt_logprobs_json()  # vLLM: on the response, not a choice
        return body


def _copy_for_choice(prep: PreparedRequest, copy: int) -> PreparedRequest:
    """Choice `copy` (> 0) of a prompt: its own request id, and a seed derived from the request's."""
    sampling, wire = prep.sampling, prep.wire_sampling
    if sampling.seed is not None:
        seed = _mix64(sampling.seed, copy)
        sampling = dataclasses.replace(sampling, seed=seed)
        wire = common_pb2.SamplingParams()
        wire.CopyFrom(prep.wire_sampling)
        wire.seed = seed
    # internal_id "" makes a fresh one: copies run side by side, and the stages key their work by it.
    return dataclasses.replace(prep, request_id=f"{prep.request_id}-{copy}", sampling=sampling, wire_sampling=wire,
                               internal_id="")


def _mix64(seed: int, stream: int) -> int:
    """A well-spread 64-bit seed for answer `stream` (splitmix64), so that answer 1 of seed s does
    not equal answer 0 of seed s + 1 as a plain `seed + i` would make it."""
    z = (seed + 0x9E3779B97F4A7C15 * stream) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)
