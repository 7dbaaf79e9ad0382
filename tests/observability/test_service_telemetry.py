"""Metrics, traces and status of a real cluster: the numbers match what the client saw."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from qwenserve.launcher import LocalCluster
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from qwenserve_operator import autoscaler
from tests.support.metrics import Samples, scrape, total
from tests.support.spans import ReceivedSpan, SpanReceiver

pytestmark = pytest.mark.timeout(180)

PROMPTS = [
    "Observability request one: tell me about paged attention.",
    "A second, different prompt about KV caches and prefix sharing across requests.",
    "Third: why do disaggregated serving stacks separate prefill from decode?",
]


class Streamed:
    """What one Generate call delivered to the client."""

    def __init__(self) -> None:
        self.tokens = 0
        self.token_messages = 0
        self.usage = common_pb2.Usage()
        self.finish = 0


async def generate(cluster: LocalCluster, prompt: str, request_id: str = "", max_tokens: int = 8) -> Streamed:
    out = Streamed()
    async with grpc.aio.insecure_channel(f"{cluster.host}:{cluster.router_port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            request_id=request_id, prompt=prompt,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
        async for msg in stub.Generate(request, timeout=60):
            out.tokens += len(msg.token_ids)
            out.token_messages += bool(msg.token_ids)
            if msg.finish_reason:
                out.finish = msg.finish_reason
                out.usage.CopyFrom(msg.usage)
    return out


def ports(cluster: LocalCluster) -> dict[str, int]:
    return {c.name.split("-")[0]: c.metrics_port for c in cluster.children}


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def wait_for_counter(port: int, name: str, expected: float, labels: dict[str, str], timeout_s: float = 5.0) -> Samples:
    """Scrape until `name` reaches `expected` (some counters settle just after the last message)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(port)
        if total(samples, name, **labels) >= expected or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


async def test_counters_and_histograms_move_by_what_the_requests_did(traced_cluster: LocalCluster) -> None:
    p = ports(traced_cluster)
    before = {stage: scrape(port) for stage, port in p.items()}
    results = [await generate(traced_cluster, prompt) for prompt in PROMPTS]
    n = len(results)
    streamed = sum(r.tokens for r in results)
    prompt_tokens = sum(r.usage.prompt_tokens for r in results)
    assert all(r.usage.completion_tokens == r.tokens for r in results)

    expected_ok = total(before["router"], "qwenserve_router_requests_total", outcome="ok") + n
    router = wait_for_counter(p["router"], "qwenserve_router_requests_total", expected_ok, {"outcome": "ok"})
    router = wait_for_counter(
        p["router"], "qwenserve_router_tokens_total",
        total(before["router"], "qwenserve_router_tokens_total", kind="completion") + streamed, {"kind": "completion"},
    )
    b = before["router"]
    assert delta(router, b, "qwenserve_router_requests_total", outcome="ok") == n
    assert delta(router, b, "qwenserve_router_tokens_total", kind="completion") == streamed
    assert delta(router, b, "qwenserve_router_tokens_total", kind="prompt") == prompt_tokens
    assert delta(router, b, "qwenserve_router_ttft_seconds_count") == n
    assert delta(router, b, "qwenserve_router_e2e_latency_seconds_count") == n
    assert delta(router, b, "qwenserve_router_queue_time_seconds_count") == n
    # One inter-token gap per token-carrying message after the first.
    gaps = sum(r.token_messages - 1 for r in results)
    assert delta(router, b, "qwenserve_router_inter_token_latency_seconds_count") == gaps
    assert delta(router, b, "qwenserve_router_ratelimit_decisions_total", decision="allowed") == n
    assert total(router, "qwenserve_router_in_flight_requests") == 0

    tokenizer = scrape(p["tokenizer"])
    b = before["tokenizer"]
    assert delta(tokenizer, b, "qwenserve_tokenizer_requests_total", rpc="Tokenize", code="OK") == n
    assert delta(tokenizer, b, "qwenserve_tokenizer_texts_total") == n
    assert delta(tokenizer, b, "qwenserve_tokenizer_tokens_total") == prompt_tokens
    assert delta(tokenizer, b, "qwenserve_tokenizer_latency_seconds_count", rpc="Tokenize") == n

    prefill, decode = scrape(p["prefill"]), scrape(p["decode"])
    handed_off = [r for r in results if r.tokens > 1]  # a first token that ends the request needs no handoff
    exported = delta(prefill, before["prefill"], "qwenserve_handoff_bytes_total", transport="shm")
    imported = delta(decode, before["decode"], "qwenserve_handoff_bytes_total", transport="shm")
    assert exported > 0 and exported == imported
    assert delta(prefill, before["prefill"], "qwenserve_handoff_seconds_count", transport="shm") == len(handed_off)
    assert delta(decode, before["decode"], "qwenserve_handoff_seconds_count", transport="shm") == len(handed_off)
    assert delta(decode, before["decode"], "qwenserve_handoff_failures_total") == 0

    # Prefill computes each prompt (less what the prefix cache held); decode computes every token
    # it was handed or generated except the last, which is sampled and never fed back.
    cached = sum(r.usage.cached_prompt_tokens for r in results)
    prefill_tokens = delta(prefill, before["prefill"], "qwenserve_engine_step_tokens_sum")
    assert prompt_tokens - cached <= prefill_tokens <= prompt_tokens
    decode_tokens = delta(decode, before["decode"], "qwenserve_engine_step_tokens_sum")
    assert decode_tokens == sum(r.tokens - 1 for r in handed_off)
    for stage, samples, b in (("prefill", prefill, before["prefill"]), ("decode", decode, before["decode"])):
        steps = delta(samples, b, "qwenserve_engine_step_seconds_count")
        assert steps >= 1
        assert delta(samples, b, "qwenserve_engine_batch_size_count") == steps
        assert total(samples, "qwenserve_kv_blocks_total") > 0
        # The load gauges are sampled twice a second: they settle back to idle shortly after.
        deadline = time.monotonic() + 3
        while total(scrape(p[stage]), "qwenserve_engine_running_requests") != 0:
            assert time.monotonic() < deadline, f"{stage} still reports running requests"
            time.sleep(0.1)


async def test_after_traffic_the_autoscaler_reads_every_signal_it_needs_from_the_pods(
    traced_cluster: LocalCluster,
) -> None:
    # The operator's own parser on real pages: a series renamed or dropped on either side fails here.
    await generate(traced_cluster, PROMPTS[0])
    p = ports(traced_cluster)

    def page(stage: str) -> autoscaler.PodMetrics:
        text = urllib.request.urlopen(f"http://127.0.0.1:{p[stage]}/metrics", timeout=5).read().decode()
        return autoscaler.parse_metrics(text)

    for stage in ("prefill", "decode"):
        assert set(page(stage).gauges) == {autoscaler.WAITING, autoscaler.RUNNING, autoscaler.KV_USAGE}, stage
    router = page("router")
    for name in autoscaler.HISTOGRAMS:
        assert autoscaler.histogram_quantile(0.5, router.histograms[name]) is not None, name
    assert router.held == {"decode": 0.0}


def _by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {s.span_id: s for s in spans}


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"expected one {service}/{name}, got {len(found)}"
    return found[0]


async def test_one_request_is_one_trace_across_every_hop(
    traced_cluster: LocalCluster, span_receiver: tuple[SpanReceiver, int]
) -> None:
    receiver, _ = span_receiver
    request_id = "trace-one-request"
    result = await generate(traced_cluster, "Follow this request through every service.", request_id, max_tokens=6)
    assert result.tokens > 1, "the request must go through a handoff to decode"

    wanted = {
        ("qwenserve-router", "router.request"), ("qwenserve-router", "tokenize"), ("qwenserve-router", "rate_limit"),
        ("qwenserve-router", "prefill"), ("qwenserve-router", "decode"),
        ("qwenserve-tokenizer", "tokenizer.Tokenize"),
        ("qwenserve-prefill", "prefill"), ("qwenserve-prefill", "prefill.queue"),
        ("qwenserve-prefill", "prefill.compute"), ("qwenserve-prefill", "handoff.export"),
        ("qwenserve-decode", "handoff"), ("qwenserve-decode", "decode"), ("qwenserve-decode", "decode.queue"),
        ("qwenserve-decode", "decode.first_token"), ("qwenserve-decode", "decode.stream"),
    }

    def mine(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.attributes.get("qwenserve.request_id") == request_id]

    spans = mine(receiver.wait_for(lambda all_: wanted <= {(s.service, s.name) for s in mine(all_)}))
    assert len({s.trace_id for s in spans}) == 1, "every span of the request belongs to one trace"
    trace_id = spans[0].trace_id
    trace = [s for s in receiver.snapshot() if s.trace_id == trace_id]
    by_id = _by_id(trace)
    roots = [s for s in trace if not s.parent_id]
    assert [(r.service, r.name) for r in roots] == [("qwenserve-router", "qwenserve.v1.Router/Generate")]
    assert all(s.parent_id in by_id for s in trace if s.parent_id), "no span points at a parent outside the trace"

    def parent(span: ReceivedSpan) -> ReceivedSpan:
        return by_id[span.parent_id]

    def ancestors(span: ReceivedSpan) -> list[str]:
        chain = []
        while span.parent_id:
            span = parent(span)
            chain.append(f"{span.service}:{span.name}")
        return chain

    request = _one(trace, "qwenserve-router", "router.request")
    for name in ("tokenize", "rate_limit", "prefill", "decode"):
        assert parent(_one(trace, "qwenserve-router", name)) == request
    # Each worker's spans hang under its gRPC server span, under the router's client span, under
    # the router's own span for that hop.
    tokenizer = _one(trace, "qwenserve-tokenizer", "tokenizer.Tokenize")
    assert ancestors(tokenizer)[:3] == [
        "qwenserve-tokenizer:qwenserve.v1.Tokenizer/Tokenize", "qwenserve-router:qwenserve.v1.Tokenizer/Tokenize",
        "qwenserve-router:tokenize",
    ]
    prefill = _one(trace, "qwenserve-prefill", "prefill")
    assert ancestors(prefill)[:3] == [
        "qwenserve-prefill:qwenserve.v1.Prefill/Prefill", "qwenserve-router:qwenserve.v1.Prefill/Prefill",
        "qwenserve-router:prefill",
    ]
    for name in ("prefill.queue", "prefill.compute", "handoff.export"):
        assert parent(_one(trace, "qwenserve-prefill", name)) == prefill
    decode = _one(trace, "qwenserve-decode", "decode")
    assert ancestors(decode)[:3] == [
        "qwenserve-decode:qwenserve.v1.Decode/Decode", "qwenserve-router:qwenserve.v1.Decode/Decode",
        "qwenserve-router:decode",
    ]
    handoff = _one(trace, "qwenserve-decode", "handoff")
    assert parent(handoff) == decode
    export = _one(trace, "qwenserve-prefill", "handoff.export")
    assert handoff.attributes["qwenserve.handoff.transport"] == "shm"
    assert handoff.attributes["qwenserve.handoff.bytes"] == export.attributes["qwenserve.handoff.bytes"] > 0
    # The precision of the weights on each side (per-stage precision); one model here, so they agree.
    weights = export.attributes["qwenserve.handoff.exporter_weights"]
    assert weights in ("float32", "bfloat16"), export.attributes
    assert handoff.attributes["qwenserve.handoff.exporter_weights"] == weights
    assert handoff.attributes["qwenserve.handoff.importer_weights"] == weights
    for name in ("decode.queue", "decode.first_token", "decode.stream"):
        assert parent(_one(trace, "qwenserve-decode", name)) == decode
    assert decode.attributes["qwenserve.completion_tokens"] == result.tokens - 1
    # The release of the handoff travels from decode back to prefill inside the same trace.
    assert any(s.service == "qwenserve-prefill" and s.name == "qwenserve.v1.KVTransfer/Release" for s in trace)


def test_every_service_is_live_and_ready(traced_cluster: LocalCluster) -> None:
    for child in traced_cluster.children:
        for path in ("/healthz", "/readyz"):
            reply = urllib.request.urlopen(f"http://127.0.0.1:{child.metrics_port}{path}", timeout=5)
            assert reply.status == 200, f"{child.name}{path}"


def test_status_prints_one_row_per_process(traced_cluster: LocalCluster) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "qwenserve.cli", "status", "--router", f"{traced_cluster.host}:{traced_cluster.router_port}"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split() == ["STAGE", "ADDRESS", "STATE", "RUN/WAIT", "KV", "USE", "TOK/S", "RESTARTS",
                                "PRECISION"]
    rows = {line.split()[1]: line.split(maxsplit=7) for line in lines[1:]}
    assert set(rows) == {c.address for c in traced_cluster.children}
    for child in traced_cluster.children:
        stage, _, state, run_wait, kv, tok_s, restarts, precision = rows[child.address]
        assert stage == child.name.split("-")[0] and state == "SERVING" and restarts == "0"
        # --dtype auto (the default) on a CPU with the C kernels: a bf16 KV cache, and bf16 weights and math where the
        # start-up probe found the bf16 weights faster, fp32 ones where not.
        engine_precisions = ("bfloat16", "weights=float32 kv=bfloat16 activations=float32")
        assert precision == "-" if stage in ("router", "tokenizer") else precision.startswith(engine_precisions)
        if stage in ("prefill", "decode"):
            running, waiting = run_wait.split("/")
            assert int(running) >= 0 and int(waiting) >= 0 and float(tok_s) >= 0
            assert 0 <= float(kv.rstrip("%")) <= 100 and kv.endswith("%")
        if stage == "router":
            assert int(run_wait.split("/")[0]) >= 0 and kv == "-" and float(tok_s) >= 0
        if stage == "tokenizer":
            assert run_wait == kv == tok_s == "-"


async def test_http_request_is_one_trace_and_its_log_lines_carry_its_ids(
    traced_cluster: LocalCluster, span_receiver: tuple[SpanReceiver, int]
) -> None:
    receiver, _ = span_receiver
    request_id = "http-trace-request-1"
    body = json.dumps({"model": traced_cluster.model.name, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hello over HTTP"}]}).encode()
    req = urllib.request.Request(
        f"http://{traced_cluster.host}:{traced_cluster.http_port}/v1/chat/completions", data=body,
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    reply = await asyncio.to_thread(urllib.request.urlopen, req, timeout=60)
    assert reply.status == 200 and reply.headers["X-Request-Id"] == request_id

    def mine(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.attributes.get("qwenserve.request_id") == request_id]

    wanted = {("qwenserve-router", "router.request"), ("qwenserve-tokenizer", "tokenizer.Tokenize"),
              ("qwenserve-decode", "decode")}
    spans = mine(receiver.wait_for(lambda all_: wanted <= {(s.service, s.name) for s in mine(all_)}))
    assert len({s.trace_id for s in spans}) == 1
    roots = [s for s in spans if not s.parent_id]
    assert [(r.service, r.name) for r in roots] == [("qwenserve-router", "POST /v1/chat/completions")]

    assert traced_cluster.log_dir is not None
    log_text = (traced_cluster.log_dir / "router.log").read_text()
    lines = [line for line in log_text.splitlines() if f"rid={request_id} " in line]
    assert lines, "the router logged nothing for the request"
    assert all(f"trace={spans[0].trace_id}]" in line for line in lines)
