"""The router under faults and hostile input, in real processes: every request gets exactly one
terminal answer, only worker faults count against a worker, and nothing is left behind.

One small cluster (a tokenizer, one prefill and two decode workers) serves the module; tests that need
other router settings (a short stall timeout, API keys, a drain) start a second router over the
same workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from qwenserve.launcher import LocalCluster, wait_serving
from qwenserve.status import fetch_status
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.clusters import make_cluster
from tests.support.metrics import metric
from tests.support.ports import free_port

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def faults_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One prefill and two decode workers with the default 30 s leases, so a lease left behind shows."""
    with make_cluster(tiny_model, tmp_path_factory.mktemp("faults"), prefill=1, decode=2) as c:
        yield c


@contextlib.contextmanager
def second_router(cluster: LocalCluster, *args: str, env: dict[str, str] | None = None,
                  auth: bool = False) -> Iterator[tuple[str, subprocess.Popen]]:
    """Another router process over the cluster's workers, with `args` added to its command line."""
    argv = list(cluster.child("router").argv)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--http-port") + 1] = "0"
    argv[argv.index("--metrics-port") + 1] = str(free_port())
    if auth:
        argv.remove("--no-auth")
    proc = subprocess.Popen([*argv, *args], env={**os.environ, **cluster.env, **(env or {})})
    address = f"{cluster.host}:{port}"
    try:
        wait_serving(address, time.monotonic() + 60, proc, "the second router")
        yield address, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _request(ids: list[int], max_tokens: int = MAX_TOKENS, **fields: object) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    req.prompt_token_ids.ids.extend(ids)
    req.sampling.max_tokens = max_tokens
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    return req


def _address(cluster: LocalCluster) -> str:
    return f"{cluster.host}:{cluster.router_port}"


async def _collect(address: str, req: router_pb2.GenerateRequest, timeout: float = 60,
                   metadata: tuple[tuple[str, str], ...] | None = None) -> list[router_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(req, timeout=timeout, metadata=metadata)
        return [m async for m in call]


def _tokens(msgs: list[router_pb2.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


async def _rpc_error(address: str, req: router_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(address, req, timeout=15)
    return info.value


def _wait_for_baseline(cluster: LocalCluster, timeout_s: float = 10) -> tuple[float, float, float]:
    """Decode KV blocks in use, decode requests running and prefill leases outstanding, once all are 0
    (or what they are when `timeout_s` runs out)."""
    decodes = [c for c in cluster.children if c.name.startswith("decode")]
    prefills = [c for c in cluster.children if c.name.startswith("prefill")]
    deadline = time.monotonic() + timeout_s
    while True:
        state = (
            sum(metric(c.metrics_port, "qwenserve_kv_blocks_used") for c in decodes),
            sum(metric(c.metrics_port, "qwenserve_engine_running_requests") for c in decodes),
            sum(metric(c.metrics_port, "qwenserve_handoff_leases_outstanding") for c in prefills),
        )
        if state == (0, 0, 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def test_client_cancels_and_stop_strings_never_open_the_decode_circuit(faults_cluster: LocalCluster) -> None:
    address = _address(faults_cluster)
    prompt = list(range(700, 730))
    # Greedy output is deterministic: the text of its first tokens is a stop string the same request meets
    # again, only once the decode worker streams (the first token comes from prefill).
    msgs = asyncio.run(_collect(address, _request(prompt, max_tokens=40)))
    upto = next(i for i in range(len(msgs)) if len(_tokens(msgs[: i + 1])) >= 3)
    stop = "".join(m.text for m in msgs[: upto + 1])
    assert stop, msgs

    async def early_ends() -> list[str]:
        async def cancelled(i: int) -> str:
            async with grpc.aio.insecure_channel(address) as channel:
                call = router_pb2_grpc.RouterStub(channel).Generate(_request([i + 1, *prompt], max_tokens=600))
                async for msg in call:
                    if msg.token_ids:
                        call.cancel()
                        return "cancelled"
            return "finished"

        async def stopped() -> str:
            msgs = await _collect(address, _request(prompt, max_tokens=600, stop=[stop]))
            assert 1 < len(_tokens(msgs)) < 600
            return common_pb2.FinishReason.Name(msgs[-1].finish_reason)

        return await asyncio.gather(*[cancelled(i) for i in range(12)], *[stopped() for _ in range(12)])

    outcomes = asyncio.run(early_ends())
    assert outcomes == ["cancelled"] * 12 + ["FINISH_REASON_STOP"] * 12
    # Three failures would have opened a worker's circuit for 5 s: every request now must still succeed.
    after = asyncio.run(_all(address, [[5, 6, 7, i] for i in range(6)], MAX_TOKENS))
    for msgs in after:
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH, msgs[-1]
        assert len(_tokens(msgs)) == MAX_TOKENS
    assert _wait_for_baseline(faults_cluster) == (0, 0, 0)


@pytest.mark.parametrize("request_id", ["line\nbreak", "caf\u00e9", "ctrl\x01", "x" * 100_000, "x" * 129])
def test_a_request_id_unfit_for_metadata_is_refused_at_once(faults_cluster: LocalCluster, request_id: str) -> None:
    started = time.monotonic()
    error = asyncio.run(_rpc_error(_address(faults_cluster), _request([1, 2, 3], request_id=request_id)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "request_id" in (error.details() or "")
    assert time.monotonic() - started < 10


def test_two_requests_in_flight_with_one_id_both_succeed_and_echo_it(faults_cluster: LocalCluster) -> None:
    address = _address(faults_cluster)

    async def both() -> list[list[router_pb2.GenerateResponse]]:
        reqs = [_request(list(range(40, 80)), max_tokens=40, request_id="dup:1") for _ in range(2)]
        return await asyncio.gather(*[_collect(address, r) for r in reqs])

    first, second = asyncio.run(both())
    for msgs in (first, second):
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH, msgs[-1]
        assert {m.request_id for m in msgs} == {"dup:1"}
    assert _tokens(first) == _tokens(second) and len(_tokens(first)) == 40


@pytest.mark.parametrize(
    ("setting", "value", "field"),
    [
        ("temperature", float("inf"), "temperature"),
        ("repetition_penalty", float("inf"), "repetition_penalty"),
        ("top_p", float("nan"), "top_p"),
        ("presence_penalty", -float("inf"), "presence_penalty"),
        ("temperature", 1e30, "temperature"),  # finite even as a 32-bit float
    ],
)
def test_non_finite_or_huge_sampling_floats_are_invalid_argument(
    faults_cluster: LocalCluster, setting: str, value: float, field: str
) -> None:
    req = _request([1, 2, 3])
    setattr(req.sampling, setting, value)
    error = asyncio.run(_rpc_error(_address(faults_cluster), req))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (error.details() or ""), error


def test_an_unknown_model_or_a_stop_token_outside_the_vocabulary_is_invalid_argument(
    faults_cluster: LocalCluster
) -> None:
    address = _address(faults_cluster)
    error = asyncio.run(_rpc_error(address, _request([1, 2, 3], model="gpt-9")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "gpt-9" in (error.details() or "")
    req = _request([1, 2, 3])
    req.sampling.min_tokens = 2
    req.sampling.stop_token_ids.append(4294967295)
    error = asyncio.run(_rpc_error(address, req))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in (error.details() or "")
    # The deployment's own name is fine, and so is none.
    name = asyncio.run(_list_models(address))[0].id
    assert asyncio.run(_collect(address, _request([1, 2, 3], model=name)))[-1].finish_reason


async def _list_models(address: str, metadata: tuple[tuple[str, str], ...] | None = None) -> list[router_pb2.ModelCard]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await router_pb2_grpc.RouterStub(channel).ListModels(
            router_pb2.ListModelsRequest(), timeout=10, metadata=metadata
        )
    return list(reply.models)


def test_models_and_status_need_an_api_key_when_keys_are_configured(faults_cluster: LocalCluster) -> None:
    with second_router(faults_cluster, env={"QWENSERVE_API_KEYS": "sk-ops:ops"}, auth=True) as (address, _):
        for wrong in (None, (("authorization", "Bearer sk-nope"),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                asyncio.run(_list_models(address, wrong))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(fetch_status(address, 10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(_list_models(address, (("authorization", "Bearer sk-ops"),)))
        # A key of a tenant not marked `admin: true` sees every worker's row, not where it is.
        status = asyncio.run(fetch_status(address, 10, api_key="sk-ops"))
        decodes = [s for s in status.stages if s.stage == "decode"]
        assert [s.address for s in decodes] == ["", ""]
        assert {s.state for s in decodes} == {"SERVING"}


def test_a_prefill_failure_of_any_kind_moves_the_request_on_never_an_empty_answer(
    faults_cluster: LocalCluster
) -> None:
    # The tokenizer's server answers Prefill with UNIMPLEMENTED: a worker fault that is not UNAVAILABLE.
    tokenizer = faults_cluster.child("tokenizer").address
    prefill = faults_cluster.child("prefill-0").address
    prompts = [list(range(900 + 7 * i, 940 + 7 * i)) for i in range(3)]
    expected = [_tokens(asyncio.run(_collect(_address(faults_cluster), _request(p)))) for p in prompts]
    for workers in (f"{tokenizer},{prefill}", tokenizer):  # another worker, then decode prefilling locally
        with second_router(faults_cluster, "--prefill", workers) as (address, _):
            for prompt, want in zip(prompts, expected, strict=True):
                msgs = asyncio.run(_collect(address, _request(prompt)))
                assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH, msgs[-1]
                assert _tokens(msgs) == want
    assert _wait_for_baseline(faults_cluster) == (0, 0, 0)


def test_a_hung_prefill_worker_is_given_up_on_after_the_prefill_timeout(faults_cluster: LocalCluster) -> None:
    prefill = faults_cluster.child("prefill-0").process
    assert prefill is not None
    with second_router(faults_cluster, "--prefill-timeout-s", "2") as (address, _):
        prefill.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            msgs = asyncio.run(_collect(address, _request(list(range(60, 90)))))  # no client deadline
            took = time.monotonic() - started
        finally:
            prefill.send_signal(signal.SIGCONT)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and len(_tokens(msgs)) == MAX_TOKENS
    assert took < 2 + 15, took


def test_a_stopped_decode_worker_is_failed_over_within_the_stall_timeout(faults_cluster: LocalCluster) -> None:
    stall_s, max_tokens = 3.0, 200
    victim = faults_cluster.child("decode-0")
    assert victim.process is not None
    prompts = [list(range(1000 + 11 * i, 1030 + 11 * i)) for i in range(4)]
    with second_router(faults_cluster, "--stall-timeout-s", str(stall_s)) as (address, _):
        expected = asyncio.run(_all(address, prompts, max_tokens))

        async def stop_mid_stream() -> tuple[list[list[router_pb2.GenerateResponse]], float]:
            have: set[int] = set()
            everyone = asyncio.Event()

            async def one(i: int) -> list[router_pb2.GenerateResponse]:
                msgs = []
                async with grpc.aio.insecure_channel(address) as channel:
                    async for msg in router_pb2_grpc.RouterStub(channel).Generate(
                        _request(prompts[i], max_tokens), timeout=120
                    ):
                        msgs.append(msg)
                        have.add(i)
                        if len(have) == len(prompts):
                            everyone.set()
                return msgs

            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            await asyncio.wait_for(everyone.wait(), 60)
            victim.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
            stopped = time.monotonic()
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - stopped

        try:
            results, took = asyncio.run(stop_mid_stream())
            # New requests while the worker is still stopped finish too (each waits at most one stall).
            started = time.monotonic()
            later = asyncio.run(_all(address, prompts[:2], MAX_TOKENS))
            later_took = time.monotonic() - started
        finally:
            victim.process.send_signal(signal.SIGCONT)
        # Woken up, the worker sees its streams cancelled and frees their KV; handoffs it never took up
        # the router releases itself (while it runs: so the check comes before it stops).
        assert _wait_for_baseline(faults_cluster, timeout_s=20) == (0, 0, 0)
    for msgs, want in zip(results, expected, strict=True):
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH, msgs[-1]
        assert _tokens(msgs) == _tokens(want)
    assert took < stall_s + 30, took
    assert all(len(_tokens(m)) == MAX_TOKENS for m in later) and later_took < 2 * stall_s + 20, later_took


async def _all(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[router_pb2.GenerateResponse]]:
    return await asyncio.gather(*[_collect(address, _request(p, max_tokens), timeout=120) for p in prompts])


def test_a_draining_router_finishes_short_streams_and_aborts_long_ones(faults_cluster: LocalCluster) -> None:
    # The short stream has 5 of its 6 tokens before SIGTERM and needs one more within the 1.5 s grace (a loaded
    # two-core machine ran a tiny model's stream at ~3 tokens/s). The long one must outlast the grace: a fast
    # machine decoded all 1,000 tokens (the model's length allows no more) within SIGTERM's 4 s grace.
    with second_router(faults_cluster, "--grace-s", "1.5") as (address, proc):
        async def short_stream(started: asyncio.Event) -> list[router_pb2.GenerateResponse]:
            async with grpc.aio.insecure_channel(address) as channel:
                call = router_pb2_grpc.RouterStub(channel).Generate(
                    _request(list(range(30, 40)), max_tokens=6), timeout=60)
                msgs = []
                async for m in call:
                    msgs.append(m)
                    if len(_tokens(msgs)) >= 5:
                        started.set()
                return msgs

        async def drain() -> tuple[list[router_pb2.GenerateResponse], list[router_pb2.GenerateResponse]]:
            long = asyncio.create_task(_collect(address, _request(list(range(10, 20)), max_tokens=1000)))
            first = asyncio.create_task(_collect(address, _request(list(range(20, 30)), max_tokens=1)))
            await first  # both streams are running by now
            started = asyncio.Event()
            short = asyncio.create_task(short_stream(started))
            await asyncio.wait_for(started.wait(), 30)
            proc.send_signal(signal.SIGTERM)
            return await long, await short

        long, short = asyncio.run(drain())
        assert proc.wait(30) == 0
    assert short[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and len(_tokens(short)) == 6
    assert long[-1].finish_reason == common_pb2.FINISH_REASON_ABORT, long[-1]
    assert long[-1].error.code == "shutting_down" and long[-1].error.retryable
    assert sum(1 for m in long if m.finish_reason) == 1 and 0 < len(_tokens(long)) < 1000
    assert _wait_for_baseline(faults_cluster) == (0, 0, 0)
