"""The gatekeeper with the real key store, in-process limiter and meter: who gets in, what it costs, refunds."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest

from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.ratelimit import InProcessRateLimiter
from qwenserve.router.errors import AuthenticationFailed, InvalidRequest, RateLimited
from qwenserve.router.front_door import FrontConfig, add_front_flags, close_gatekeeper, make_gatekeeper
from qwenserve.router.gatekeeper import Gatekeeper, api_key_from_grpc_metadata, api_key_from_headers
from qwenserve.router.prepared_request import PreparedRequest
from qwenserve.tenancy import InProcessUsageMeter, KeyStore, Tenant, TenantLimits, key_digest
from qwenserve.v1 import common_pb2, router_pb2

ACME = Tenant("acme", TenantLimits(tokens_per_minute=1000))
OTHER = Tenant("other")
CAPPED = Tenant("capped", TenantLimits(max_tokens=10))


def gatekeeper() -> Gatekeeper:
    keys = KeyStore([ACME, OTHER, CAPPED], [(key_digest("sk-a"), "acme"), (key_digest("sk-o"), "other"),
                                            (key_digest("sk-c"), "capped")])
    return Gatekeeper(keys, InProcessRateLimiter(window_s=60), InProcessUsageMeter())


def prep(prompt_len: int, max_tokens: int, request_id: str = "r1") -> PreparedRequest:
    sampling = SamplingParams(max_tokens=max_tokens)
    return PreparedRequest(
        request_id=request_id, prompt_ids=list(range(1, prompt_len + 1)), sampling=sampling,
        wire_sampling=common_pb2.SamplingParams(max_tokens=max_tokens), stop=[], skip_special_tokens=True,
        cache_salt="", deadline=None,
    )


def usage(prompt: int, completion: int, cached: int = 0) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached,
                            total_tokens=prompt + completion)


def test_missing_or_unknown_keys_are_unauthenticated() -> None:
    gate = gatekeeper()
    for key in (None, "", "sk-nope"):
        with pytest.raises(AuthenticationFailed) as info:
            gate.authenticate(key)
        assert info.value.http_status == 401 and info.value.grpc_code == grpc.StatusCode.UNAUTHENTICATED
    assert gate.authenticate("sk-a") == ACME


def test_api_keys_come_from_bearer_or_x_api_key_on_both_fronts() -> None:
    assert api_key_from_headers("Bearer sk-a", None) == "sk-a"
    assert api_key_from_headers(None, "sk-a") == "sk-a"
    assert api_key_from_headers("Basic abc", None) is None
    assert api_key_from_grpc_metadata([("user-agent", "x"), ("authorization", "Bearer sk-a")]) == "sk-a"
    assert api_key_from_grpc_metadata([("x-api-key", "sk-o")]) == "sk-o"


async def test_cost_is_prompt_plus_output_budget_and_the_unused_budget_is_refunded() -> None:
    gate = gatekeeper()
    ticket = await gate.admit(ACME, [prep(100, 300)])
    assert ticket.cost_tokens == 400
    assert ticket.headers()["X-RateLimit-Remaining-Tokens"] == "600"
    await gate.finish(ticket, usage(100, 20))  # stopped early: 280 of the budget come back
    nxt = await gate.admit(ACME, [prep(100, 300, "r2")])
    assert nxt.headers()["X-RateLimit-Remaining-Tokens"] == str(1000 - 120 - 400)


async def test_n_answers_charge_the_prompt_once_and_the_budget_n_times() -> None:
    ticket = await gatekeeper().admit(ACME, [prep(50, 100)], copies=3)
    assert (ticket.prompt_tokens, ticket.output_budget) == (50, 300)


async def test_over_the_tokens_limit_is_a_429_with_retry_after_and_rate_limit_headers() -> None:
    gate = gatekeeper()
    await gate.admit(ACME, [prep(100, 800)])
    with pytest.raises(RateLimited) as info:
        await gate.admit(ACME, [prep(100, 200, "r2")])
    err = info.value
    assert err.http_status == 429 and err.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(err.headers["Retry-After"]) >= 1
    assert err.headers["X-RateLimit-Limit-Tokens"] == "1000"
    assert err.headers["X-RateLimit-Remaining-Tokens"] == "100"
    assert err.limited_by == ("tokens",)


async def test_each_tenant_gets_its_own_prefix_cache_salt() -> None:
    gate = gatekeeper()
    a, b = prep(5, 5), prep(5, 5)
    a.cache_salt = b.cache_salt = "user-chosen"
    await gate.admit(ACME, [a])
    await gate.admit(OTHER, [b])
    assert "acme" in a.cache_salt and "other" in b.cache_salt and a.cache_salt != b.cache_salt
    assert a.cache_salt.endswith("user-chosen")


async def test_the_tenant_output_cap_rejects_explicit_and_clamps_default_budgets() -> None:
    gate = gatekeeper()
    explicit = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=50))
    with pytest.raises(InvalidRequest):
        gate.check_request(CAPPED, explicit)
    gate.check_request(CAPPED, router_pb2.GenerateRequest())  # unset: fine, clamped at admission
    p = prep(5, 4000)
    ticket = await gate.admit(CAPPED, [p])
    assert p.sampling.max_tokens == 10 and p.wire_sampling.max_tokens == 10 and ticket.output_budget == 10


async def test_finish_settles_and_meters_once_even_when_the_caller_is_cancelled() -> None:
    gate = gatekeeper()
    ticket = await gate.admit(ACME, [prep(10, 90)])

    async def request_that_is_cancelled() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await gate.finish(ticket, usage(10, 5, cached=4))

    task = asyncio.create_task(request_that_is_cancelled())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gate.drain()
    await gate.finish(ticket, usage(10, 90))  # a second finish changes nothing
    totals = await gate.meter.read(ACME)
    assert totals == {"requests": 1, "prompt_tokens": 10, "cached_prompt_tokens": 4, "completion_tokens": 5,
                      "reasoning_tokens": 0}
    nxt = await gate.admit(ACME, [prep(10, 10, "r2")])
    assert nxt.headers()["X-RateLimit-Remaining-Tokens"] == str(1000 - 15 - 20)


async def test_flags_build_a_redis_backed_gatekeeper_that_meters_into_redis(redis_url: str, key_file) -> None:
    parser = argparse.ArgumentParser()
    add_front_flags(parser)
    args = parser.parse_args(["--api-keys-file", str(key_file), "--redis-url", redis_url,
                              "--ratelimit-failure-mode", "closed"])
    gate = make_gatekeeper(FrontConfig.from_args(args))
    try:
        assert gate.limiter.backend == "redis"
        tenant = gate.authenticate("sk-flags")
        ticket = await gate.admit(tenant, [prep(10, 50, "flags-1")])
        assert ticket.headers()["X-RateLimit-Limit-Tokens"] == "1000"
        await gate.finish(ticket, usage(10, 3))
        totals = await gate.meter.read(tenant)
        assert totals["completion_tokens"] >= 3 and totals["requests"] >= 1
    finally:
        await close_gatekeeper(gate)
