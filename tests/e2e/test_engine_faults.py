"""Engine faults in real stage processes: a bad request gets a clean error and the stage serves on; a compute
loop that dies turns every health surface NOT_SERVING, ends its streams and exits non-zero; a handoff larger
than the prefill's pool reaches decode intact."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.grpc_server import FAULT_EXIT_CODE
from qwenserve.kv_transfer import leaked_segments
from qwenserve.launcher import wait_serving
from qwenserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.support.clusters import WORKER_ENV
from tests.support.ports import free_port

FAULTY_STAGE = Path(__file__).parent / "faulty_stage.py"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Stage:
    """One stage process on loopback: its gRPC address, metrics port and process."""

    def __init__(self, process: subprocess.Popen, port: int, metrics_port: int) -> None:
        self.process = process
        self.address = f"127.0.0.1:{port}"
        self.metrics_port = metrics_port

    def probe(self, path: str) -> int:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=2).status
        except urllib.error.HTTPError as e:
            return e.code


@pytest.fixture
def start_stage(tmp_path: Path) -> Iterator[Callable[..., Stage]]:
    """start_stage(kind, model, *flags, env=..., faulty=False): a running prefill or decode process, stopped
    after the test. `faulty` runs it under faulty_stage.py, whose compute loop dies on cue."""
    started: list[Stage] = []

    def start(kind: str, model: Path, *flags: str, env: dict[str, str] | None = None, faulty: bool = False) -> Stage:
        port, metrics_port = free_port(), free_port()
        entry = [str(FAULTY_STAGE)] if faulty else ["-m", "qwenserve.cli", "serve"]
        argv = [sys.executable, *entry, kind, "--model", str(model), "--port", str(port),
                "--metrics-port", str(metrics_port), *flags]
        log = open(tmp_path / f"{kind}-{port}.log", "w")  # noqa: SIM115 - the process writes it until it ends
        process = subprocess.Popen(argv, env={**os.environ, **WORKER_ENV, **(env or {})}, stdout=log,
                                   stderr=subprocess.STDOUT)
        stage = Stage(process, port, metrics_port)
        started.append(stage)
        wait_serving(stage.address, time.monotonic() + 120, process, what=f"{kind} (log: {log.name})")
        return stage

    yield start
    for stage in started:
        if stage.process.poll() is None:
            stage.process.terminate()
        stage.process.wait(timeout=30)


def _decode_request(request_id: str, prompt: list[int], max_tokens: int, **sampling: object) -> decode_pb2.DecodeRequest:
    req = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, local_prefill=True)
    req.sampling.temperature = 0.0
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    for key, value in sampling.items():
        field = getattr(req.sampling, key)
        field.extend(value) if hasattr(field, "extend") else setattr(req.sampling, key, value)
    return req


async def _decode(address: str, req: decode_pb2.DecodeRequest) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        return [t async for m in decode_pb2_grpc.DecodeStub(channel).Decode(req, timeout=60) for t in m.token_ids]


async def test_a_stop_id_outside_the_vocabulary_is_invalid_argument_and_the_stages_serve_on(start_stage, tiny_model):
    decode = start_stage("decode", tiny_model)
    prefill = start_stage("prefill", tiny_model)
    # The request that once killed the engine thread: min_tokens makes the sampler mask the stop id.
    bad = {"min_tokens": 2, "stop_token_ids": [4294967295]}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _decode(decode.address, _decode_request("bad", [1, 2, 3], 4, **bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop_token_ids: token id 4294967295 is outside the vocabulary" in info.value.details()
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        req = prefill_pb2.PrefillRequest(request_id="bad", prompt_token_ids=[1, 2, 3])
        req.sampling.CopyFrom(_decode_request("bad", [1], 4, **bad).sampling)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_pb2_grpc.PrefillStub(channel).Prefill(req, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in info.value.details()
        req.sampling.ClearField("stop_token_ids")
        req.sampling.temperature = float("inf")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_pb2_grpc.PrefillStub(channel).Prefill(req, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "finite" in info.value.details()
    assert len(await _decode(decode.address, _decode_request("next", [1, 2, 3], 4))) == 4
    for stage in (decode, prefill):
        assert stage.probe("/readyz") == 200 and stage.process.poll() is None


async def test_a_dead_compute_loop_says_not_serving_everywhere_ends_its_streams_and_exits_non_zero(
    start_stage, tiny_model
):
    # The grace period keeps the draining process (and its probes) up while the health watch stays open.
    decode = start_stage("decode", tiny_model, "--grace-s", "5", faulty=True)
    async with grpc.aio.insecure_channel(decode.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == SERVING
        stub = decode_pb2_grpc.DecodeStub(channel)
        victim = stub.Decode(_decode_request("victim", [1, 2, 3], 1000), timeout=60)
        assert (await victim.read()).token_ids  # streaming when the loop dies
        killer = stub.Decode(_decode_request("kill-the-loop", [4, 5, 6], 4), timeout=60)
        for call in (victim, killer):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
            # UNAVAILABLE: the router fails the stream over to another worker.
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "compute loop failed: RuntimeError: injected scheduler fault" in info.value.details()
        assert (await asyncio.wait_for(watch.read(), 10)).status == NOT_SERVING
        assert decode.probe("/healthz") == 503 and decode.probe("/readyz") == 503
    assert await asyncio.to_thread(decode.process.wait, 30) == FAULT_EXIT_CODE


def _own_segments(pid: int) -> dict[str, int]:
    """The process's shared-memory segments and their sizes."""
    return {name: os.path.getsize(f"/dev/shm/{name}") for name in leaked_segments(f"qwenserve-kv-{pid}-")}


async def test_a_handoff_larger_than_the_prefill_pool_reaches_decode_intact(start_stage, tmp_path):
    # 8 KiB of KV per token: a 300-token prompt hands off 2.3 MiB through a pool of 1 MiB.
    config = {**TINY_CONFIG, "num_hidden_layers": 4, "num_key_value_heads": 4, "head_dim": 64,
              "max_position_embeddings": 1024}
    model = write_checkpoint(tmp_path / "kv-heavy", config, seed=5)
    prompt = [(7919 * i) % 150_000 for i in range(300)]
    engine = LLMEngine.from_pretrained(model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1, dtype="float32"))
    try:
        want = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    finally:
        engine.shutdown()
    prefill = start_stage("prefill", model, env={"QWENSERVE_KV_POOL_MIB": "1"})  # read through --kv-pool-mib
    decode = start_stage("decode", model)
    assert list(_own_segments(prefill.process.pid).values()) == [1 << 20]
    req = _decode_request("long", prompt, 8)
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        prefilled = await prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(request_id="long", prompt_token_ids=prompt, sampling=req.sampling), timeout=60
        )
    assert prefilled.first_token_id == want[0] and prefilled.kv_handle.length > 2 << 20
    assert len(_own_segments(prefill.process.pid)) == 2  # the pool and the handoff's own region
    req.prefilled.kv_handle.CopyFrom(prefilled.kv_handle)
    req.prefilled.first_token_id = prefilled.first_token_id
    assert [want[0], *await _decode(decode.address, req)] == want
    deadline = time.monotonic() + 10
    while len(_own_segments(prefill.process.pid)) > 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # decode released the lease: the overflow region goes at once
    assert list(_own_segments(prefill.process.pid).values()) == [1 << 20]
