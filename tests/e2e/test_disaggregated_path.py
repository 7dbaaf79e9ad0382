"""The whole path in real processes: disaggregated == local prefill == in-process engine; no leaks."""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.host_memory import PREFAULT_THREAD
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.launcher import LocalCluster
from qwenserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
)
from tests.support.clusters import WORKER_ENV, router_stub
from tests.support.metrics import metric
from tests.support.ports import free_port

MAX_TOKENS = 12


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 150_000) for _ in range(rng.choice([3, 17, 40, 90, 200]))] for _ in range(n)]


def _request(ids: list[int], max_tokens: int = MAX_TOKENS, **sampling: object) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(prompt_token_ids=router_pb2.GenerateRequest().prompt_token_ids)
    req.prompt_token_ids.ids.extend(ids)
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = sampling.pop("temperature", 0.0)  # type: ignore[assignment]
    req.sampling.ignore_eos = True
    for key, value in sampling.items():
        setattr(req.sampling, key, value)
    return req


async def _generate(address: str, ids: list[int], **kw: object) -> tuple[list[int], list[router_pb2.GenerateResponse]]:
    async with grpc.aio.insecure_channel(address) as channel:
        from qwenserve.v1 import router_pb2_grpc

        msgs = [m async for m in router_pb2_grpc.RouterStub(channel).Generate(_request(ids, **kw))]
    return [t for m in msgs for t in m.token_ids], msgs


def _reference(model: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    # The workers' precision (WORKER_ENV): under `auto` a start-up probe picks bf16 or fp32 for the tiny model by a
    # few microseconds either way, and the tokens of the two differ.
    engine = LLMEngine.from_pretrained(model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1,
                                                           dtype=WORKER_ENV["QWENSERVE_DTYPE"]))
    try:
        return engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        engine.shutdown()


def test_greedy_tokens_are_identical_disaggregated_local_and_in_process(
    cluster: LocalCluster, tiny_model: Path, tmp_path: Path
) -> None:
    prompts = _prompts(8)
    address = f"{cluster.host}:{cluster.router_port}"

    async def run_all(addr: str) -> list[list[int]]:
        results = await asyncio.gather(*[_generate(addr, p) for p in prompts])
        for _, msgs in results:
            assert sum(1 for m in msgs if m.finish_reason) == 1 and msgs[-1].finish_reason
        return [tokens for tokens, _ in results]

    disaggregated = asyncio.run(run_all(address))
    # A second router over the same workers that never uses prefill workers.
    port = free_port()
    router = cluster.child("router")
    argv = [a for a in router.argv]
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--http-port") + 1] = "0"
    if "--metrics-port" in argv:  # the first router holds that port
        argv[argv.index("--metrics-port") + 1] = "0"
    local_router = subprocess.Popen([*argv, "--local-prefill-threshold", "100000"])
    try:
        helper = LocalCluster(model=tiny_model)
        helper.children = [type(router)("router-local", f"127.0.0.1:{port}", argv, 0, local_router)]
        helper.wait_healthy(60)
        local = asyncio.run(run_all(f"127.0.0.1:{port}"))
    finally:
        local_router.terminate()
        local_router.wait(10)
    assert disaggregated == local
    assert disaggregated == _reference(tiny_model, prompts)
    assert all(len(t) == MAX_TOKENS for t in disaggregated)


def test_prefill_runs_at_a_lower_cpu_priority_than_decode_and_router(cluster: LocalCluster) -> None:
    """Every thread of a prefill process (its engine and torch's pool, started after exec) inherits the nice
    value; decode and the router keep the launcher's. The KV prefault's thread, which runs at nice 19 in either
    engine and may still be waiting for idle cores, is the exception."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    for child in cluster.children:
        pid = child.process.pid
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task") if _comm(pid, t) not in (PREFAULT_THREAD, "")]
        expected = base + cluster.prefill_nice if child.name.startswith("prefill") else base
        assert cluster.prefill_nice == 10 and len(threads) > 1
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {min(expected, 19)}, child.name


def _comm(pid: int, thread: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{thread}/comm") as f:
            return f.read().strip()
    except OSError:  # ended meanwhile: skipped
        return ""


def test_usage_and_a_single_terminal_message(cluster: LocalCluster) -> None:
    tokens, msgs = asyncio.run(_generate(f"{cluster.host}:{cluster.router_port}", list(range(100, 150))))
    last = msgs[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == 50 and last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.total_tokens == 50 + MAX_TOKENS
    assert all(not m.finish_reason for m in msgs[:-1])


def test_seeded_sampling_is_reproducible_through_the_stack(cluster: LocalCluster) -> None:
    address = f"{cluster.host}:{cluster.router_port}"
    ids = list(range(2000, 2030))
    runs = [asyncio.run(_generate(address, ids, temperature=1.0, seed=1234))[0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_cancelling_a_stream_frees_decode_blocks_and_the_prefill_lease(cluster: LocalCluster) -> None:
    async def cancel_midway() -> None:
        channel, stub = router_stub(cluster)
        async with channel:
            call = stub.Generate(_request(list(range(300, 400)), max_tokens=800))
            received = 0
            async for msg in call:
                received += len(msg.token_ids)
                if received >= 5:
                    call.cancel()
                    break

    asyncio.run(cancel_midway())
    deadline = time.monotonic() + 10
    decodes = [c for c in cluster.children if c.name.startswith("decode")]
    prefills = [c for c in cluster.children if c.name.startswith("prefill")]
    while time.monotonic() < deadline:
        used = sum(metric(c.metrics_port, "qwenserve_kv_blocks_used") for c in decodes)
        leases = sum(metric(c.metrics_port, "qwenserve_handoff_leases_outstanding") for c in prefills)
        running = sum(metric(c.metrics_port, "qwenserve_engine_running_requests") for c in decodes)
        if used == 0 and leases == 0 and running == 0:
            break
        time.sleep(0.2)
    assert (used, leases, running) == (0, 0, 0)


def test_a_lease_never_acknowledged_is_reclaimed(cluster: LocalCluster) -> None:
    prefill = next(c for c in cluster.children if c.name.startswith("prefill"))

    async def prefill_only() -> prefill_pb2.PrefillResponse:
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            req = prefill_pb2.PrefillRequest(request_id="orphan", prompt_token_ids=list(range(10, 60)))
            req.sampling.temperature = 0.0
            req.sampling.max_tokens = 5
            return await prefill_pb2_grpc.PrefillStub(channel).Prefill(req)

    before = metric(prefill.metrics_port, "qwenserve_handoff_leases_reclaimed_total")
    resp = asyncio.run(prefill_only())
    assert resp.kv_handle.handoff_id
    deadline = time.monotonic() + 10  # the cluster's leases last 2 s
    while time.monotonic() < deadline:
        if metric(prefill.metrics_port, "qwenserve_handoff_leases_reclaimed_total") > before:
            break
        time.sleep(0.2)
    assert metric(prefill.metrics_port, "qwenserve_handoff_leases_reclaimed_total") == before + 1
    assert metric(prefill.metrics_port, "qwenserve_handoff_leases_outstanding") == 0


async def _prefill_then_decode(cluster: LocalCluster, tamper: str) -> grpc.StatusCode:
    prefill = next(c for c in cluster.children if c.name.startswith("prefill"))
    decode = next(c for c in cluster.children if c.name.startswith("decode"))
    prompt = list(range(500, 540))
    async with grpc.aio.insecure_channel(prefill.address) as pch, grpc.aio.insecure_channel(decode.address) as dch:
        req = prefill_pb2.PrefillRequest(request_id=f"tamper-{tamper}", prompt_token_ids=prompt)
        req.sampling.temperature = 0.0
        req.sampling.max_tokens = 5
        resp = await prefill_pb2_grpc.PrefillStub(pch).Prefill(req)
        handle = resp.kv_handle
        if tamper == "byte":
            with open(f"/dev/shm/{handle.location}", "r+b") as f:
                f.seek(handle.offset + handle.length // 2)
                byte = f.read(1)
                f.seek(handle.offset + handle.length // 2)
                f.write(bytes([byte[0] ^ 0x40]))
        else:
            handle.layout.num_layers += 1
        dreq = decode_pb2.DecodeRequest(request_id=req.request_id, prompt_token_ids=prompt, sampling=req.sampling)
        dreq.prefilled.kv_handle.CopyFrom(handle)
        dreq.prefilled.first_token_id = resp.first_token_id
        try:
            async for _ in decode_pb2_grpc.DecodeStub(dch).Decode(dreq):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("tamper", ["byte", "layout"])
def test_a_corrupted_or_incompatible_handoff_is_refused(cluster: LocalCluster, tamper: str) -> None:
    assert asyncio.run(_prefill_then_decode(cluster, tamper)) == grpc.StatusCode.FAILED_PRECONDITION
    # The worker is still fine afterwards.
    assert len(asyncio.run(_generate(f"{cluster.host}:{cluster.router_port}", [1, 2, 3]))[0]) == MAX_TOKENS


@pytest.mark.parametrize(
    ("ids", "max_tokens", "fragment"),
    [
        ([], 5, "empty"),
        ([1, 2, 3], 0, "max_tokens"),
        ([1, 2, 3], 5000, "context"),
        ([1, 10**7], 5, "vocabulary"),
    ],
)
def test_bad_requests_get_invalid_argument_and_the_router_stays_up(
    cluster: LocalCluster, ids: list[int], max_tokens: int, fragment: str
) -> None:
    async def call() -> grpc.aio.AioRpcError:
        channel, stub = router_stub(cluster)
        async with channel:
            req = _request(ids, max_tokens=max_tokens)
            if max_tokens == 0:
                req.sampling.max_tokens = 0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(req):
                    pass
            return info.value

    error = asyncio.run(call())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in error.details()
    assert len(asyncio.run(_generate(f"{cluster.host}:{cluster.router_port}", [4, 5, 6]))[0]) == MAX_TOKENS


def test_a_stage_port_taken_before_it_binds_is_picked_again_with_the_routers_ports_given(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`up --port/--grpc-port` fixes the router's ports, not the stages' own: one picked free and taken by another
    process before the stage binds it (beside other test workers, once) makes a new plan, as without given ports."""
    import socket

    from qwenserve import launcher

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    first = iter([taken])  # the first port the plan picks (the tokenizer's) is the one held
    real = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": next(first, None) or real(host))
    cluster = LocalCluster(model=tiny_model, prefill=1, decode=1, router_port=free_port(), http_port=free_port(),
                           env=WORKER_ENV)
    try:
        cluster.start(timeout_s=120)
        assert f"127.0.0.1:{taken}" not in {c.address for c in cluster.children}
        assert cluster.children[0].name == "tokenizer" and cluster.children[0].process.poll() is None
    finally:
        cluster.stop()
        holder.close()


def test_qwen_serve_up_prints_ready_and_stops_every_child(tiny_model: Path) -> None:
    env_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwenserve.cli", "up", str(tiny_model), "--grpc-port", str(env_port),
         "--port", str(free_port()), "--local-prefill-threshold", "0"],  # every prompt handed off
        stdout=subprocess.PIPE, text=True,
        env={**__import__("os").environ, "QWENSERVE_KV_CACHE_GB": "0.05", "QWENSERVE_THREADS": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert "ready" in line and f":{env_port}" in line, line
        rows = re.findall(r"^\s+(\S+)\s+grpc=(\S+)\s+metrics=http://[^:]+:(\d+)",
                          "".join(proc.stdout.readline() for _ in range(4)), re.MULTILINE)
        _stages_refuse_strangers_while_the_router_serves({name: (address, int(port)) for name, address, port in rows},
                                                         f"127.0.0.1:{env_port}")
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 4
        proc.terminate()
        assert proc.wait(30) == 0
        for pid in children:
            assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0, "orphaned child"
    finally:
        if proc.poll() is None:
            proc.kill()


def _stages_refuse_strangers_while_the_router_serves(stages: dict[str, tuple[str, int]], router: str) -> None:
    """Under `qwen-serve up` (its per-run stage secret) a direct call to a stage is UNAUTHENTICATED, while the
    router's requests are served and decode's releases reach prefill (no lease is left held)."""
    assert {"tokenizer", "prefill-0", "decode-0"} <= set(stages), stages
    (prefill_address, prefill_metrics), (decode_address, _) = stages["prefill-0"], stages["decode-0"]
    with grpc.insecure_channel(prefill_address) as prefill, grpc.insecure_channel(decode_address) as dec:
        request = prefill_pb2.PrefillRequest(request_id="stranger", prompt_token_ids=[1, 2, 3])
        calls = [
            lambda: prefill_pb2_grpc.PrefillStub(prefill).Prefill(request, timeout=10),
            lambda: list(kv_transfer_pb2_grpc.KVTransferStub(prefill).Fetch(
                kv_transfer_pb2.FetchRequest(handoff_id="someone.else"), timeout=10)),
            lambda: kv_transfer_pb2_grpc.KVTransferStub(prefill).Release(
                kv_transfer_pb2.ReleaseRequest(handoff_id="someone.else"), timeout=10),
            lambda: list(decode_pb2_grpc.DecodeStub(dec).Decode(
                decode_pb2.DecodeRequest(request_id="stranger", prompt_token_ids=[1, 2, 3]), timeout=10)),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    tokens, _ = asyncio.run(_generate(router, list(range(10, 60))))
    assert len(tokens) == MAX_TOKENS  # the router proves it is one of the stages'
    deadline = time.monotonic() + 5  # up's leases last 30 s: only decode's Release frees one sooner
    while metric(prefill_metrics, "qwenserve_handoff_leases_outstanding") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(prefill_metrics, "qwenserve_handoff_leases_outstanding") == 0
    assert metric(prefill_metrics, "qwenserve_handoff_bytes_total") > 0  # the request was handed off
    assert metric(prefill_metrics, "qwenserve_stage_auth_refusals_total") >= 3
