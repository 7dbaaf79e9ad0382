"""What the router tells a caller who is not the operator: the public /metrics names no tenant, and GetStatus
shows where the workers are only to an admin key."""

from __future__ import annotations

import asyncio
import time

import openai

from qwenserve.launcher import LocalCluster
from qwenserve.v1 import router_pb2
from tests.support.clusters import router_stub
from tests.support.metrics import Samples, scrape, total


def _tenant_series(samples: Samples) -> set[str]:
    return {name for name, labels in samples if any(label == "tenant" for label, _ in labels)}


def test_public_metrics_name_no_tenant_while_the_metrics_port_keeps_them(base_url: str, cluster: LocalCluster) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="sk-acme", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt="Who may read my usage?", max_tokens=3, temperature=0)
    metrics_port = cluster.child("router").metrics_port
    deadline = time.monotonic() + 10  # usage is counted as the answer settles, right after it is sent
    while total(private := scrape(metrics_port), "qwenserve_router_tokens_total", tenant="acme") == 0:
        assert time.monotonic() < deadline, "the metrics port never counted acme's tokens"
        time.sleep(0.2)
    assert {"qwenserve_router_tokens_total", "qwenserve_tenant_tokens_total"} <= _tenant_series(private)
    public = scrape(cluster.http_port)
    assert _tenant_series(public) == set()
    assert total(public, "qwenserve_router_tier_tokens_total") > 0  # the rest of the page is still there


async def _status(cluster: LocalCluster, api_key: str) -> list[router_pb2.StageStatus]:
    channel, stub = router_stub(cluster)
    async with channel:
        reply = await stub.GetStatus(router_pb2.GetStatusRequest(), timeout=30,
                                     metadata=(("authorization", f"Bearer {api_key}"),))
    return list(reply.stages)


def test_only_an_admin_key_sees_where_the_workers_are(cluster: LocalCluster) -> None:
    admin, plain = asyncio.run(_status(cluster, "sk-ops")), asyncio.run(_status(cluster, "sk-acme"))
    addresses = {s.stage: s.address for s in admin}
    assert addresses == {c.name.split("-")[0]: c.address for c in cluster.children}
    assert all(s.metrics_address for s in admin)
    # The plain key gets the same rows, states and limits, and no address of any kind.
    assert [(s.stage, s.state, s.max_model_len) for s in plain] == [(s.stage, s.state, s.max_model_len) for s in admin]
    assert {(s.address, s.metrics_address) for s in plain} == {("", "")}
