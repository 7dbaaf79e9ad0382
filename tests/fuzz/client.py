"""What the fuzz properties share: the time a request may take, Hypothesis's settings, one client for every
example of a module, a tally of how examples were answered, and the check that the cluster still serves."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp
import grpc
from hypothesis import HealthCheck, Phase, settings

from qwenserve.default_model import TINY_CONFIG
from qwenserve.v1 import router_pb2, router_pb2_grpc
from tests.support.answers import Answer, grpc_generate, http_post
from tests.support.deployment import Deployment

# Every request must reach its terminal event within this, plus SECONDS_PER_TOKEN for each token it may
# generate: a long generation on a loaded machine is not a hang.
REQUEST_BOUND_S = 20.0
SECONDS_PER_TOKEN = 0.1
# Tokens per KV block on CPU, and the KV bytes of one token of the tiny model (float32 K and V).
BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = (2 * 4 * TINY_CONFIG["num_hidden_layers"] * TINY_CONFIG["num_key_value_heads"]
                      * TINY_CONFIG["head_dim"])
SOAK_EXAMPLES = int(os.environ.get("QWENSERVE_FUZZ_EXAMPLES", "0"))

T = TypeVar("T")


def request_bound(max_new_tokens: int) -> float:
    """The time within which a request that may generate `max_new_tokens` tokens must end."""
    return REQUEST_BOUND_S + SECONDS_PER_TOKEN * max_new_tokens


def fuzz_settings(ci_examples: int) -> settings:
    """Hypothesis settings for a property that runs real requests: `ci_examples` fixed examples in CI."""
    phases = [Phase.explicit, Phase.generate]
    if os.environ.get("QWENSERVE_FUZZ_SHRINK") == "1":
        phases.append(Phase.shrink)
    return settings(
        max_examples=SOAK_EXAMPLES or ci_examples,
        deadline=None,
        derandomize=not SOAK_EXAMPLES,
        database=None,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.large_base_example, HealthCheck.filter_too_much,
                               HealthCheck.function_scoped_fixture],
        print_blob=True,
    )


class FuzzClient:
    """One event loop, one HTTP session and one gRPC channel for every example of a module."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.loop = asyncio.new_event_loop()

        async def connect() -> tuple[aiohttp.ClientSession, grpc.aio.Channel]:
            # A connection per request: a server that breaks one connection cannot spoil the next example.
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
            return session, grpc.aio.insecure_channel(deployment.grpc_address)

        self.session, self.channel = self.run(connect())
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    def post(self, path: str, body: bytes, headers: dict[str, str], bound_s: float = REQUEST_BOUND_S
             ) -> Answer:
        url = self.deployment.http_base + path
        return self.run(http_post(self.session, url, body, headers, bound_s))

    def generate(self, request: router_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...],
                 bound_s: float = REQUEST_BOUND_S) -> Answer:
        return self.run(grpc_generate(self.stub, request, metadata, bound_s))

    def close(self) -> None:
        self.run(self.session.close())
        self.run(self.channel.close())
        self.loop.close()


class Tally:
    """How a property's examples were answered, by status. A fuzz whose examples are all refused at the door
    tests only the door: `check_reach` wants a share of them accepted, and a share refused."""

    def __init__(self) -> None:
        self.statuses: Counter[str] = Counter()
        self.slowest: list[tuple[float, str]] = []

    def add(self, answer: Answer, request: object) -> None:
        self.statuses[answer.status] += 1
        self.slowest = sorted([*self.slowest, (answer.elapsed_s, f"{answer.status}: {str(request)[:160]!r}")],
                              reverse=True)[:3]

    def check_reach(self, min_share: float = 0.1) -> None:
        total = sum(self.statuses.values())
        accepted = sum(n for status, n in self.statuses.items() if status == "OK" or status.startswith("2"))
        print(f"answers by status: {dict(self.statuses.most_common())}; slowest: {self.slowest}")
        assert accepted >= min_share * total, f"only {accepted} of {total} examples were accepted"
        assert total - accepted >= min_share * total, f"only {total - accepted} of {total} were refused"


def assert_still_serving(deployment: Deployment) -> None:
    """After a property's examples: every stage healthy on every surface, and a normal request served."""
    assert not deployment.health_problems(), deployment.health_problems()
    failures = deployment.canary_failures()
    assert not failures, f"a normal request failed after the fuzzing: {failures}"
