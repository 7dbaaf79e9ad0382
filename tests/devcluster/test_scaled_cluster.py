"""The CPU example as a scaled cluster of pods: every pod serves, handoffs cross the network, streams survive.

Issue 17's tests on `qwen-serve dev-cluster` (needs root and `ip netns`; skipped with the reason otherwise),
with a tiny checkpoint written here standing for the example's model (`--model`), so 6 pods stay light:

- shm mode, 1 prefill + 1 decode on one node: the handoff goes through /dev/shm;
- network mode, 2 prefill + 2 decode (one cluster for the rest of the module): 40 prompts through the router,
  and 4 sent one at a time, are served by every prefill and decode pod (their own metrics say so), every
  handoff crosses the network and none is refused, greedy tokens equal an in-process engine's, `qwen-serve status` has a row per pod;
- a decode pod killed with SIGKILL mid-stream: the router resumes its streams on the other (same tokens), the
  pod runner restarts the pod and it serves again;
- kubectl with the kubeconfig `up` wrote: the QwenDeployment's printer columns, every pod's IP (`-o wide`), a pod's
  log;
- the operator's NetworkPolicies enforced on the bridge: an outsider (no pod's labels) cannot open decode's or
  prefill's gRPC port (its KV export), the router and decode (prefill's peer) can, a policy added or removed
  applies within seconds;
- decode scaled to 3 (`kubectl apply -f`): the new pod gets traffic; scaled to 1 during streams (`kubectl patch`):
  the removed pods drain them;
- a rollout of decode to a bf16 KV cache under load: every request gets one answer, the fp32 layout's tokens or
  the bf16 one's, never a mix; the new pod refuses prefill's fp32 handoffs (counted as `protocol` failures) and
  computes each prompt itself;
- `kubectl delete` of the QwenDeployment: its Deployments go (owner references) and every pod stops;
- no pod's log has an "unknown flag" line (the stages parse strictly; the operator passes only their flags).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.devcluster import (
    METRICS_PORT,
    REPO,
    STAGE_ARGS,
    DevCluster,
    connects,
    example_deployment,
    netns_unavailable,
    outsider,
    pod_ready,
)
from tests.support.metrics import by_labels, scrape, total

PORTS = {"prefill": 50052, "decode": 50053}
KUBECTL = shutil.which("kubectl")
# max_tokens of a plain request and of a stream running when a pod is killed
SHORT, LONG = 16, 300


pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
if (reason := netns_unavailable()) is not None:
    pytestmark.append(pytest.mark.skip(reason=reason))


# -- the prompts and what a single process answers -----------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    max_tokens: int


def _prompts(n: int, max_tokens: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(tuple(rng.randrange(0, 150_000) for _ in range(rng.randrange(20, 60))), max_tokens)
            for _ in range(n)]


PLAIN = _prompts(40, SHORT, seed=1)
STREAMS = _prompts(8, LONG, seed=2)  # killed mid-stream
# Scaled down mid-stream: 300 to 860 tokens, so streams started together end apart and every pod keeps one
# running for a while (equal lengths kept them in step, and a removed pod's streams could all end in the
# moment between two looks at GetStatus).
DRAINED = [Prompt(p.ids, 300 + 80 * i) for i, p in enumerate(_prompts(8, 0, seed=3))]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[Prompt, list[int]]:
    """Greedy tokens of every prompt from one in-process engine on the same checkpoint."""
    prompts = [*PLAIN, *STREAMS, *DRAINED]
    engine = LLMEngine.from_pretrained(tiny_model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1,
                                                                   dtype="float32"))
    try:
        outputs = engine.generate_sync(
            [list(p.ids) for p in prompts],
            [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True) for p in prompts])
    finally:
        engine.shutdown()
    return dict(zip(prompts, outputs, strict=True))


# -- the cluster ---------------------------------------------------------------------------------------------


def _no_unknown_flags(cluster: DevCluster, pods: int) -> None:
    """The operator found every extra stage argument defined (STAGE_ARGS), and no stage refused a flag."""
    body = cluster.api("/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments/qwen-cpu")
    conditions = {c["type"]: c for c in body["status"]["conditions"]}
    assert conditions["Ready"]["reason"] != "InvalidSpec", conditions
    assert "is not a flag of" not in conditions["Degraded"]["message"], conditions
    logs = cluster.pod_logs()
    assert len(logs) >= pods, sorted(logs)
    for name, text in logs.items():
        assert "unknown flag" not in text and "unrecognized arguments" not in text, f"{name}:\n{text[-2000:]}"


@pytest.fixture(scope="module")
def network_cluster(tiny_model: Path, reference: dict[Prompt, list[int]],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """The CPU example, network mode, 2 prefill and 2 decode pods; shared by the tests after the shm one."""
    spec = example_deployment("network", {"tokenizer": 1, "prefill": 2, "decode": 2, "router": 1})
    cluster = DevCluster(spec, tmp_path_factory.mktemp("network-cluster"), tiny_model)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


ROLLED = _prompts(12, SHORT, seed=4)  # sent while decode rolls to a bf16 KV cache, and after


@pytest.fixture(scope="module")
def rollout_references(tiny_model: Path) -> dict[str, dict[Prompt, list[int]]]:
    """Greedy tokens of ROLLED from one in-process engine with an fp32 KV cache and one with a bf16 KV cache (on the
    tiny checkpoint they may agree: the pods' metrics, not the tokens, tell which path a request took)."""
    answers: dict[str, dict[Prompt, list[int]]] = {}
    for kv_dtype in ("float32", "bfloat16"):
        engine = LLMEngine.from_pretrained(tiny_model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1,
                                                                       dtype="float32", kv_cache_dtype=kv_dtype))
        try:
            outputs = engine.generate_sync(
                [list(p.ids) for p in ROLLED],
                [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True) for p in ROLLED])
        finally:
            engine.shutdown()
        answers[kv_dtype] = dict(zip(ROLLED, outputs, strict=True))
    return answers


# -- talking to it -------------------------------------------------------------------------------------------


def _metric(ip: str, name: str, **labels: str) -> float:
    """The sum of a pod's samples named `name` that carry `labels` (0 when it has none)."""
    return total(scrape(METRICS_PORT, ip), name, **labels)


@dataclass
class Stream:
    prompt: Prompt
    tokens: list[int] = field(default_factory=list)
    finish_reason: int = 0


async def _generate(stub: router_pb2_grpc.RouterStub, stream: Stream) -> Stream:
    request = router_pb2.GenerateRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=stream.prompt.ids),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=stream.prompt.max_tokens, ignore_eos=True))
    async for message in stub.Generate(request, timeout=240):
        stream.tokens.extend(message.token_ids)
        if message.finish_reason:
            stream.finish_reason = message.finish_reason
    return stream


async def _run(address: str, prompts: list[Prompt], while_running: Callable[[list[Stream]], None] | None = None
               ) -> list[Stream]:
    """Every prompt through the router at once; `while_running(streams)` runs (in a thread) once every stream
    has its first tokens, while they go on."""
    async with grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        streams = [Stream(p) for p in prompts]
        tasks = [asyncio.create_task(_generate(stub, s)) for s in streams]
        if while_running is not None:
            while not all(len(s.tokens) >= 2 for s in streams):
                assert not any(t.done() for t in tasks), "a stream ended before every stream had started"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(while_running, streams)
        await asyncio.gather(*tasks)
    return streams


async def _keep_streaming(address: str, prompts: list[Prompt], until: Callable[[], bool], timeout: float,
                          in_flight: int = 3) -> list[Stream]:
    """Requests through the router, `in_flight` at a time, cycling over `prompts`, until `until()` (checked in a
    thread) holds; every stream once all have ended."""
    async with grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        streams: list[Stream] = []
        tasks: list[asyncio.Task[Stream]] = []
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(until):
            assert time.monotonic() < deadline, f"not done after {timeout:.0f} s and {len(streams)} requests"
            while sum(not t.done() for t in tasks) < in_flight:
                streams.append(Stream(prompts[len(streams) % len(prompts)]))
                tasks.append(asyncio.create_task(_generate(stub, streams[-1])))
            await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)
    return streams


def _check_against(reference: dict[Prompt, list[int]], streams: list[Stream]) -> None:
    for s in streams:
        assert s.finish_reason == common_pb2.FINISH_REASON_LENGTH, (s.finish_reason, len(s.tokens))
        assert s.tokens == reference[s.prompt], f"prompt {s.prompt.ids[:4]}...: tokens differ from one process"


def _status(address: str) -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "qwenserve.cli", "status", "--router", address, "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def _pid(cluster: DevCluster, pod: str) -> int:
    return int(cluster.wait_for(rf"pod {pod}: started pid (\d+)", timeout=1).group(1))


# -- the tests -----------------------------------------------------------------------------------------------


def test_shm_mode_hands_off_through_the_nodes_dev_shm(
        tiny_model: Path, reference: dict[Prompt, list[int]], tmp_path: Path) -> None:
    spec = example_deployment("shm", {"tokenizer": 1, "prefill": 1, "decode": 1, "router": 1})
    cluster = DevCluster(spec, tmp_path / "shm-cluster", tiny_model)
    try:
        cluster.wait_ready()
        streams = asyncio.run(_run(cluster.grpc, PLAIN[:6]))
        _check_against(reference, streams)
        (decode,) = cluster.ready_pods("decode", 1, timeout=10).values()
        assert _metric(decode, "qwenserve_handoff_bytes_total", transport="shm") > 0
        assert _metric(decode, "qwenserve_handoff_bytes_total", transport="grpc") == 0
        assert _metric(decode, "qwenserve_handoff_failures_total") == 0
        _no_unknown_flags(cluster, pods=4)
    finally:
        cluster.stop()


def test_every_prefill_and_decode_pod_serves_and_handoffs_cross_the_network(
        network_cluster: DevCluster, reference: dict[Prompt, list[int]]) -> None:
    cluster = network_cluster
    prefill = cluster.ready_pods("prefill", 2, timeout=30)
    decode = cluster.ready_pods("decode", 2, timeout=30)
    (router,) = cluster.ready_pods("router", 1, timeout=30).values()

    _check_against(reference, asyncio.run(_run(cluster.grpc, PLAIN)))

    for name, ip in prefill.items():
        assert _metric(ip, "qwenserve_handoff_bytes_total", transport="grpc") > 0, f"prefill {name} exported nothing"
    for name, ip in decode.items():
        assert _metric(ip, "qwenserve_handoff_bytes_total", transport="grpc") > 0, f"decode {name} fetched nothing"
        # A handoff decode could not fetch would be a failure here and a prompt recomputed by decode.
        failures = {labels: v for labels, v
                    in by_labels(scrape(METRICS_PORT, ip), "qwenserve_handoff_failures_total").items() if v}
        assert not failures, f"decode {name}: {failures}"
    assert _metric(router, "qwenserve_router_failovers_total") == 0

    # One request at a time (short prompts: no prefix affinity) still reaches every pod: with all of them idle at
    # each choice, ties go to the one that started a call least recently.
    pods = {**prefill, **decode}
    before = {name: _metric(ip, "qwenserve_handoff_bytes_total", transport="grpc") for name, ip in pods.items()}
    for prompt in PLAIN[:4]:
        _check_against(reference, asyncio.run(_run(cluster.grpc, [prompt])))
    for name, ip in pods.items():
        assert _metric(ip, "qwenserve_handoff_bytes_total", transport="grpc") > before[name], \
            f"{name} got none of 4 sequential requests"

    rows = _status(cluster.grpc)
    by_stage: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_stage.setdefault(row["stage"], {})[row["address"]] = row
    assert set(by_stage) == {"router", "tokenizer", "prefill", "decode"}, rows
    for stage, pods in (("prefill", prefill), ("decode", decode)):
        assert set(by_stage[stage]) == {f"{ip}:{PORTS[stage]}" for ip in pods.values()}, rows
        for row in by_stage[stage].values():
            assert row["state"] == "SERVING" and row["loadKnown"], row
    assert all(row["state"] == "SERVING" for row in rows), rows


@pytest.mark.skipif(not KUBECTL, reason="kubectl is not installed")
def test_kubectl_shows_the_deployments_columns_every_pods_ip_and_a_pods_log(network_cluster: DevCluster) -> None:
    cluster = network_cluster
    ips = {p["metadata"]["name"]: p["status"]["podIP"]
           for stage in ("tokenizer", "prefill", "decode", "router") for p in cluster.pods(stage)}
    header, row = cluster.kubectl("get", "qwendeployments").strip().splitlines()
    assert header.split() == ["NAME", "READY", "TOKENIZER", "PREFILL", "DECODE", "ROUTER", "AGE"], header
    assert row.split()[:6] == ["qwen-cpu", "True", "1/1", "2/2", "2/2", "1/1"], row
    wide = cluster.kubectl("get", "pods", "-o", "wide").strip().splitlines()
    assert wide[0].split()[:7] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE"], wide[0]
    assert {line.split()[0]: line.split()[5] for line in wide[1:]} == ips, wide
    decode = sorted(n for n in ips if "-decode-" in n)[0]
    assert cluster.kubectl("logs", decode) == (cluster.state_dir / "pods" / decode / "log").read_text()


@pytest.mark.skipif(not shutil.which("nft"), reason="nft is not installed (Debian package nftables)")
def test_network_policies_admit_only_the_router_and_the_peer_stage_and_a_change_applies_within_seconds(
        network_cluster: DevCluster) -> None:
    cluster = network_cluster
    prefill = list(cluster.ready_pods("prefill", 2, timeout=30).items())
    decode = list(cluster.ready_pods("decode", 2, timeout=30).items())
    ((router_name, router),) = cluster.ready_pods("router", 1, timeout=30).items()
    (decode_name, decode_ip), (prefill_name, prefill_ip) = decode[0], prefill[0]
    with outsider() as intruder:
        # The operator's policies: decode's gRPC and prefill's (its KV export) only to the router and the peer stage.
        assert not connects(intruder, decode_ip, PORTS["decode"]), "decode admitted a process with no router labels"
        assert not connects(intruder, prefill_ip, PORTS["prefill"]), "prefill's KV export admitted an outsider"
        assert connects(intruder, router, 50050), "the router's gRPC port is public"
        assert connects(f"qs-{router_name}", decode_ip, PORTS["decode"])
        assert connects(f"qs-{router_name}", prefill_ip, PORTS["prefill"])
        assert connects(f"qs-{decode_name}", prefill_ip, PORTS["prefill"]), "decode fetches KV from prefill"
        assert not connects(f"qs-{prefill_name}", decode_ip, PORTS["decode"]), "prefill is no caller of decode"

        # A policy of the user's admitting the outsider's address to decode applies within seconds, and so does
        # its removal.
        policies = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies"
        cluster.api_write("POST", policies, {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "let-outsider-in"},
            "spec": {"podSelector": {"matchLabels": {"qwenserve.io/stage": "decode"}}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"ipBlock": {"cidr": "10.213.0.250/32"}}],
                                  "ports": [{"protocol": "TCP", "port": PORTS["decode"]}]}]}})
        started = time.monotonic()
        while not connects(intruder, decode_ip, PORTS["decode"]):
            assert time.monotonic() - started < 10, "the added policy was not enforced within 10 s"
        assert not connects(intruder, prefill_ip, PORTS["prefill"]), "the added policy admits to decode only"
        cluster.api_write("DELETE", f"{policies}/let-outsider-in")
        started = time.monotonic()
        while connects(intruder, decode_ip, PORTS["decode"]):
            assert time.monotonic() - started < 10, "the removed policy still admitted after 10 s"
            time.sleep(0.2)


def test_a_decode_pod_killed_mid_stream_is_replayed_on_the_other_and_restarted(
        network_cluster: DevCluster, reference: dict[Prompt, list[int]]) -> None:
    cluster = network_cluster
    decode = cluster.ready_pods("decode", 2, timeout=30)
    (router,) = cluster.ready_pods("router", 1, timeout=30).values()
    victim = sorted(decode)[0]
    failovers = _metric(router, "qwenserve_router_failovers_total", stage="decode")
    fetched = _fetched(decode)
    mark = len(cluster.lines)

    def kill(streams: list[Stream]) -> None:
        assert _fetched(decode)[victim] > fetched[victim], "no stream started on the victim"
        os.kill(_pid(cluster, victim), signal.SIGKILL)

    _check_against(reference, asyncio.run(_run(cluster.grpc, STREAMS, while_running=kill)))
    assert _metric(router, "qwenserve_router_failovers_total", stage="decode") > failovers

    cluster.wait_for(rf"pod {victim}: restarting: exited", timeout=30, start=mark)
    deadline = time.monotonic() + 120
    while True:
        pod = next(p for p in cluster.pods("decode") if p["metadata"]["name"] == victim)
        if pod_ready(pod) and pod["status"]["containerStatuses"][0]["restartCount"] == 1:
            break
        assert time.monotonic() < deadline, f"{victim} did not come back: {pod}"
        time.sleep(1)
    assert pod["status"]["podIP"] == decode[victim]
    # Its metrics start again from zero: a handoff counted now was served by the restarted container.
    _serves(cluster, decode[victim], reference, f"restarted {victim}")


def _fetched(decode: dict[str, str]) -> dict[str, float]:
    """Handoff bytes each decode pod has fetched over the network: it grows with every request a pod takes."""
    return {name: _metric(ip, "qwenserve_handoff_bytes_total", transport="grpc") for name, ip in decode.items()}


def _serves(cluster: DevCluster, ip: str, reference: dict[Prompt, list[int]], what: str) -> None:
    """Requests through the router until the decode pod at `ip` has fetched a handoff (within 60 s)."""
    deadline = time.monotonic() + 60
    rounds = 0
    while _metric(ip, "qwenserve_handoff_bytes_total", transport="grpc") == 0:
        assert time.monotonic() < deadline, f"{what} got no request in {rounds} rounds"
        batch = PLAIN[(rounds * 8) % 40:][:8]
        _check_against(reference, asyncio.run(_run(cluster.grpc, batch)))
        rounds += 1


def test_decode_scaled_to_three_gives_the_new_pod_traffic_and_back_to_one_drains_the_streams(
        network_cluster: DevCluster, reference: dict[Prompt, list[int]]) -> None:
    cluster = network_cluster
    before = cluster.ready_pods("decode", 2, timeout=120)
    (router,) = cluster.ready_pods("router", 1, timeout=30).values()

    if KUBECTL:  # as a user changes a deployment: the file applied again, with the ready line's kubeconfig
        assert "qwendeployment.qwenserve.io/qwen-cpu configured" in cluster.apply_replicas("decode", 3)
    else:
        cluster.scale("decode", 3)
    decode = cluster.ready_pods("decode", 3, timeout=150)
    (new,) = set(decode) - set(before)
    _serves(cluster, decode[new], reference, f"new pod {new}")

    failovers = _metric(router, "qwenserve_router_failovers_total", stage="decode")
    streams, removed, draining = asyncio.run(_scale_down_under_load(cluster, decode, "decode", 1))
    _check_against(reference, streams)
    # The removed pods drained: the router saw their streams finishing after they left DNS (at least one of them
    # while GetStatus looked), none failed over, and each stopped on SIGTERM within its grace period.
    assert {f"{decode[name]}:{PORTS['decode']}" for name in removed} & draining, (removed, draining)
    assert _metric(router, "qwenserve_router_failovers_total", stage="decode") == failovers
    (kept,) = cluster.ready_pods("decode", 1, timeout=60)
    assert kept not in removed
    logs = cluster.pod_logs()
    for name in removed:
        assert "draining (grace" in logs[name], f"{name} did not drain:\n{logs[name][-2000:]}"
    decode_rows = [row for row in _status(cluster.grpc) if row["stage"] == "decode"]
    assert [row["address"] for row in decode_rows] == [f"{decode[kept]}:{PORTS['decode']}"], decode_rows
    _no_unknown_flags(cluster, pods=7)  # 6 at the start and the third decode pod


async def _status_or_none(stub: router_pb2_grpc.RouterStub) -> router_pb2.GetStatusResponse | None:
    """The router's status, or None when it took over 10 s: a router on two cores shared with nine streams and
    the stopping pods can be that slow to answer, and the caller's loop, which has its own deadline, asks again."""
    try:
        return await stub.GetStatus(router_pb2.GetStatusRequest(), timeout=10)
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
        return None


async def _scale_down_under_load(cluster: DevCluster, pods: dict[str, str], stage: str, replicas: int,
                                 in_flight: int = 9, timeout: float = 120) -> tuple[list[Stream], list[str], set[str]]:
    """Scale `stage` down while `in_flight` long streams keep running (a finished one is replaced), until the
    router has shown every removed pod DRAINING; then let the streams end. Returns every stream, the removed
    pods and the addresses GetStatus showed DRAINING. (The operator reacts to a patch within seconds on an idle
    machine and in tens of seconds on two busy cores, so the load is kept up rather than timed.)"""
    mark = len(cluster.lines)
    streams: list[Stream] = []
    tasks: list[asyncio.Task[Stream]] = []
    draining: set[str] = set()
    async with grpc.aio.insecure_channel(cluster.grpc, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        def keep_up() -> None:
            while sum(not t.done() for t in tasks) < in_flight:
                streams.append(Stream(DRAINED[len(streams) % len(DRAINED)]))
                tasks.append(asyncio.create_task(_generate(stub, streams[-1])))

        keep_up()
        while not all(len(s.tokens) >= 2 for s in streams):
            await asyncio.sleep(0.05)
        # A pod with no stream when it leaves drains at once, unseen: start only once each has some running.
        settle = time.monotonic() + 30
        while time.monotonic() < settle:
            status = await _status_or_none(stub)
            if status is not None and all(row.running > 0 for row in status.stages
                                          if row.stage == stage and row.load_known):
                break
            keep_up()
            await asyncio.sleep(0.2)
        await asyncio.to_thread(cluster.patch_replicas, stage, replicas)
        deadline = time.monotonic() + timeout
        while True:
            removed = re.findall(r"pod (\S+): stopping \(scaled to", "\n".join(cluster.lines[mark:]))
            status = await _status_or_none(stub)
            draining |= {row.address for row in (status.stages if status is not None else ())
                         if row.stage == stage and row.state == "DRAINING"}
            if len(removed) == len(pods) - replicas:
                # Each removed pod was seen DRAINING, or is gone already: on two busy cores GetStatus can take
                # seconds, and a pod whose streams ended between two answers drains unseen.
                present = {p["metadata"]["name"] for p in await asyncio.to_thread(cluster.pods, stage)}
                if all(f"{pods[n]}:{PORTS[stage]}" in draining or n not in present for n in removed):
                    break
            assert time.monotonic() < deadline, (removed, draining, cluster.lines[mark:])
            keep_up()
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks)
    return streams, removed, draining


def test_a_decode_rollout_to_another_kv_layout_refuses_the_mismatched_handoffs_and_recomputes_them(
        network_cluster: DevCluster, rollout_references: dict[str, dict[Prompt, list[int]]]) -> None:
    cluster = network_cluster
    old = set(cluster.ready_pods("decode", cluster.replicas("decode"), timeout=90))  # earlier tests' pods gone
    mark = len(cluster.lines)
    # A bf16 KV cache: prefill's handoffs (fp32 KV) no longer fit decode's layout once the new pods serve.
    cluster.api_write("PATCH", "/apis/qwenserve.io/v1alpha1/namespaces/default/qwendeployments/qwen-cpu",
                      {"spec": {"stages": {"decode": {"args": [*STAGE_ARGS["decode"], "--kv-cache-dtype", "bfloat16"]}}}})
    stopped: list[float] = []

    def rolled() -> bool:
        """Every old pod has left DNS (replaced by ready new ones) for long enough that the router (resolving
        every second) sends nothing more to them; they drain what they have meanwhile."""
        lines = "\n".join(cluster.lines[mark:])
        if not stopped and all(f"pod {name}: stopping (replaced by a new template)" in lines for name in old):
            stopped.append(time.monotonic())
        return bool(stopped) and time.monotonic() - stopped[0] > 3

    during = asyncio.run(_keep_streaming(cluster.grpc, ROLLED, until=rolled, timeout=180, in_flight=2))
    new = {p["metadata"]["name"]: p["status"]["podIP"] for p in cluster.pods("decode")
           if p["metadata"]["name"] not in old and pod_ready(p)}
    assert len(new) == len(old), (old, new)
    after = asyncio.run(_run(cluster.grpc, ROLLED[:6]))

    fp32, bf16 = rollout_references["float32"], rollout_references["bfloat16"]
    for s in during + after:  # one terminal answer each, never an error or a garbled mix of the two layouts
        assert s.finish_reason == common_pb2.FINISH_REASON_LENGTH, (s.finish_reason, len(s.tokens))
        assert s.tokens in (fp32[s.prompt], bf16[s.prompt]), f"prompt {s.prompt.ids[:4]}...: neither layout's tokens"
    assert all(s.tokens == bf16[s.prompt] for s in after)  # the new pods computed every prompt themselves
    assert len(during) >= 6, "the load did not overlap the rollout"
    refused = sum(_metric(ip, "qwenserve_handoff_failures_total", reason="protocol") for ip in new.values())
    assert refused >= len(after), f"the new pods counted {refused} refused handoffs"
    assert sum(_metric(ip, "qwenserve_handoff_bytes_total", transport="grpc") for ip in new.values()) == 0


@pytest.mark.skipif(not KUBECTL, reason="kubectl is not installed")
@pytest.mark.timeout(240)
def test_kubectl_delete_of_the_qwendeployment_stops_every_pod(network_cluster: DevCluster) -> None:
    cluster = network_cluster
    # kubectl waits until the object is gone: the operator's finalizer is removed within a second or two. (It took
    # 60-240 s while the emulator kept one resourceVersion for every state, so that kopf took stale events for
    # current ones and re-ran its handlers, and while kopf waited out its 60 s re-check of the autoscaling timer.)
    started = time.monotonic()
    assert 'qwendeployment.qwenserve.io "qwen-cpu" deleted' in cluster.kubectl("delete", "qwendeployment", "qwen-cpu",
                                                                                timeout=60)
    assert not cluster.kubectl("get", "qwendeployments", "-o", "name").strip()
    assert time.monotonic() - started < 30
    # Its Deployments go with it (owner references), so the pod runner stops their pods (preStop, SIGTERM).
    deadline = time.monotonic() + 90
    while cluster.kubectl("get", "pods", "-o", "name").strip():
        assert time.monotonic() < deadline, cluster.kubectl("get", "pods")
        time.sleep(1)
    assert cluster.kubectl("get", "deployments,services,configmaps,networkpolicies", "-o", "name").strip() == ""
