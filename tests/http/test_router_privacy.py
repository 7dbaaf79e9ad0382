"""What the router tells a caller who is not the operator: the public /metrics names no tenant."""

from __future__ import annotations

import time

import openai

from qwenserve.launcher import LocalCluster
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
