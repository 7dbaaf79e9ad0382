"""Per-pod discovery with real workers: decode "pods" on their own loopback IPs behind one name.

A name that resolves to several addresses is a headless Service in a cluster. Here the pods are decode
processes bound to 127.0.0.1, 127.0.0.2 and 127.0.0.3 on one port, and the name resolves through a
table the test changes (the router's resolver is injectable); `localhost` goes through getaddrinfo.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from qwenserve.launcher import wait_serving
from qwenserve.router.config import RouterConfig
from qwenserve.router.discovery import Resolver, system_resolver
from qwenserve.router.generation import Router
from qwenserve.status import parse_gauges
from qwenserve.tokenizer import IncrementalDetokenizer, Tokenizer
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.clusters import WORKER_ENV
from tests.support.ports import free_port

NAME = "decode.pods.test"
SERVED = "qwenserve_engine_step_tokens_sum"  # tokens a worker computed: its own record of serving


@dataclass
class Stage:
    process: subprocess.Popen
    address: str
    metrics_port: int

    def served(self) -> float:
        host = self.address.rsplit(":", 1)[0]  # a stage serves its metrics on its own host
        text = urllib.request.urlopen(f"http://{host}:{self.metrics_port}/metrics", timeout=5).read().decode()
        return parse_gauges(text, [SERVED])[SERVED]


@pytest.fixture(scope="module")
def start_stage(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Stage]]:
    """start_stage(kind, host, port, *flags): a running stage process on host:port, stopped after the module."""
    logs = tmp_path_factory.mktemp("pods")
    started: list[Stage] = []

    def start(kind: str, host: str, port: int, *flags: str) -> Stage:
        metrics_port = free_port()
        argv = [sys.executable, "-m", "qwenserve.cli", "serve", kind, "--model", str(tiny_model), "--host", host,
                "--port", str(port), "--metrics-port", str(metrics_port), *flags]
        log = open(logs / f"{kind}-{host}-{port}.log", "w")  # noqa: SIM115 - the process writes it until it ends
        process = subprocess.Popen(argv, env={**os.environ, **WORKER_ENV}, stdout=log, stderr=subprocess.STDOUT)
        stage = Stage(process, f"{host}:{port}", metrics_port)
        started.append(stage)
        wait_serving(stage.address, time.monotonic() + 180, process, what=f"{kind} at {host} (log: {log.name})")
        return stage

    yield start
    for stage in started:
        stage.process.terminate()
    for stage in started:
        stage.process.wait(timeout=30)


def port_free_on(*hosts: str) -> int:
    """A port free on every one of `hosts` (pods of one Service listen on the same port)."""
    while True:
        port = free_port(hosts[0])
        with contextlib.ExitStack() as stack:
            try:
                for host in hosts[1:]:
                    stack.enter_context(socket.create_server((host, port)))
            except OSError:
                continue
        return port


@dataclass
class Workers:
    tokenizer: Stage
    prefill: Stage
    decode: dict[str, Stage]  # by pod IP
    port: int  # every decode pod's


@pytest.fixture(scope="module")
def workers(start_stage: Callable[..., Stage]) -> Workers:
    """Tokenizer, one prefill, and decode pods on 127.0.0.1 and 127.0.0.2 at one port."""
    port = port_free_on("127.0.0.1", "127.0.0.2", "127.0.0.3")
    return Workers(
        tokenizer=start_stage("tokenizer", "127.0.0.1", free_port()),
        prefill=start_stage("prefill", "127.0.0.1", free_port()),
        decode={ip: start_stage("decode", ip, port) for ip in ("127.0.0.1", "127.0.0.2")},
        port=port,
    )


class Table:
    """The name's DNS records, as the test sets them."""

    def __init__(self, ips: list[str]) -> None:
        self.ips = ips

    async def __call__(self, host: str, port: int) -> list[str]:
        assert host == NAME
        return list(self.ips)


@contextlib.asynccontextmanager
async def running_router(model: Path, workers: Workers, decode: list[str],
                         resolver: Resolver = system_resolver) -> AsyncIterator[Router]:
    """The router library over `workers`' tokenizer and prefill and the `decode` entries, resolving every 0.3 s."""
    tokenizer = Tokenizer.from_dir(model)
    config = RouterConfig(workers.tokenizer.address, [workers.prefill.address], decode, max_model_len=4096,
                          resolve_interval_s=0.3, worker_info_wait_s=5)
    router = Router(config, lambda skip: IncrementalDetokenizer(tokenizer, skip_special_tokens=skip),
                    resolver=resolver)
    try:
        await asyncio.wait_for(router.start(), 60)
        yield router
    finally:
        await router.close()


async def generate(router: Router, prompt: str, max_tokens: int) -> router_pb2.GenerateResponse:
    """Run one request to its end; the last message (finish reason, usage)."""
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prep = await router.prepare(router_pb2.GenerateRequest(prompt=prompt, sampling=sampling))
    last = None
    async with contextlib.aclosing(router.run(prep)) as stream:
        async for last in stream:  # noqa: B007 - the last one is the answer
            pass
    assert last is not None
    return last


async def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> float:
    """Seconds until `check()` holds; fails naming `what` after `timeout_s`."""
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < timeout_s, f"not within {timeout_s:g}s: {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - began


async def test_the_router_spreads_over_pods_follows_scale_up_and_drains_a_removed_pod(
    workers: Workers, start_stage: Callable[..., Stage], tiny_model: Path
) -> None:
    port = workers.port
    pod = {ip: f"{ip}:{port}" for ip in ("127.0.0.1", "127.0.0.2", "127.0.0.3")}
    table = Table(["127.0.0.1", "127.0.0.2"])
    async with running_router(tiny_model, workers, [f"{NAME}:{port}"], resolver=table) as router:
        assert router.fleet.pods("decode") == [pod["127.0.0.1"], pod["127.0.0.2"]]
        assert set(router.fleet.worker_limits) == {workers.prefill.address, pod["127.0.0.1"], pod["127.0.0.2"]}

        # Both pods serve: requests at once go to the least loaded pod, not all to the first.
        before = {ip: stage.served() for ip, stage in workers.decode.items()}
        done = await asyncio.gather(*(generate(router, f"request {i} of the first round", 24) for i in range(6)))
        assert all(d.finish_reason == common_pb2.FINISH_REASON_LENGTH for d in done)
        assert all(workers.decode[ip].served() > before[ip] for ip in before), "a decode pod served nothing"

        # A pod that appears in DNS gets requests within seconds.
        third = start_stage("decode", "127.0.0.3", port)
        table.ips = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
        took = await wait_until(lambda: pod["127.0.0.3"] in router.fleet.decode_pool.workers, "the new pod joins")
        assert took < 3
        before_third = third.served()
        done = await asyncio.gather(*(generate(router, f"request {i} of the second round", 24) for i in range(9)))
        assert all(d.finish_reason == common_pb2.FINISH_REASON_LENGTH for d in done)
        assert third.served() > before_third, "the new pod served nothing"

        # A pod that leaves DNS gets no new requests at once; its streams finish, then its channel closes.
        long = [asyncio.ensure_future(generate(router, f"long stream {i}", 300)) for i in range(3)]
        gone = router.fleet.decode_pool.workers[pod["127.0.0.2"]]
        await wait_until(lambda: gone.outstanding > 0, "a long stream runs on 127.0.0.2", timeout_s=30)
        table.ips = ["127.0.0.1", "127.0.0.3"]
        await wait_until(lambda: pod["127.0.0.2"] in router.fleet.draining_pods(), "127.0.0.2 drains")
        held = gone.outstanding
        assert held > 0 and pod["127.0.0.2"] not in router.fleet.decode_pool.workers
        loads: list[int] = []

        async def watch_load() -> None:
            while True:
                loads.append(gone.outstanding)
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch_load())
        short = await asyncio.gather(*(generate(router, f"while draining {i}", 8) for i in range(4)))
        watcher.cancel()
        assert all(d.finish_reason == common_pb2.FINISH_REASON_LENGTH for d in short)
        assert max(loads) <= held, "a new request went to the removed pod"
        ended = await asyncio.gather(*long)
        assert [(e.finish_reason, e.usage.completion_tokens) for e in ended] == [
            (common_pb2.FINISH_REASON_LENGTH, 300)] * 3
        assert router.metrics.failovers.labels("decode")._value.get() == 0  # the drained streams were not moved
        await wait_until(lambda: pod["127.0.0.2"] not in router.fleet.draining_pods(), "127.0.0.2 has drained", 5)
        assert pod["127.0.0.2"] not in router.fleet.pods("decode")
        assert pod["127.0.0.2"] not in router.fleet._channels, "the drained pod's channel stayed open"


async def test_localhost_resolves_through_getaddrinfo_and_status_lists_every_pod(
    workers: Workers, tiny_model: Path, tmp_path: Path
) -> None:
    port, decode = workers.port, workers.decode["127.0.0.1"]
    async with running_router(tiny_model, workers, [f"localhost:{port}"]) as router:
        assert router.fleet.pods("decode") == [f"127.0.0.1:{port}"]
        done = await generate(router, "through the system resolver", 8)
        assert done.finish_reason == common_pb2.FINISH_REASON_LENGTH and done.usage.completion_tokens == 8

    # The router stage: a name among --decode gives a status row per pod, with the pod's own metrics.
    grpc_port, prefill_port = free_port(), workers.prefill.address.rsplit(":", 1)[1]
    argv = [sys.executable, "-m", "qwenserve.cli", "serve", "router", str(tiny_model), "--port", str(grpc_port),
            "--tokenizer", workers.tokenizer.address, "--prefill", f"localhost:{prefill_port}",
            "--decode", f"localhost:{port},127.0.0.2:{port}", "--no-auth", "--resolve-interval-s", "1",
            "--decode-metrics", f"localhost:{decode.metrics_port}"]
    with open(tmp_path / "router.log", "w") as log:  # noqa: ASYNC230 - opened once, before the router starts
        router_process = subprocess.Popen(argv, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_serving(f"127.0.0.1:{grpc_port}", time.monotonic() + 120, router_process, what="router")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                status = await router_pb2_grpc.RouterStub(channel).GetStatus(router_pb2.GetStatusRequest(), timeout=30)
        finally:
            router_process.terminate()
            router_process.wait(timeout=30)
    rows = {(s.stage, s.address): s for s in status.stages}
    assert {a for stage, a in rows if stage == "decode"} == {f"127.0.0.1:{port}", f"127.0.0.2:{port}"}
    assert rows["prefill", workers.prefill.address].state == "SERVING"
    local = rows["decode", f"127.0.0.1:{port}"]
    assert (local.state, local.metrics_address, local.load_known) == ("SERVING", f"127.0.0.1:{decode.metrics_port}",
                                                                     True)
    assert rows["decode", f"127.0.0.2:{port}"].state == "SERVING"
