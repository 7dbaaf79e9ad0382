"""The front door's one checkpoint: authenticate, rate-limit and meter every request, gRPC and HTTP alike.

    tenant = gatekeeper.authenticate(api_key)          # before any work: 401 / UNAUTHENTICATED
    gatekeeper.check_request(tenant, request)          # the tenant's output cap on an explicit max_tokens
    prep = await router.prepare(request, deadline)     # exact prompt ids (the tokenizer's count)
    ticket = await gatekeeper.admit(tenant, [prep])    # before prefill: 429 / RESOURCE_EXHAUSTED
    try:
        ...router.run(prep)...
    finally:
        await gatekeeper.finish(ticket, usage)         # refund the unused budget, meter the usage

The cost of a request is its exact prompt tokens plus its output budget (`max_tokens`, which
`prepare()` makes explicit); at the end it is settled to prompt + generated tokens so that the
tokens-per-minute window counts what was really produced. A request answered `n` times charges
its prompt once (as OpenAI bills it) and the output budget `n` times.

Each tenant's requests get the tenant id in their prefix-cache salt, so one tenant can never
observe another's cached prefixes through time-to-first-token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qwenserve.ratelimit import (
    Admission,
    RateLimiter,
    RateLimiterUnavailable,
    RateLimitExceeded,
    grpc_rate_limit_metadata,
    rate_limit_headers,
)
from qwenserve.router.errors import (
    AuthenticationFailed,
    InvalidRequest,
    LimiterUnavailable,
    RateLimited,
    RouterError,
)
from qwenserve.tenancy.keys import KeyStore, Unauthenticated, bearer_token
from qwenserve.tenancy.tenants import Tenant
from qwenserve.tenancy.usage import UsageMeter, UsageMeterUnavailable, UsageRecord
from qwenserve.v1 import common_pb2, router_pb2

if TYPE_CHECKING:
    from qwenserve.router.prepared_request import PreparedRequest
    from qwenserve.telemetry.metrics import RouterMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Ticket:
    """An admitted request: what was charged, and the headers to send with the answer."""

    tenant: Tenant
    admission: Admission
    prompt_tokens: int
    output_budget: int
    finished: bool = False
    model: str = ""  # the model that answers, for the meter (a fallback that took over sets its own)

    @property
    def cost_tokens(self) -> int:
        """What the limiter charged up front."""
        return self.prompt_tokens + self.output_budget

    def headers(self) -> dict[str, str]:
        """X-RateLimit-* headers for a successful answer (as OpenAI sends them)."""
        return rate_limit_headers(self.admission)

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """The same as gRPC metadata."""
        return grpc_rate_limit_metadata(self.admission)


class Gatekeeper:
    """Authentication, rate limiting and usage metering for both router fronts."""

    def __init__(
        self,
        keys: KeyStore,
        limiter: RateLimiter,
        meter: UsageMeter | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.keys = keys
        self.limiter = limiter
        self.meter = meter
        self.metrics = metrics
        self._pending: set[asyncio.Task[None]] = set()

    def authenticate(self, api_key: str | None) -> Tenant:
        """The tenant of `api_key`; raises AuthenticationFailed (401 / UNAUTHENTICATED)."""
        try:
            return self.keys.authenticate(api_key)
        except Unauthenticated as e:
            raise AuthenticationFailed(str(e)) from e

    def check_request(self, tenant: Tenant, request: router_pb2.GenerateRequest) -> None:
        """Refuse an explicit max_tokens above the tenant's cap (an unset one is clamped in `admit`)."""
        cap = tenant.limits.max_tokens
        if cap is not None and request.sampling.HasField("max_tokens") and request.sampling.max_tokens > cap:
            raise InvalidRequest(
                f"max_tokens {request.sampling.max_tokens} exceeds this API key's limit of {cap} tokens per request",
                "sampling.max_tokens",
            )

    async def admit(self, tenant: Tenant, preps: Sequence[PreparedRequest], copies: int = 1,
                    model: str = "") -> Ticket:
        """Charge the requests' cost to the tenant's window before any prefill work starts.

        `preps` are distinct prompts (a completions batch has several), each to be answered
        `copies` times (OpenAI's `n`). Salts each prompt's prefix cache with the tenant. Raises
        RateLimited (429 / RESOURCE_EXHAUSTED, with headers) or LimiterUnavailable (503).
        """
        for prep in preps:
            _clamp_output(prep, tenant.limits.max_tokens)
            prep.cache_salt = f"tenant={tenant.id};{prep.cache_salt}"
            prep.priority = tenant.priority
        prompt_tokens = sum(len(p.prompt_ids) for p in preps)
        output_budget = copies * sum(p.sampling.max_tokens or 0 for p in preps)
        request_id = preps[0].request_id
        try:
            admission = await self.limiter.admit(tenant, prompt_tokens + output_budget, request_id)
        except RateLimitExceeded as e:
            if self.metrics is not None:
                self.metrics.record_ratelimit(False, e.limited_by[0] if e.limited_by else "none")
            raise RateLimited(str(e), rate_limit_headers(e), e.limited_by, e.retry_after_s) from e
        except RateLimiterUnavailable as e:
            raise LimiterUnavailable(f"the rate limiter is unavailable, try again shortly: {e}") from e
        if self.metrics is not None:
            self.metrics.record_ratelimit(True)
        return Ticket(tenant, admission, prompt_tokens, output_budget, model=model)

    async def finish(self, ticket: Ticket, usage: common_pb2.Usage) -> None:
        """Settle the ticket to what was really used and meter it; once per ticket, never raises.

        Runs to completion even when the caller is cancelled (a client that went away still
        gets its unused budget back and its usage counted).
        """
        if ticket.finished:
            return
        ticket.finished = True
        task = asyncio.ensure_future(self._finish(ticket, usage))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        await asyncio.shield(task)

    async def _finish(self, ticket: Ticket, usage: common_pb2.Usage) -> None:
        actual = min(ticket.cost_tokens, usage.prompt_tokens + usage.completion_tokens)
        await self.limiter.settle(ticket.admission, actual)
        if self.metrics is not None:
            self.metrics.record_tokens(
                ticket.tenant.id,
                prompt=usage.prompt_tokens,
                cached=usage.cached_prompt_tokens,
                completion=usage.completion_tokens,
                tier=ticket.tenant.tier,
                reasoning=usage.reasoning_tokens,
            )
        if self.meter is not None:
            record = UsageRecord(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_prompt_tokens=min(usage.cached_prompt_tokens, usage.prompt_tokens),
                reasoning_tokens=min(usage.reasoning_tokens, usage.completion_tokens),
                model=ticket.model,
            )
            try:
                await self.meter.record(ticket.tenant, record)
            except UsageMeterUnavailable:
                pass  # the meter logged and counted it; the answer was already given

    async def drain(self) -> None:
        """Wait for settlements still running (call on shutdown, before closing the limiter)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


def _clamp_output(prep: PreparedRequest, cap: int | None) -> None:
    """An output budget the client left to the server's default is held to the tenant's cap."""
    if cap is None or (prep.sampling.max_tokens or 0) <= cap:
        return
    prep.sampling = dataclasses.replace(prep.sampling, max_tokens=cap, min_tokens=min(prep.sampling.min_tokens, cap))
    prep.wire_sampling.max_tokens = cap
    prep.wire_sampling.min_tokens = prep.sampling.min_tokens


def api_key_from_headers(authorization: str | None, x_api_key: str | None) -> str | None:
    """The API key of a request: `Authorization: Bearer KEY`, else `x-api-key: KEY`."""
    return bearer_token(authorization) or (x_api_key.strip() if x_api_key and x_api_key.strip() else None)


def api_key_from_grpc_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The API key from gRPC invocation metadata (`authorization: Bearer KEY` or `x-api-key`)."""
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str) and key in ("authorization", "x-api-key"):
            found.setdefault(key, value)
    return api_key_from_headers(found.get("authorization"), found.get("x-api-key"))


def grpc_error_metadata(error: RouterError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for an error: the rate-limit headers of a 429, lower-cased."""
    headers = getattr(error, "headers", None) or {}
    return tuple((name.lower(), value) for name, value in headers.items())
