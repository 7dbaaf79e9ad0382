"""vLLM's metric names on a real cluster: the router's HTTP port serves them with the served model's name,
tokens and latencies match what the requests reported, and the engines' prefix-cache counters move on a hit."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial

import pytest

from qwenserve.launcher import LocalCluster
from tests.support.checkpoints import tiny_checkpoint
from tests.support.clusters import make_cluster
from tests.support.metrics import Samples, scrape, total

pytestmark = pytest.mark.timeout(240)

SERVED = "tiny-served"
# Long enough to fill several KV blocks, so asking again finds whole blocks in the prefix cache.
REPEATED = "Prefix caching keeps the KV of a prompt it has seen; " * 6
OTHER = "A different prompt about disaggregated prefill and decode."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Tokenizer, prefill, decode and router, every stage told the served model name."""
    model = tiny_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-vllm-names", seed=5)
    with make_cluster(
        model, tmp_path_factory.mktemp("vllm-names"), prefill=1, decode=1,
        extra_router_args=["--model-name", SERVED], extra_worker_args=["--served-model-name", SERVED],
    ) as c:
        yield c


def complete(cluster: LocalCluster, prompt: str) -> dict[str, int]:
    """One /v1/completions call; the usage it reported."""
    body = json.dumps({"model": SERVED, "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://{cluster.host}:{cluster.http_port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())["usage"]


def metrics_port(cluster: LocalCluster, stage: str) -> int:
    return next(c.metrics_port for c in cluster.children if c.name.split("-")[0] == stage)


def settled(read: Callable[[], Samples], ready: Callable[[Samples], bool], timeout_s: float = 5.0) -> Samples:
    """Scrape until `ready` holds (engine counters follow a 0.5 s publisher); the last scrape otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = read()
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_router_http_port_serves_vllm_token_counters_and_latencies_per_served_model(cluster: LocalCluster) -> None:
    http = partial(scrape, cluster.http_port)  # the router's OpenAI port, not its metrics port
    before = http()
    usages = [complete(cluster, prompt) for prompt in (REPEATED, OTHER, REPEATED)]
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert prompt_tokens > 0 and generated > 0

    def moved(name: str, samples: Samples, **labels: str) -> float:
        return total(samples, name, model_name=SERVED, **labels) - total(before, name, model_name=SERVED, **labels)

    after = settled(http, lambda s: moved("vllm:e2e_request_latency_seconds_count", s) >= len(usages))
    assert moved("vllm:prompt_tokens_total", after) == prompt_tokens
    assert moved("vllm:generation_tokens_total", after) == generated
    assert moved("vllm:time_to_first_token_seconds_count", after) == len(usages)
    assert moved("vllm:e2e_request_latency_seconds_count", after) == len(usages)
    assert moved("vllm:request_success_total", after) == len(usages)
    gaps = moved("vllm:inter_token_latency_seconds_count", after)
    assert gaps >= 1 and moved("vllm:time_per_output_token_seconds_count", after) == gaps
    # Every vLLM sample carries the served name, and the separate metrics port still serves the same registry.
    assert {dict(labels).get("model_name") for (name, labels) in after if name.startswith("vllm:")} == {SERVED}
    on_metrics_port = scrape(metrics_port(cluster, "router"))
    assert total(on_metrics_port, "vllm:prompt_tokens_total", model_name=SERVED) == total(
        after, "vllm:prompt_tokens_total", model_name=SERVED
    )


def test_engines_export_running_waiting_and_prefix_cache_counters_that_move_on_a_hit(cluster: LocalCluster) -> None:
    prefill = partial(scrape, metrics_port(cluster, "prefill"))
    decode = partial(scrape, metrics_port(cluster, "decode"))
    for samples in (prefill(), decode()):
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert (gauge, frozenset({("model_name", SERVED)})) in samples, gauge

    def counts(samples: Samples) -> tuple[float, float]:
        return (total(samples, "vllm:prefix_cache_queries_total", model_name=SERVED),
                total(samples, "vllm:prefix_cache_hits_total", model_name=SERVED))

    prompt = "Asked twice in this test only. " + REPEATED  # a start no other request had
    time.sleep(1.0)  # two publishing intervals: earlier requests are in the baseline
    queries0, hits0 = counts(prefill())
    decode_before = counts(decode())
    first = complete(cluster, prompt)["prompt_tokens"]
    queries1, hits1 = counts(settled(prefill, lambda s: counts(s)[0] >= queries0 + first))
    assert (queries1 - queries0, hits1 - hits0) == (first, 0)  # a new prompt: looked up, nothing found

    again = complete(cluster, prompt)["prompt_tokens"]
    queries2, hits2 = counts(settled(prefill, lambda s: counts(s)[0] >= queries1 + again))
    assert queries2 - queries1 == again
    assert 0 < hits2 - hits1 < again  # whole blocks of the repeated prompt; its last token is always computed
    # The prompts were prefilled on the prefill stage: their KV reached decode without a lookup there.
    time.sleep(1.0)  # two of decode's publishing intervals
    assert counts(decode()) == decode_before
