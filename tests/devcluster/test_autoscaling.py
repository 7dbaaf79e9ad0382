"""Autoscaling on the dev cluster (the real operator; pods as processes with their own IPs), one cluster for the
module: 1 tokenizer, prefill autoscaled 1..3, decode autoscaled 0..3, 1 router.

- The prefill:decode balance, under open-loop load with SLO targets every request misses: many long answers to
  short prompts grow decode and never prefill (its TTFT misses beside a loaded decode, with nothing queued); a flood
  of long prompts with short answers grows prefill and never decode (its ITL misses beside the prompt flood).
  Every request gets its one answer.
- Scale to zero: decode with `minReplicas: 0` goes to zero pods when idle; a request arriving then is held by the
  router, which the operator sees (the router's held count) and starts a decode pod for; the request is served once
  the pod is ready.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from qwenserve_operator import autoscaler
from tests.support.devcluster import METRICS_PORT, DevCluster, example_deployment, netns_unavailable
from tests.support.metrics import scrape, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]
if (reason := netns_unavailable()) is not None:
    pytestmark.append(pytest.mark.skip(reason=reason))

DEPLOYMENT = "/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments/qwen-cpu"
# Targets no request of the tiny model meets through the cluster (its TTFT and ITL are milliseconds and more):
# every latency misses, and only the balance of the two stages' load says which stage grows.
TIGHT_SLO = {"ttftSeconds": 0.005, "interTokenLatencySeconds": 0.002, "quantile": 0.5}
OPERATOR_INTERVAL = 5  # `dev-cluster up`'s default --operator-interval
RELAXED_SLO = {"ttftSeconds": 2.0, "interTokenLatencySeconds": 0.2, "quantile": 0.9}


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    spec = example_deployment("network", {"tokenizer": 1, "prefill": 1, "decode": 1, "router": 1})
    stages = spec["spec"]["stages"]
    stages["prefill"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                                        "scaleDownStabilizationSeconds": 5, "maxScaleUpStep": 1}
    stages["decode"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 3,
                                       "scaleDownStabilizationSeconds": 120, "maxScaleUpStep": 1}
    # A prompt takes many small steps, so that a flood of them queues on prefill rather than on the router.
    stages["prefill"]["args"] = [*stages["prefill"]["args"], "--max-num-batched-tokens", "64"]
    spec["spec"]["coldStartTimeoutSeconds"] = 180
    cluster = DevCluster(spec, tmp_path_factory.mktemp("autoscaled-cluster"), tiny_model)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def _desired(cluster: DevCluster) -> dict[str, int]:
    stages = cluster.api(DEPLOYMENT).get("status", {}).get("stages", {})
    return {stage: int(stages.get(stage, {}).get("desiredReplicas", 0)) for stage in ("prefill", "decode")}


def _loads(cluster: DevCluster) -> dict[str, list[dict[str, float]]]:
    """Each prefill and decode pod's load gauges now, as the operator scrapes them."""
    loads: dict[str, list[dict[str, float]]] = {}
    for stage in ("prefill", "decode"):
        for pod in cluster.pods(stage):
            ip = pod.get("status", {}).get("podIP")
            try:
                with urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=5) as response:
                    metrics = autoscaler.parse_metrics(response.read().decode())
                loads.setdefault(stage, []).append({**metrics.gauges, "busy_seconds": metrics.busy_seconds or 0.0})
            except OSError:
                continue
    return loads


def _router_latency(router_ip: str) -> dict[str, autoscaler.Buckets]:
    with urllib.request.urlopen(f"http://{router_ip}:{METRICS_PORT}/metrics", timeout=10) as response:
        pod = autoscaler.parse_metrics(response.read().decode())
    return {"ttft": pod.histograms.get(autoscaler.TTFT, {}), "itl": pod.histograms.get(autoscaler.ITL, {})}


class OpenLoop:
    """Requests sent at a fixed rate whatever the answers' pace (an open loop), each to its one terminal message."""

    def __init__(self, address: str, rate: float, prompt_tokens: int, max_tokens: int, seed: int) -> None:
        self.address, self.rate, self.prompt_tokens, self.max_tokens = address, rate, prompt_tokens, max_tokens
        self.rng = random.Random(seed)
        self.finishes: list[int] = []
        self.errors: list[str] = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> OpenLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(240)
        assert not self._thread.is_alive(), "requests of the open loop still running after 240 s"

    async def _one(self, stub: router_pb2_grpc.RouterStub) -> None:
        request = router_pb2.GenerateRequest(
            prompt_token_ids=common_pb2.TokenIds(ids=[self.rng.randrange(0, 150_000)
                                                      for _ in range(self.prompt_tokens)]),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True))
        finishes = []
        try:
            async for message in stub.Generate(request, timeout=200):
                if message.finish_reason:
                    finishes.append(message.finish_reason)
        except grpc.aio.AioRpcError as error:
            self.errors.append(f"{error.code().name}: {error.details()}")
            return
        self.finishes.extend(finishes or [0])

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.address, options=[("grpc.enable_http_proxy", 0)]) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            tasks = []
            start = time.monotonic()
            while not self._stop.is_set():
                tasks.append(asyncio.create_task(self._one(stub)))
                self.sent += 1
                await asyncio.sleep(max(0.0, start + self.sent / self.rate - time.monotonic()))
            await asyncio.gather(*tasks)


def _phase(cluster: DevCluster, router_ip: str, load: OpenLoop, grows: str, holds: str,
           timeout: float) -> dict[str, Any]:
    """Runs `load` until the operator wants more `grows` replicas than at the start; `holds` must never want more.
    What the router measured meanwhile, and the replicas seen."""
    before, latency_before = _desired(cluster), _router_latency(router_ip)
    seen, loads = [before], [_loads(cluster)]
    with load:
        deadline = time.monotonic() + timeout
        while seen[-1][grows] <= before[grows] and time.monotonic() < deadline:
            time.sleep(0.5)
            seen.append(_desired(cluster))
            loads.append(_loads(cluster))
            if seen[-1][holds] > before[holds]:
                pytest.fail(f"{holds} grew under a load that is {grows}'s: replicas {seen}, the operator's reasons "
                            f"{json.dumps(cluster.api(DEPLOYMENT)['status']['stages'])}, the pods' loads {loads[-6:]}")
    assert seen[-1][grows] > before[grows], (f"{grows} did not grow within {timeout} s", seen)
    latency_after = _router_latency(router_ip)
    measured = {name: autoscaler.histogram_quantile(0.5, autoscaler.histogram_delta(latency_after[name],
                                                                                   latency_before[name]))
                for name in ("ttft", "itl")}
    assert not load.errors, load.errors[:5]
    assert load.finishes == [common_pb2.FINISH_REASON_LENGTH] * load.sent, load.finishes
    return {"replicas": seen, "latency": measured}


def test_decode_grows_when_itl_misses_beside_an_idle_prefill_and_prefill_when_ttft_misses_beside_an_idle_decode(
        cluster: DevCluster) -> None:
    cluster.api_write("PATCH", DEPLOYMENT, {"spec": {"slo": TIGHT_SLO, "stages": {
        "decode": {"autoscaling": {"scaleDownStabilizationSeconds": 120}}}}})
    (router,) = cluster.ready_pods("router", 1, timeout=60).values()

    # Many long answers to short prompts: decode is the loaded stage; prefill's TTFT misses beside it.
    answers = _phase(cluster, router, OpenLoop(cluster.grpc, rate=5, prompt_tokens=16, max_tokens=120, seed=1),
                     grows="decode", holds="prefill", timeout=90)
    assert answers["latency"]["ttft"] > TIGHT_SLO["ttftSeconds"], answers  # prefill would have grown on latency alone
    time.sleep(2 * OPERATOR_INTERVAL + 1)  # the operator's next latency reading starts after the answers' last

    # A flood of long prompts with short answers: prefill is the loaded stage; decode's ITL misses beside it.
    prompts = _phase(cluster, router, OpenLoop(cluster.grpc, rate=20, prompt_tokens=600, max_tokens=3, seed=2),
                     grows="prefill", holds="decode", timeout=90)
    assert prompts["latency"]["itl"] > TIGHT_SLO["interTokenLatencySeconds"], prompts

    cluster.api_write("PATCH", DEPLOYMENT, {"spec": {"slo": RELAXED_SLO}})


async def _answer(address: str) -> tuple[list[int], int, float]:
    request = router_pb2.GenerateRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=[9707, 1052, 374, 264]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    started, tokens, finish = time.monotonic(), [], 0
    async with grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        async for message in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=240):
            tokens.extend(message.token_ids)
            finish = message.finish_reason or finish
    return tokens, finish, time.monotonic() - started


def test_an_idle_decode_stage_goes_to_zero_and_a_request_brings_one_pod_back(cluster: DevCluster) -> None:
    cluster.api_write("PATCH", DEPLOYMENT, {"spec": {"slo": RELAXED_SLO, "stages": {
        "decode": {"autoscaling": {"scaleDownStabilizationSeconds": 5}}}}})
    (router,) = cluster.ready_pods("router", 1, timeout=60).values()
    cluster.ready_pods("decode", 0, timeout=150)  # idle for the stabilisation window: no decode pod left
    body = cluster.api(DEPLOYMENT)
    assert body["status"]["stages"]["decode"]["desiredReplicas"] == 0
    assert {c["type"]: c["status"] for c in body["status"]["conditions"]}["Ready"] == "True"  # idle is not down

    def cold_starts() -> float:
        return total(scrape(METRICS_PORT, router), "qwenserve_router_cold_starts_total", worker_stage="decode",
                     outcome="served")

    # Counted from here: under load the module's earlier test may have seen decode at zero and a request bring it back.
    before = cold_starts()
    tokens, finish, seconds = asyncio.run(_answer(cluster.grpc))
    assert finish == common_pb2.FINISH_REASON_LENGTH and len(tokens) == 8, (finish, tokens)
    assert cold_starts() - before == 1
    assert len(cluster.pods("decode")) == 1  # one pod, started for this request
