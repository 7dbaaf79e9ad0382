"""Scale to zero on the dev cluster (real operator, pods as processes with their own IPs): decode with
`minReplicas: 0` goes to zero pods when idle; a request arriving then is held by the router, which the operator
sees (the router's held count) and starts a decode pod for; the request is served once the pod is ready."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.devcluster import METRICS_PORT, DevCluster, example_deployment, netns_unavailable
from tests.support.metrics import scrape, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
if (reason := netns_unavailable()) is not None:
    pytestmark.append(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def idle_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    spec = example_deployment("network", {"tokenizer": 1, "prefill": 1, "decode": 1, "router": 1})
    spec["spec"]["stages"]["decode"]["autoscaling"] = {
        "enabled": True, "minReplicas": 0, "maxReplicas": 1, "scaleDownStabilizationSeconds": 5}
    spec["spec"]["coldStartTimeoutSeconds"] = 180
    cluster = DevCluster(spec, tmp_path_factory.mktemp("idle-cluster"), tiny_model)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


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


def test_an_idle_decode_stage_goes_to_zero_and_a_request_brings_one_pod_back(idle_cluster: DevCluster) -> None:
    cluster = idle_cluster
    (router,) = cluster.ready_pods("router", 1, timeout=60).values()
    cluster.ready_pods("decode", 0, timeout=150)  # idle for the stabilisation window: no decode pod left
    body = cluster.api("/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments/qwen-cpu")
    assert body["status"]["stages"]["decode"]["desiredReplicas"] == 0
    assert {c["type"]: c["status"] for c in body["status"]["conditions"]}["Ready"] == "True"  # idle is not down

    tokens, finish, seconds = asyncio.run(_answer(cluster.grpc))
    assert finish == common_pb2.FINISH_REASON_LENGTH and len(tokens) == 8, (finish, tokens)
    cold_starts = total(scrape(METRICS_PORT, router), "qwenserve_router_cold_starts_total", worker_stage="decode",
                        outcome="served")
    assert cold_starts == 1
    assert len(cluster.pods("decode")) == 1  # one pod, started for this request
