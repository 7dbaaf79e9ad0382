"""Metrics: vLLM's names, bounded labels, engine stats, stream timing, the /metrics HTTP server."""

from __future__ import annotations

import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qwenserve.telemetry import metrics
from qwenserve.telemetry.metrics import engine_metrics, handoff_metrics, router_metrics, tokenizer_metrics
from qwenserve.telemetry.metrics_server import MetricsServer


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not exposed"
    return value


def test_vllm_names_are_exported_with_a_model_name_label(registry):
    router, engine = router_metrics(registry), engine_metrics(registry)
    router.model_name = engine.model_name = "tiny-served"
    router.record_tokens("acme", prompt=1, completion=1)
    router.record_finished("ok", "stop")
    timer = router.stream_timer(arrived=0.0)
    timer.token(now=0.1), timer.token(now=0.2), timer.finish(now=0.3)
    engine.update_from_stats(_stats(prefix_cache_query_tokens=1, prefix_cache_hit_tokens=1))
    vllm = {
        f.name: (f.type, {s.labels.get("model_name") for s in f.samples})
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name.startswith("vllm:") and not f.name.endswith("_created")
    }
    # Names as vLLM's own /metrics page has them (counters without their _total suffix, as parsed).
    expected = {
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
    }
    assert {name: kind for name, (kind, _) in vllm.items()} == expected
    assert all(labels == {"tiny-served"} for _, labels in vllm.values())


def test_groups_are_created_once_per_registry(registry):
    assert router_metrics(registry) is router_metrics(registry)
    assert engine_metrics(registry) is engine_metrics(registry)
    other = CollectorRegistry()
    assert router_metrics(other) is not router_metrics(registry)
    router_metrics(other).record_retry("prefill")
    assert registry.get_sample_value("qwenserve_router_retries_total", {"stage": "prefill"}) is None
    # The process-wide registry also tolerates repeated lookups (services and tests share it).
    assert tokenizer_metrics() is tokenizer_metrics(REGISTRY)


def test_unknown_label_values_fold_into_other(registry):
    router = router_metrics(registry)
    router.record_finished("ok", "stop")
    router.record_finished("ok", "")
    router.record_finished("weird-outcome", "made-up-reason")
    router.record_ratelimit(allowed=False, limit="tokens")
    router.record_ratelimit(allowed=True, limit="tokens")
    handoff_metrics(registry).record_failure("carrier-pigeon", "lost")
    assert _value(registry, "qwenserve_router_requests_total", outcome="ok", finish_reason="stop") == 1
    assert _value(registry, "qwenserve_router_requests_total", outcome="ok", finish_reason="none") == 1
    assert _value(registry, "qwenserve_router_requests_total", outcome="other", finish_reason="other") == 1
    assert (
        _value(registry, "qwenserve_router_ratelimit_decisions_total", decision="rejected", limit="tokens")
        == 1
    )
    assert (
        _value(registry, "qwenserve_router_ratelimit_decisions_total", decision="allowed", limit="none") == 1
    )
    assert _value(registry, "qwenserve_handoff_failures_total", transport="other", reason="other") == 1


def test_tenant_label_is_capped(registry):
    router = metrics.RouterMetrics(registry, max_tenants=2)
    for tenant in ("acme", "globex", "initech", "umbrella", "acme"):
        router.record_tokens(tenant, prompt=10, cached=4, completion=3)
    assert _value(registry, "qwenserve_router_tokens_total", tenant="acme", kind="prompt") == 20
    assert _value(registry, "qwenserve_router_tokens_total", tenant="globex", kind="cached") == 4
    assert _value(registry, "qwenserve_router_tokens_total", tenant="other", kind="completion") == 6
    assert (
        registry.get_sample_value("qwenserve_router_tokens_total", {"tenant": "initech", "kind": "prompt"})
        is None
    )


def test_stream_timer_observes_ttft_gaps_and_end_to_end(registry):
    router = router_metrics(registry)
    router.model_name = "m"
    timer = router.stream_timer(arrived=100.0)
    for t in (100.25, 100.30, 100.40):
        timer.token(now=t)
    timer.finish(now=101.0)
    timer.finish(now=105.0)  # a second terminal path must not double count
    assert timer.first_token_at == 100.25
    assert _value(registry, "qwenserve_router_ttft_seconds_count") == 1
    assert _value(registry, "qwenserve_router_ttft_seconds_sum") == pytest.approx(0.25)
    assert _value(registry, "qwenserve_router_ttft_seconds_bucket", le="0.3") == 1
    assert _value(registry, "qwenserve_router_ttft_seconds_bucket", le="0.2") == 0
    assert _value(registry, "qwenserve_router_inter_token_latency_seconds_count") == 2
    assert _value(registry, "qwenserve_router_inter_token_latency_seconds_sum") == pytest.approx(0.15)
    assert _value(registry, "qwenserve_router_e2e_latency_seconds_count") == 1
    assert _value(registry, "qwenserve_router_e2e_latency_seconds_sum") == pytest.approx(1.0)
    # vLLM's histograms hold the same observations, per model.
    assert _value(registry, "vllm:time_to_first_token_seconds_sum", model_name="m") == pytest.approx(0.25)
    assert _value(registry, "vllm:time_to_first_token_seconds_count", model_name="m") == 1
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert _value(registry, f"{name}_count", model_name="m") == 2
        assert _value(registry, f"{name}_sum", model_name="m") == pytest.approx(0.15)
    assert _value(registry, "vllm:e2e_request_latency_seconds_count", model_name="m") == 1
    assert _value(registry, "vllm:e2e_request_latency_seconds_sum", model_name="m") == pytest.approx(1.0)


def test_vllm_token_counters_take_each_requests_usage_and_success_its_finish_reason(registry):
    router = router_metrics(registry)
    router.model_name = "m"
    router.record_tokens("acme", prompt=10, cached=4, completion=3)
    router.record_tokens("globex", prompt=7, completion=0)
    assert _value(registry, "vllm:prompt_tokens_total", model_name="m") == 17
    assert _value(registry, "vllm:generation_tokens_total", model_name="m") == 3
    for outcome, reason in (("ok", "stop"), ("ok", "tool_calls"), ("ok", "length"), ("cancelled", ""),
                            ("error", "error"), ("rejected", "none"), ("ok", "abort")):
        router.record_finished(outcome, reason)
    success = {
        reason: registry.get_sample_value("vllm:request_success_total", {"model_name": "m", "finished_reason": reason})
        for reason in ("stop", "length", "abort", "error", "none")
    }
    # A tool call ends as vLLM's "stop", a client that left as "abort"; failures are no success.
    assert success == {"stop": 2, "length": 1, "abort": 2, "error": None, "none": None}


def _stats(**overrides: object) -> SimpleNamespace:
    base = dict(
        running=3,
        waiting=5,
        kv_blocks_used=30,
        kv_blocks_free=90,
        kv_blocks_total=120,
        prefix_cache_hit_rate=0.4,
        prefix_cache_hit_tokens=40,
        prefix_cache_query_tokens=100,
        preemptions=2,
        prefill_only_steps=4,
    )
    return SimpleNamespace(**{**base, **overrides})


def test_engine_gauges_follow_stats_snapshots(registry):
    engine = engine_metrics(registry)
    engine.update_from_stats(_stats())
    assert _value(registry, "qwenserve_engine_running_requests") == 3
    assert _value(registry, "qwenserve_engine_waiting_requests") == 5
    assert _value(registry, "qwenserve_kv_blocks_used") == 30
    assert _value(registry, "qwenserve_kv_blocks_free") == 90
    assert _value(registry, "qwenserve_kv_blocks_usage_ratio") == pytest.approx(0.25)
    assert _value(registry, "qwenserve_prefix_cache_hit_ratio") == pytest.approx(0.4)
    assert _value(registry, "qwenserve_engine_preemptions_total") == 2
    assert _value(registry, "qwenserve_engine_prefill_only_steps_total") == 4

    engine.update_from_stats(
        _stats(running=0, kv_blocks_used=120, kv_blocks_free=0, preemptions=7, prefill_only_steps=9)
    )
    assert _value(registry, "qwenserve_engine_prefill_only_steps_total") == 9
    assert _value(registry, "qwenserve_engine_running_requests") == 0
    assert _value(registry, "qwenserve_kv_blocks_usage_ratio") == 1.0
    assert _value(registry, "qwenserve_engine_preemptions_total") == 7  # cumulative 2 -> 7 adds 5

    engine.update_from_stats(_stats(preemptions=1))  # the engine restarted its count
    assert _value(registry, "qwenserve_engine_preemptions_total") == 8


def test_vllm_engine_metrics_follow_the_same_snapshots_per_model(registry):
    engine = engine_metrics(registry)
    engine.model_name = "m"
    engine.update_from_stats(_stats())
    engine.update_from_stats(
        _stats(running=1, waiting=0, kv_blocks_used=60, prefix_cache_query_tokens=164, prefix_cache_hit_tokens=104,
               preemptions=3)
    )
    assert _value(registry, "vllm:num_requests_running", model_name="m") == 1
    assert _value(registry, "vllm:num_requests_waiting", model_name="m") == 0
    assert _value(registry, "vllm:kv_cache_usage_perc", model_name="m") == pytest.approx(0.5)
    # Cumulative token counts from the engine become counters that advance by each snapshot's difference.
    assert _value(registry, "vllm:prefix_cache_queries_total", model_name="m") == 164
    assert _value(registry, "vllm:prefix_cache_hits_total", model_name="m") == 104
    assert _value(registry, "vllm:num_preemptions_total", model_name="m") == 3
    assert _value(registry, "qwenserve_engine_preemptions_total") == 3


def test_engine_stats_may_omit_fields_and_ratio_survives_an_empty_pool(registry):
    engine = engine_metrics(registry)
    engine.update_from_stats(SimpleNamespace(running=1, waiting=0, kv_blocks_used=10, kv_blocks_free=30))
    assert _value(registry, "qwenserve_kv_blocks_usage_ratio") == pytest.approx(0.25)
    assert _value(registry, "qwenserve_engine_preemptions_total") == 0
    engine.update_from_stats(SimpleNamespace(kv_blocks_used=0, kv_blocks_free=0, kv_blocks_total=0))
    assert _value(registry, "qwenserve_kv_blocks_usage_ratio") == 0.0
    assert _value(registry, "qwenserve_engine_running_requests") == 1  # untouched by the second snapshot


def test_engine_step_handoff_and_tokenizer_recorders(registry):
    engine_metrics(registry).observe_step(batch_size=6, tokens=300, seconds=0.012)
    handoff = handoff_metrics(registry)
    handoff.record_transfer("shm", 1 << 20, 0.002)
    handoff.record_transfer("shm", 1 << 20, 0.004)
    handoff.leases_outstanding.inc()
    tokenizer_metrics(registry).record_rpc("TokenizeBatch", "OK", 0.003, texts=4, tokens=57)
    tokenizer_metrics(registry).record_rpc("Tokenize", "INVALID_ARGUMENT", 0.0001)
    assert _value(registry, "qwenserve_engine_batch_size_sum") == 6
    assert _value(registry, "qwenserve_engine_step_tokens_bucket", le="512.0") == 1
    assert _value(registry, "qwenserve_handoff_bytes_total", transport="shm") == 2 << 20
    assert _value(registry, "qwenserve_handoff_seconds_count", transport="shm") == 2
    assert _value(registry, "qwenserve_handoff_leases_outstanding") == 1
    assert _value(registry, "qwenserve_tokenizer_requests_total", rpc="TokenizeBatch", code="OK") == 1
    assert (
        _value(registry, "qwenserve_tokenizer_requests_total", rpc="Tokenize", code="INVALID_ARGUMENT") == 1
    )
    assert _value(registry, "qwenserve_tokenizer_texts_total") == 4
    assert _value(registry, "qwenserve_tokenizer_tokens_total") == 57


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_metrics_server_serves_parseable_metrics_and_probes(registry):
    router_metrics(registry).record_finished("ok", "length")
    state = {"ready": False}
    server = MetricsServer(0, "127.0.0.1", registry, ready=lambda: state["ready"])
    try:
        assert server.port > 0
        status, body = _get(f"{server.url}/metrics")
        assert status == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body)
            for s in family.samples
        }
        assert (
            samples[("qwenserve_router_requests_total", (("finish_reason", "length"), ("outcome", "ok")))]
            == 1
        )
        assert _get(f"{server.url}/healthz")[0] == 200
        assert _get(f"{server.url}/readyz")[0] == 503
        state["ready"] = True
        assert _get(f"{server.url}/readyz")[0] == 200
        server.live = lambda: False
        assert _get(f"{server.url}/healthz")[0] == 503
        assert _get(f"{server.url}/nope")[0] == 404
    finally:
        server.close()


def test_readiness_probe_that_raises_reports_not_ready(registry):
    def broken() -> bool:
        raise RuntimeError("health object gone")

    server = MetricsServer(0, "127.0.0.1", registry, ready=broken)
    try:
        assert _get(f"{server.url}/readyz")[0] == 503
    finally:
        server.close()


def test_the_public_view_leaves_out_every_tenant_labelled_metric_and_keeps_the_rest(registry):
    router = router_metrics(registry)
    router.record_tokens("acme", prompt=5, completion=2)
    router.record_finished("ok", "stop")
    full = generate_latest(registry).decode()
    public, _ = metrics.metrics_page(metrics.WithoutLabel(registry, metrics.TENANT_LABEL))
    assert 'tenant="acme"' in full
    families = {f.name: f for f in text_string_to_metric_families(public.decode())}
    assert not any("tenant" in s.labels for f in families.values() for s in f.samples)
    assert "qwenserve_router_tokens" not in families
    # Tier totals name no customer and stay, as do the request counters.
    assert families["qwenserve_router_tier_tokens"].samples
    assert families["qwenserve_router_requests"].samples
