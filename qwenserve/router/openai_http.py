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
import functools
import logging
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from qwenserve.router.errors import (
    AuthenticationFailed,
    BodyReadTimeout,
    BodyTooLarge,
    InvalidRequest,
    ModelNotFound,
    RouterError,
    UnknownModel,
)
from qwenserve.router.gatekeeper import Gatekeeper, Ticket, api_key_from_headers
from qwenserve.router.generation import Router
from qwenserve.router.grpc_generate import outcome_for
from qwenserve.router.models import ModelRoutes
from qwenserve.router.openai_answer import Answer, Generations, TokenBytes, ends_badly, relay, send_chunk
from qwenserve.router.openai_errors import MAX_BODY_KEY, error_middleware, retry_after, with_openai_param
from qwenserve.router.openai_fields import optional, parse_json_body
from qwenserve.router.openai_request import (
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from qwenserve.router.prepared_request import PreparedRequest
from qwenserve.router.request_ids import valid_request_id
from qwenserve.telemetry.metrics import TENANT_LABEL, StreamTimer, WithoutLabel, metrics_page
from qwenserve.telemetry.tracing import Attr, get_tracer, server_span
from qwenserve.tenancy.tenants import Tenant
from qwenserve.untrusted_input import echo

log = logging.getLogger(__name__)
tracer = get_tracer("qwenserve.router")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
# How often a request checks whether its client is still connected (between writes).
DISCONNECT_POLL_S = 0.2


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
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes + 1)
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
        """`GET /metrics`: the router's registry (no auth, as vLLM's) less its tenant-labelled series, which name
        customers and their usage; the --metrics-port, the one Prometheus scrapes, serves those too."""
        registry = self.routes.routers[self.routes.default].metrics.registry
        body, content_type = metrics_page(WithoutLabel(registry, TENANT_LABEL), request.headers.get("Accept", ""))
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
            # What each stage computes in (a W4A16 decode behind a bf16 prefill shows as such), as workers reported it.
            "precision": self.routes.routers[name].fleet.precisions(),
        }

    def _named(self, model: str | None) -> Router:
        """The router of the model a request names (no canary or fallback: tokens are a model's own)."""
        name = model or self.routes.default
        if name not in self.routes.routers:
            raise ModelNotFound(f"the model {echo(name)} does not exist; this server serves "
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
        body = parse_json_body(await self._read_body(request))
        router = self._named(optional(body, "model", str, None))
        ids = parse_detokenize(body, max_ids=router.config.max_model_len or 0)
        return web.json_response({"prompt": router.detokenize(ids)})

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
                raise with_openai_param(e, kind) from e
        with tracer.start_as_current_span("rate_limit", attributes={Attr.TENANT: tenant.id}):
            ticket = await self.gatekeeper.admit(tenant, preps, copies=parsed.n, model=model)
        answer = Answer(parsed, request_id, model, preps, router.token_bytes)
        if parsed.echo:  # the prompt as given, or as its token ids read
            for choice in answer.choices:
                given = parsed.prompts[choice.prompt_index]
                choice.echo = given.prompt if given.HasField("prompt") else router.detokenize(
                    preps[choice.prompt_index].prompt_ids)
        generations = Generations(functools.partial(self.routes.run, model, allowed=tenant.models), answer.runs(),
                                   self._timer(arrived), answer.prompt_logprob_lenders())
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

    def _record(self, generations: Generations, outcome: str, answer: Answer) -> None:
        metrics = self.gatekeeper.metrics
        if metrics is None or generations.timer is None:
            return
        metrics.in_flight.dec()
        generations.timer.finish()
        for choice in answer.choices:
            metrics.record_finished(outcome, choice.finish_reason or "")

    async def _respond(self, answer: Answer, generations: Generations, ticket: Ticket) -> web.Response:
        """Collect every choice, then answer once."""
        async for index, msg in generations.events():
            answer.choices[index].add(msg)
        if generations.disconnected:
            return web.Response(status=499, text="client closed the request")  # nobody reads it
        failed = next((c for c in answer.choices if c.failed), None)
        if failed is not None:
            status, error = failed.failure()
            response = web.json_response({"error": error}, status=status, headers=retry_after(status, error))
        else:
            response = web.json_response(answer.full_body())
        response.headers.update(ticket.headers())
        response.headers["X-Request-Id"] = answer.request_id
        return response

    async def _stream(self, request: web.Request, answer: Answer, generations: Generations,
                      ticket: Ticket) -> web.StreamResponse:
        """Server-sent events as the tokens arrive; the headers wait for the router's first message."""
        events = generations.events()
        event = await anext(events, None)
        if event is not None and ends_badly(event[1]):
            # Failed before anything was generated: still time for a plain HTTP error (a 400 for a
            # request no worker can hold; a 503 the client's retry logic understands).
            choice = answer.choices[event[0]]
            choice.add(event[1])
            status, error = choice.failure()
            return web.json_response({"error": error}, status=status,
                                     headers={"X-Request-Id": answer.request_id, **ticket.headers(),
                                              **retry_after(status, error)})
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
                    await send_chunk(response, answer.chunk([choice.opening()]))
            failure = None
            while event is not None and failure is None:
                index, msg = event
                answer.choices[index].add(msg)
                failure = await relay(response, answer, index, msg)
                event = await anext(events, None) if failure is None else None
            if generations.disconnected:
                return response
            if failure is not None:
                # OpenAI's mid-stream error: an event with only the error object; no finish_reason,
                # no usage chunk (the official clients raise at this event).
                await send_chunk(response, {"error": failure})
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            # Settled before [DONE], so a client's next request already sees the refund.
            ticket.model = answer.answered_by
            await self.gatekeeper.finish(ticket, answer.usage())
            if answer.parsed.include_usage:
                await send_chunk(response, answer.chunk([], usage=answer.usage_json()))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            log.info("%s: the client disconnected mid-stream", answer.request_id)
        return response

def _token_text(router: Router, token_id: int) -> str:
    return router.token_bytes(token_id).decode("utf-8", errors="replace") if router.token_bytes else ""


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


async def _watch_disconnect(request: web.Request, generations: Generations) -> None:
    """Cancel the generations when the client goes away, even while nothing is being written."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        transport = request.transport
        if transport is None or transport.is_closing():
            generations.disconnect()
            return
