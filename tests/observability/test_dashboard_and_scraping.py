"""The chart's Grafana dashboard and ServiceMonitor point at metrics and Services that really exist."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from qwenserve.telemetry.metrics import engine_metrics, handoff_metrics, router_metrics, tokenizer_metrics
from qwenserve_operator import crd, manifests

CHART = Path(__file__).resolve().parents[2] / "charts/qwen-serve"
DASHBOARD = CHART / "dashboards/qwen-serve.json"


def exported_names() -> set[str]:
    """Every sample name the services can export (histograms with their _bucket/_sum/_count)."""
    registry = CollectorRegistry()
    for group in (router_metrics, engine_metrics, handoff_metrics, tokenizer_metrics):
        group(registry)
    names = set()
    for family in registry.collect():
        kind = family.type
        names.add(family.name + ("_total" if kind == "counter" else ""))
        if kind == "histogram":
            names |= {f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
    return names


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values=values, name="qs", namespace="serving", is_install=True)
    return [doc for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def test_every_dashboard_query_uses_a_metric_the_services_export() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 20
    used = {name for expr in exprs for name in re.findall(r"\bqwenserve_[a-z0-9_]+", expr)}
    assert used - exported_names() == set()
    # The list: TTFT, inter-token latency, queue time, KV usage, handoff bytes/seconds, rate limits.
    for needed in ("qwenserve_router_ttft_seconds_bucket", "qwenserve_router_inter_token_latency_seconds_bucket",
                   "qwenserve_router_queue_time_seconds_bucket", "qwenserve_kv_blocks_usage_ratio",
                   "qwenserve_handoff_bytes_total", "qwenserve_handoff_seconds_bucket",
                   "qwenserve_router_ratelimit_decisions_total", "qwenserve_engine_waiting_requests"):
        assert needed in used, needed


def test_every_alert_uses_a_metric_the_services_export() -> None:
    (rule,) = [d for d in render({"monitoring": {"prometheusRule": {"enabled": True}}}) if d["kind"] == "PrometheusRule"]
    exprs = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
    used = {name for expr in exprs for name in re.findall(r"\bqwenserve_[a-z0-9_]+", expr)}
    assert len(used) >= 5
    assert used - exported_names() == set()


def test_monitoring_is_off_by_default() -> None:
    kinds = {doc["kind"] for doc in render({})}
    assert "ServiceMonitor" not in kinds
    assert not any(doc["kind"] == "ConfigMap" and "dashboard" in doc["metadata"]["name"] for doc in render({}))


def test_dashboard_config_map_carries_the_dashboard_for_the_grafana_sidecar() -> None:
    docs = render({"monitoring": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}}})
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    kubernetes_validate.validate(cm, "1.37.0", strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["qwen-serve.json"]) == json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("stage", ["tokenizer", "prefill", "decode", "router"])
def test_service_monitor_selects_every_stage_service_on_its_metrics_port(stage: str) -> None:
    values = {"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}},
              "operator": {"watchNamespaces": ["team-a", "team-b"]}}
    (monitor,) = [d for d in render(values) if d["kind"] == "ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    spec = crd.with_defaults({"model": {"name": "Qwen/Qwen3-0.6B"}})
    service = manifests.service("demo", "team-a", "uid-1", stage, spec)
    labels = service["metadata"]["labels"]
    selector = monitor["spec"]["selector"]
    assert selector["matchLabels"].items() <= labels.items()
    assert all(e["key"] in labels for e in selector["matchExpressions"] if e["operator"] == "Exists")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # And the pods are annotated for annotation-based scrapers, on the same port.
    pod = manifests.deployment("demo", "team-a", "uid-1", stage, spec, 1)["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    port = int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert port in {p["port"] for p in service["spec"]["ports"] if p["name"] == "metrics"}
