"""One real cluster per fuzz module, one client for all its examples, and the examples' budget.

The cluster is small (tokenizer, one prefill, one decode, router; one thread each), needs an API key,
and its KV pool holds fewer tokens than the model's context. Before each test it is brought back to
life if an earlier test broke it.

CI runs a fixed, derandomized set of examples (the whole suite in about two minutes). For a longer
hand run, QWENSERVE_FUZZ_EXAMPLES sets the examples of every property and draws fresh ones each run
(QWENSERVE_FUZZ_SHRINK=1 also shrinks a failure to a minimal example, at some minutes' cost):

    QWENSERVE_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/fuzz -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import grpc
import pytest
from hypothesis import HealthCheck, Phase, settings

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.launcher import LocalCluster
from qwenserve.v1 import router_pb2, router_pb2_grpc
from tests.fuzz.answers import Answer, grpc_generate, http_post
from tests.fuzz.deployment import Deployment
from tests.fuzz.strategies import API_KEY, CONTEXT, MODEL_NAME, POOL_TOKENS

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


@pytest.fixture(scope="session")
def fuzz_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {**TINY_CONFIG, "max_position_embeddings": CONTEXT}
    return write_checkpoint(tmp_path_factory.mktemp("fuzz-model") / MODEL_NAME, config, seed=11)


@pytest.fixture(scope="module")
def deployment(fuzz_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Tokenizer, one prefill, one decode and the router, with an API key and a KV pool of POOL_TOKENS."""
    env = {
        "QWENSERVE_THREADS": "1",
        "QWENSERVE_KV_CACHE_GB": repr(POOL_TOKENS * KV_BYTES_PER_TOKEN / 2**30),  # exact: a power of two
        "QWENSERVE_KV_POOL_MIB": "16",
        "QWENSERVE_API_KEYS": f"{API_KEY}:fuzz",
    }
    cluster = LocalCluster(model=fuzz_model, env=env, log_dir=tmp_path_factory.mktemp("fuzz-logs"))
    with cluster:
        running = Deployment(cluster, MODEL_NAME, API_KEY)
        _check_pool(running)
        yield running


def _check_pool(deployment: Deployment) -> None:
    """The strategies' POOL_TOKENS must be the pool the engines really have."""
    deadline = time.monotonic() + 10
    while (blocks := deployment.samples("decode-0").get("qwenserve_kv_blocks_total", 0)) == 0:
        assert time.monotonic() < deadline, "decode-0 never published qwenserve_kv_blocks_total"
        time.sleep(0.2)
    assert blocks * BLOCK_SIZE == POOL_TOKENS, f"decode's pool has {blocks} blocks, not {POOL_TOKENS} tokens"


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> Iterator[FuzzClient]:
    fuzz_client = FuzzClient(deployment)
    yield fuzz_client
    fuzz_client.close()


@pytest.fixture(autouse=True)
def serving(deployment: Deployment) -> Deployment:
    """Each test starts on a cluster that serves, whatever the previous one did to it."""
    deployment.ensure_serving()
    return deployment


def assert_still_serving(deployment: Deployment) -> None:
    """After a property's examples: every stage healthy on every surface, and a normal request served."""
    assert not deployment.health_problems(), deployment.health_problems()
    failures = deployment.canary_failures()
    assert not failures, f"a normal request failed after the fuzzing: {failures}"
