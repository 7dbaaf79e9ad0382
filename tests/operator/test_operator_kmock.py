"""The operator under kopf against the kmock Kubernetes emulator: the real handlers, a fake API server."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

NAMESPACE = "ns1"  # the namespace the `run_operator` fixture watches
QD = "qwenserve.io/v1alpha1/qwendeployments"
DEPLOYMENTS = "apps/v1/deployments"
SERVICES = "v1/services"
CONFIGMAPS = "v1/configmaps"
PODS = "v1/pods"
NETWORK_POLICIES = "networking.k8s.io/v1/networkpolicies"
SECRETS = "v1/secrets"

STAGES = ("tokenizer", "prefill", "decode", "router")
SPEC = {"model": {"name": "Qwen/Qwen3-0.6B"}}


def _path(resource: str, name: str, subresource: str = "") -> str:
    prefix = {"deployments": "/apis/apps/v1", "qwendeployments": "/apis/qwenserve.io/v1alpha1",
              "networkpolicies": "/apis/networking.k8s.io/v1"}.get(
        resource.rsplit("/", 1)[-1], "/api/v1")
    return f"{prefix}/namespaces/{NAMESPACE}/{resource.rsplit('/', 1)[-1]}/{name}{subresource}"


async def _patch(k8s, resource: str, name: str, body: dict[str, Any], subresource: str = "") -> None:
    headers = {"Content-Type": "application/merge-patch+json"}
    async with k8s.patch(_path(resource, name, subresource), json=body, headers=headers) as response:
        assert response.status == 200, await response.text()


async def _delete(k8s, resource: str, name: str) -> None:
    async with k8s.delete(_path(resource, name)) as response:
        assert response.status == 200, await response.text()


def _condition(live, kind: str) -> dict[str, Any] | None:
    status = (live(QD, "demo") or {}).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


def _posted_events(k8s) -> list[dict[str, Any]]:
    return [r.data for r in list(k8s)
            if r.method.value == "POST" and str(r.url.path).endswith("/events") and isinstance(r.data, dict)]


async def _all_children(live, eventually) -> dict[str, dict[str, Any]]:
    names = [(CONFIGMAPS, "demo-config")]
    names += [(kind, f"demo-{stage}") for stage in STAGES for kind in (DEPLOYMENTS, SERVICES, NETWORK_POLICIES)]
    await eventually(lambda: all(live(kind, name) for kind, name in names), what="every child")
    return {f"{kind}:{name}": live(kind, name) for kind, name in names}


async def test_create_makes_every_child_with_owner_references_and_status_follows_readiness(k8s, run_operator, live, eventually, qwendeployment):
    k8s.objects[QD, NAMESPACE, "demo"] = qwendeployment("demo", SPEC)
    await run_operator()

    children = await _all_children(live, eventually)
    for key, child in children.items():
        owner = child["metadata"]["ownerReferences"]
        assert owner == [{"apiVersion": "qwenserve.io/v1alpha1", "kind": "QwenDeployment", "name": "demo",
                          "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}], key
        assert child["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    router_env = children["v1/configmaps:demo-config"]["data"]
    assert router_env["QWENSERVE_PREFILL"] == "demo-prefill.ns1.svc.cluster.local:50052"

    await eventually(lambda: _condition(live, "Ready"), what="conditions")
    status = live(QD, "demo")["status"]
    assert status["routerEndpoint"] == "http://demo-router.ns1.svc.cluster.local:8000"
    assert status["stages"]["decode"] == {"desiredReplicas": 1, "readyReplicas": 0, "summary": "0/1",
                                          "autoscaled": False}
    assert _condition(live, "Ready")["status"] == "False"

    # The Deployment controller's part: pods become ready; the operator notices through the watch.
    for stage in STAGES:
        await _patch(k8s, DEPLOYMENTS, f"demo-{stage}",
                     {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}, "/status")
    ready = await eventually(lambda: (c := _condition(live, "Ready")) and c["status"] == "True" and c,
                             what="Ready=True")
    assert ready["reason"] == "AllStagesReady"
    assert live(QD, "demo")["status"]["stages"]["router"]["summary"] == "1/1"
    assert _condition(live, "Progressing")["status"] == "False"
    assert _condition(live, "Degraded")["status"] == "False"


async def test_spec_change_patches_the_children(k8s, run_operator, live, eventually, qwendeployment):
    k8s.objects[QD, NAMESPACE, "demo"] = qwendeployment("demo", SPEC)
    await run_operator()
    await _all_children(live, eventually)

    await _patch(k8s, QD, "demo", {"spec": {"image": {"tag": "0.2.0"}, "kvTransfer": {"mode": "shm"},
                                            "stages": {"decode": {"replicas": 3}}}})

    def decode_updated() -> bool:
        spec = live(DEPLOYMENTS, "demo-decode")["spec"]
        container = spec["template"]["spec"]["containers"][0]
        return spec["replicas"] == 3 and container["image"].endswith(":0.2.0")

    await eventually(decode_updated, what="decode patched")
    pod = live(DEPLOYMENTS, "demo-decode")["spec"]["template"]["spec"]
    assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert live(DEPLOYMENTS, "demo-tokenizer")["spec"]["template"]["spec"]["containers"][0][
        "image"].endswith(":0.2.0")
    await eventually(lambda: live(QD, "demo")["status"]["stages"]["decode"]["desiredReplicas"] == 3,
                     what="status follows the new replicas")


async def test_the_stage_secret_is_made_once_and_never_read(k8s, run_operator, live, eventually, qwendeployment):
    k8s.objects[QD, NAMESPACE, "demo"] = qwendeployment("demo", SPEC)
    await run_operator()
    await _all_children(live, eventually)
    secret = live(SECRETS, "demo-stage-secret")
    assert secret["metadata"]["ownerReferences"][0]["name"] == "demo"
    value = secret["data"]["secret"]
    assert len(base64.b64decode(value)) >= 32

    await _patch(k8s, QD, "demo", {"spec": {"stages": {"decode": {"replicas": 2}}}})
    await eventually(lambda: live(DEPLOYMENTS, "demo-decode")["spec"]["replicas"] == 2, what="another pass")
    assert live(SECRETS, "demo-stage-secret")["data"]["secret"] == value  # a later pass keeps the value
    secret_calls = {r.method.value for r in list(k8s) if "/secrets" in str(r.url.path)}
    assert secret_calls == {"POST"}  # created only: the operator neither reads nor lists Secrets


async def test_children_deleted_or_edited_by_hand_are_restored(k8s, run_operator, live, eventually, qwendeployment):
    k8s.objects[QD, NAMESPACE, "demo"] = qwendeployment("demo", SPEC)
    await run_operator(interval=0.5)
    await _all_children(live, eventually)

    await _delete(k8s, DEPLOYMENTS, "demo-prefill")
    await _delete(k8s, CONFIGMAPS, "demo-config")
    await _delete(k8s, SERVICES, "demo-decode")
    await _delete(k8s, NETWORK_POLICIES, "demo-prefill")
    await _patch(k8s, DEPLOYMENTS, "demo-router", {"spec": {"replicas": 7}})

    await eventually(lambda: live(DEPLOYMENTS, "demo-prefill"), what="prefill restored")
    await eventually(lambda: live(CONFIGMAPS, "demo-config"), what="config restored")
    await eventually(lambda: live(SERVICES, "demo-decode"), what="service restored")
    await eventually(lambda: live(NETWORK_POLICIES, "demo-prefill"), what="network policy restored")
    await eventually(lambda: live(DEPLOYMENTS, "demo-router")["spec"]["replicas"] == 1,
                     what="router replicas reverted by the timer")
    assert live(DEPLOYMENTS, "demo-prefill")["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def _metrics(waiting: float = 0, running: float = 0, kv: float = 0.0) -> str:
    return (
        "# TYPE qwenserve_engine_waiting_requests gauge\n"
        f"qwenserve_engine_waiting_requests {waiting}\n"
        "# TYPE qwenserve_engine_running_requests gauge\n"
        f"qwenserve_engine_running_requests {running}\n"
        "# TYPE qwenserve_kv_blocks_usage_ratio gauge\n"
        f"qwenserve_kv_blocks_usage_ratio {kv}\n"
    )


def _pod(name: str, stage: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "resourceVersion": "1",
                     "labels": {"qwenserve.io/deployment": "demo", "qwenserve.io/stage": stage}},
        "spec": {"containers": [{"name": stage, "ports": [{"name": "metrics", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }


async def test_autoscaler_scales_prefill_on_queue_depth_and_posts_an_event(k8s, run_operator, fake_metrics, live, eventually, qwendeployment):
    spec = {**SPEC, "stages": {
        "prefill": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 4}},
        "decode": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2}},
    }}
    k8s.objects[QD, NAMESPACE, "demo"] = qwendeployment("demo", spec)
    prefill_port = await fake_metrics.add_pod("demo-prefill-a", _metrics(waiting=1))
    decode_port = await fake_metrics.add_pod("demo-decode-a", _metrics(running=3, kv=0.1))
    k8s.objects[PODS, NAMESPACE, "demo-prefill-a"] = _pod("demo-prefill-a", "prefill", prefill_port)
    k8s.objects[PODS, NAMESPACE, "demo-decode-a"] = _pod("demo-decode-a", "decode", decode_port)
    await run_operator(interval=0.3)
    await _all_children(live, eventually)
    await eventually(lambda: "demo-prefill-a" in fake_metrics.hits, what="a scrape")
    assert live(DEPLOYMENTS, "demo-prefill")["spec"]["replicas"] == 1

    # A burst: 20 prompts queued on prefill -> ceil(20 / 4) = 5 wanted, capped by maxReplicas = 3.
    fake_metrics.texts["demo-prefill-a"] = _metrics(waiting=20)
    await eventually(lambda: live(DEPLOYMENTS, "demo-prefill")["spec"]["replicas"] == 3,
                     what="prefill scaled to its max")
    events = await eventually(lambda: [e for e in _posted_events(k8s) if e.get("reason") == "ScaledUp"],
                              what="a ScaledUp event")
    assert "prefill: 1 -> 3" in events[0]["message"]
    assert events[0]["involvedObject"]["name"] == "demo"
    stage_status = await eventually(lambda: live(QD, "demo")["status"]["stages"]["prefill"].get(
        "lastScaleReason") and live(QD, "demo")["status"]["stages"]["prefill"], what="scale status")
    assert stage_status["autoscaled"] is True and stage_status["desiredReplicas"] == 3
    # Decode was idle and stays at its minimum: the ratio 3:1 is inside the default 0.25..4.
    assert live(DEPLOYMENTS, "demo-decode")["spec"]["replicas"] == 1


async def test_a_deletion_during_a_hanging_scrape_abandons_the_pass_and_the_object_goes_at_once(
        k8s, run_operator, live, eventually, qwendeployment):
    # A pod whose metrics port accepts and never answers: the timer's pass waits on it for the scrape timeout (30 s).
    connections: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.read()  # until the client goes

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    try:
        spec = {**SPEC, "stages": {"prefill": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2}}}}
        k8s.objects[QD, NAMESPACE, "demo"] = qwendeployment("demo", spec)
        await run_operator(interval=0.3, scrape_timeout=30.0)
        await _all_children(live, eventually)
        k8s.objects[PODS, NAMESPACE, "demo-prefill-a"] = _pod("demo-prefill-a", "prefill",
                                                               server.sockets[0].getsockname()[1])
        await eventually(lambda: live(QD, "demo")["metadata"].get("finalizers"), what="the operator's finalizer")
        await eventually(lambda: connections, what="a scrape hanging")
        started = time.monotonic()
        await _delete(k8s, QD, "demo")
        # kopf removes the finalizer once the timer has exited: the pass is abandoned, not waited for.
        await eventually(lambda: live(QD, "demo") is None, timeout=10, what="the object gone")
        assert time.monotonic() - started < 5
    finally:
        for writer in connections:
            writer.close()
        server.close()
