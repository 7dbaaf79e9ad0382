"""Capacity agrees with itself: engines whose KV cache holds fewer tokens than the model's positions serve a
lower max_model_len, every surface advertises it, and a request one token over is refused by the router before
any worker sees it; an explicit --max-model-len the KV cache cannot hold stops the stage with one line."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from qwenserve.launcher import LocalCluster
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.clusters import make_cluster

KV_TOKENS = 320  # 20 blocks of 16 tokens; the tiny model has 1,024 positions
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers x (K, V) x kv heads x head_dim x fp32
KV_CACHE_GB = str(KV_TOKENS * KV_BYTES_PER_TOKEN / 2**30)


@pytest.fixture(scope="module")
def small_kv_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with make_cluster(tiny_model, tmp_path_factory.mktemp("capacity"), prefill=1, decode=1,
                      env={"QWENSERVE_KV_CACHE_GB": KV_CACHE_GB}) as cluster:
        yield cluster


def _http(cluster: LocalCluster, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def _grpc(cluster: LocalCluster, call: str, request: object) -> object:
    async with grpc.aio.insecure_channel(f"{cluster.host}:{cluster.router_port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        if call == "Generate":
            return [msg async for msg in stub.Generate(request, timeout=30)]
        return await getattr(stub, call)(request, timeout=30)


def _tokens(n: int, max_tokens: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[(7 * i) % 900 + 5 for i in range(n)]))
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = 0.0
    return req


@contextmanager
def _workers_stopped(cluster: LocalCluster) -> Iterator[None]:
    """Prefill and decode frozen: any call to them would hang, so an answer proves none was made."""
    workers = [c.process for c in cluster.children if c.name.startswith(("prefill", "decode"))]
    for process in workers:
        process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        yield
    finally:
        for process in workers:
            process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]


def test_engines_lower_a_derived_max_model_len_to_their_kv_cache_with_one_warning(
    small_kv_cluster: LocalCluster
) -> None:
    log_dir = small_kv_cluster.log_dir
    assert log_dir is not None
    for stage in ("prefill-0", "decode-0"):
        lines = (log_dir / f"{stage}.log").read_text().splitlines()
        lowered = [line for line in lines if "max_model_len lowered" in line]
        assert len(lowered) == 1 and f"from 1024 to {KV_TOKENS}" in lowered[0], lowered


def test_every_surface_advertises_the_effective_limit(small_kv_cluster: LocalCluster) -> None:
    status, models = _http(small_kv_cluster, "/v1/models")
    assert status == 200 and [m["max_model_len"] for m in models["data"]] == [KV_TOKENS]
    listed = asyncio.run(_grpc(small_kv_cluster, "ListModels", router_pb2.ListModelsRequest()))
    assert [m.max_model_len for m in listed.models] == [KV_TOKENS]  # type: ignore[attr-defined]
    stages = asyncio.run(_grpc(small_kv_cluster, "GetStatus", router_pb2.GetStatusRequest())).stages  # type: ignore[attr-defined]
    limits = {s.stage: s.max_model_len for s in stages if s.stage != "tokenizer"}
    assert limits == {"router": KV_TOKENS, "prefill": KV_TOKENS, "decode": KV_TOKENS}


def test_a_prompt_of_the_limit_less_one_is_served_and_one_over_is_refused_before_any_worker_call(
    small_kv_cluster: LocalCluster
) -> None:
    served = asyncio.run(_grpc(small_kv_cluster, "Generate", _tokens(KV_TOKENS - 1, 1)))
    assert served[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # type: ignore[index]
    assert served[-1].usage.prompt_tokens == KV_TOKENS - 1  # type: ignore[index]
    status, reply = _http(small_kv_cluster, "/v1/completions",
                          {"prompt": list(_tokens(KV_TOKENS - 1, 1).prompt_token_ids.ids), "max_tokens": 1})
    assert status == 200 and reply["usage"]["completion_tokens"] == 1, reply
    over = list(_tokens(KV_TOKENS, 1).prompt_token_ids.ids)
    with _workers_stopped(small_kv_cluster):
        started = time.monotonic()
        status, reply = _http(small_kv_cluster, "/v1/completions", {"prompt": over, "max_tokens": 1})
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        assert str(KV_TOKENS) in reply["error"]["message"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(_grpc(small_kv_cluster, "Generate", _tokens(KV_TOKENS, 1)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert str(KV_TOKENS) in (refused.value.details() or "")
        # A stopped worker never answers: only the router can have, at once.
        assert time.monotonic() - started < 10


def test_an_explicit_max_model_len_the_kv_cache_cannot_hold_stops_the_stage_with_one_line(tiny_model: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "qwenserve.cli", "serve", "decode", "--model", str(tiny_model), "--port", "0",
         "--max-model-len", "1000", "--kv-cache-gb", KV_CACHE_GB, "--threads", "1", "--dtype", "float32"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "cannot start" in line]
    assert len(errors) == 1, result.stderr
    assert "1000" in errors[0] and f"holds {KV_TOKENS} tokens" in errors[0] and "--kv-cache-gb" in errors[0]
