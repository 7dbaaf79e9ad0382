"""Manifest builders: pure functions from a spec to the children, over many specs."""

from __future__ import annotations

import base64
from typing import Any

import kubernetes_validate
import pytest
import yaml

from qwenserve.router.models import parse_models
from qwenserve_operator import manifests, naming, pod_template, router_config
from qwenserve_operator.crd import STAGES

K8S_VERSION = "1.37.0"
UID = "0b7d1c2e-0000-4000-8000-000000000001"

VARIANTS: dict[str, dict[str, Any]] = {
    "minimal": {},
    "shm": {"kvTransfer": {"mode": "shm"}},
    "mooncake": {"kvTransfer": {"mode": "mooncake"}},
    "hf": {"model": {"source": "hf", "hf": {"repo": "hf://Qwen/Qwen3-0.6B", "revision": "v1",
                                            "tokenSecretRef": {"name": "hf-token"}, "sizeLimit": "20Gi"}}},
    "pvc": {"model": {"source": "pvc", "pvc": {"claimName": "weights", "subPath": "Qwen3-0.6B"}}},
    "hostpath": {"model": {"source": "hostPath", "hostPath": "/srv/models/qwen"}},
    "gpu": {"stages": {"decode": {"resources": {"limits": {"nvidia.com/gpu": 1}},
                                  "nodeSelector": {"gpu": "true"},
                                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                                  "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                                      "nodeSelectorTerms": [{"matchExpressions": [
                                          {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}}}},
    "secrets": {"redis": {"urlSecretRef": {"name": "r", "key": "url"}}, "apiKeysSecret": {"name": "keys"},
                "telemetry": {"otlpEndpoint": "http://otel:4317"}, "image": {"pullSecrets": ["regcred"]}},
    "extra": {"stages": {"router": {"args": ["--log-requests"], "env": [{"name": "X", "value": "1"}]}},
              "routerService": {"type": "LoadBalancer", "annotations": {"a": "b"}}},
    "per-stage-precision": {"stages": {"decode": {"model": {"name": "Qwen/Qwen3-0.6B-AWQ", "source": "hf",
                                                           "hf": {"repo": "Qwen/Qwen3-0.6B-AWQ"}}}}},
    "monitoring": {"telemetry": {"monitoringNamespaceSelector": {
        "matchExpressions": [{"key": "team", "operator": "In", "values": ["obs", "sre"]}]}}},
}


def _children(spec: dict[str, Any], replicas: dict[str, int] | None = None) -> list[dict[str, Any]]:
    return manifests.children("demo", "ns1", UID, spec, replicas or {s: 1 for s in STAGES})


def _by(children: list[dict[str, Any]], kind: str, stage: str) -> dict[str, Any]:
    return next(c for c in children if c["kind"] == kind and c["metadata"]["name"] == f"demo-{stage}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_child_is_a_valid_kubernetes_object(make_spec, variant: str) -> None:
    children = _children(make_spec(**VARIANTS[variant]))
    assert len(children) == 1 + 3 * len(STAGES)  # the ConfigMap; a Service, Deployment, NetworkPolicy each
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
        assert child["metadata"]["ownerReferences"][0]["uid"] == UID
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == naming.MANAGER


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pods_run_as_non_root_with_a_read_only_root_and_no_capabilities(make_spec, variant: str) -> None:
    for stage in STAGES:
        pod = _by(_children(make_spec(**VARIANTS[variant])), "Deployment", stage)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        context = pod["containers"][0]["securityContext"]
        assert context["readOnlyRootFilesystem"] is True and context["capabilities"] == {"drop": ["ALL"]}
        assert context["allowPrivilegeEscalation"] is False


def test_stage_arguments_follow_the_container_contract(make_spec) -> None:
    spec = make_spec(kvTransfer={"mode": "shm"})
    assert pod_template.stage_args("demo", "ns1", "tokenizer", spec) == [
        "serve", "tokenizer", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9090",
        "--grace-s", str(spec["stages"]["tokenizer"]["terminationGracePeriodSeconds"] - 7),
        "--stage-secret-file", "/etc/qwen-serve/stage-secrets/demo/secret", "--model", "/models/model"]
    assert pod_template.stage_args("demo", "ns1", "prefill", spec)[-8:] == [
        "--model", "/models/model", "--kv-transfer", "shm", "--served-model-name", "Qwen/Qwen3-0.6B",
        "--advertise-host", "$(POD_IP)"]
    assert pod_template.stage_args("demo", "ns1", "decode", spec)[-6:] == [
        "--model", "/models/model", "--kv-transfer", "shm", "--served-model-name", "Qwen/Qwen3-0.6B"]
    assert pod_template.stage_args("demo", "ns1", "router", spec)[:4] == ["serve", "router", "--host", "0.0.0.0"]


def test_each_stage_drains_within_its_pods_grace_period(make_spec) -> None:
    spec = make_spec()
    for stage in ("tokenizer", "prefill", "decode", "router"):
        pod = _by(_children(spec), "Deployment", stage)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = container["args"]
        drain = float(args[args.index("--grace-s") + 1])
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert 0 < drain and pre_stop + drain < pod["terminationGracePeriodSeconds"], (stage, drain)


@pytest.mark.parametrize("mode", ["network", "shm"])
def test_prefill_advertises_its_pod_ip_from_the_downward_api_never_its_bind_address(make_spec, mode: str) -> None:
    container = _by(_children(make_spec(kvTransfer={"mode": mode})), "Deployment", "prefill")[
        "spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    args = container["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"  # binds every address...
    assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"  # ...and hands out the pod's own


def test_router_is_configured_with_the_service_dns_names(make_spec) -> None:
    children = _children(make_spec(redis={"url": "redis://r:6379/0"}))
    config = next(c for c in children if c["kind"] == "ConfigMap")["data"]
    assert config["QWENSERVE_TOKENIZER"] == "demo-tokenizer.ns1.svc.cluster.local:50051"
    assert config["QWENSERVE_PREFILL"] == "demo-prefill.ns1.svc.cluster.local:50052"
    assert config["QWENSERVE_DECODE"] == "demo-decode.ns1.svc.cluster.local:50053"
    assert config["QWENSERVE_REDIS_URL"] == "redis://r:6379/0"
    router = _by(children, "Deployment", "router")
    assert router["spec"]["template"]["spec"]["containers"][0]["envFrom"] == [
        {"configMapRef": {"name": "demo-config"}}]
    digest = router["spec"]["template"]["metadata"]["annotations"]["qwenserve.io/config-hash"]
    assert digest == router_config.config_hash(next(c for c in children if c["kind"] == "ConfigMap"))


def test_a_config_change_rolls_the_router(make_spec) -> None:
    def digest(spec: dict[str, Any]) -> str:
        return _by(_children(spec), "Deployment", "router")["spec"]["template"]["metadata"]["annotations"][
            "qwenserve.io/config-hash"]

    assert digest(make_spec()) != digest(make_spec(rateLimits={"requestsPerMinute": 10}))


def test_worker_services_are_headless_and_the_router_service_is_not(make_spec) -> None:
    children = _children(make_spec(routerService={"type": "LoadBalancer"}))
    for stage in ("tokenizer", "prefill", "decode"):
        assert _by(children, "Service", stage)["spec"]["clusterIP"] == "None"
    router = _by(children, "Service", "router")["spec"]
    assert router["type"] == "LoadBalancer" and "clusterIP" not in router
    assert {p["name"] for p in router["ports"]} == {"grpc", "http", "metrics"}


def test_probes_are_native_grpc_on_each_stage_port(make_spec) -> None:
    for stage in STAGES:
        container = _by(_children(make_spec()), "Deployment", stage)["spec"]["template"]["spec"]["containers"][0]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["grpc"] == {"port": naming.GRPC_PORTS[stage]}


def test_shm_mode_colocates_decode_with_prefill_through_the_node_shm(make_spec) -> None:
    children = _children(make_spec(kvTransfer={"mode": "shm"}))
    decode = _by(children, "Deployment", "decode")["spec"]["template"]["spec"]
    prefill = _by(children, "Deployment", "prefill")["spec"]["template"]["spec"]
    required = decode["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == [{"labelSelector": {"matchLabels": {"qwenserve.io/deployment": "demo",
                                                           "qwenserve.io/stage": "prefill"}},
                         "topologyKey": "kubernetes.io/hostname"}]
    assert prefill["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    for pod in (decode, prefill):
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
        assert "topologySpreadConstraints" not in pod


@pytest.mark.parametrize("mode", ["shm", "network", "mooncake"])
def test_prefill_and_decode_are_told_the_transport_and_decode_advertises_its_pod_for_mooncake(make_spec, mode) -> None:
    children = _children(make_spec(kvTransfer={"mode": mode}))
    for stage in ("prefill", "decode"):
        args = _by(children, "Deployment", stage)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--kv-transfer") + 1] == mode
        advertised = stage == "prefill" or mode == "mooncake"
        assert ("--advertise-host" in args) is advertised
        if advertised:
            assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"


@pytest.mark.parametrize("mode", ["network", "mooncake"])
def test_network_transports_spread_and_use_a_private_shm(make_spec, mode) -> None:
    children = _children(make_spec(kvTransfer={"mode": mode}))
    for stage in ("prefill", "decode"):
        pod = _by(children, "Deployment", stage)["spec"]["template"]["spec"]
        assert "affinity" not in pod
        assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
        assert next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"] == {"medium": "Memory"}
        assert not any("hostPath" in v for v in pod["volumes"])


def test_user_affinity_is_kept_beside_the_colocation_terms(make_spec) -> None:
    spec = make_spec(kvTransfer={"mode": "shm"}, **VARIANTS["gpu"])
    decode = _by(_children(spec), "Deployment", "decode")["spec"]["template"]["spec"]
    assert decode["affinity"]["nodeAffinity"] == VARIANTS["gpu"]["stages"]["decode"]["affinity"]["nodeAffinity"]
    assert decode["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert spec["stages"]["decode"]["affinity"].get("podAffinity") is None  # the spec is not mutated


def test_decode_gets_a_drain_grace_and_a_pre_stop_pause(make_spec) -> None:
    spec = make_spec(stages={"decode": {"terminationGracePeriodSeconds": 600}})
    pod = _by(_children(spec), "Deployment", "decode")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 600
    assert pod["containers"][0]["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    strategy = _by(_children(spec), "Deployment", "decode")["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


@pytest.mark.parametrize(("source", "extra", "mount"), [
    ("image", {"path": "/opt/m"}, None),
    ("pvc", {"pvc": {"claimName": "w", "subPath": "q"}}, {"name": "model", "mountPath": "/models/Qwen3-0.6B",
                                                          "readOnly": True, "subPath": "q"}),
    ("hostPath", {"hostPath": "/srv/q"}, {"name": "model", "mountPath": "/models/Qwen3-0.6B", "readOnly": True}),
])
def test_model_source_becomes_a_volume_and_the_model_flag(make_spec, source, extra, mount) -> None:
    spec = make_spec(model={"source": source, **extra})
    children = _children(spec)
    # Every stage reads the checkpoint: the router too, for its detokenizer and context length.
    for stage in ("tokenizer", "prefill", "decode", "router"):
        container = _by(children, "Deployment", stage)["spec"]["template"]["spec"]["containers"][0]
        model_mounts = [m for m in container["volumeMounts"] if m["name"] == "model"]
        assert model_mounts == ([mount] if mount else [])
        assert container["args"][container["args"].index("--model") + 1] == naming.model_dir(spec)


@pytest.mark.parametrize("token", [True, False])
def test_an_hf_model_is_downloaded_by_an_init_container_into_a_volume_every_stage_reads(make_spec, token) -> None:
    hf: dict[str, Any] = {"repo": "Qwen/Qwen3-0.6B", "revision": "c1899de"}
    if token:
        hf["tokenSecretRef"] = {"name": "hf-token"}
    children = _children(make_spec(model={"source": "hf", "hf": hf}))
    for stage in ("tokenizer", "prefill", "decode", "router"):
        pod = _by(children, "Deployment", stage)["spec"]["template"]["spec"]
        [fetch] = pod["initContainers"]
        assert fetch["args"] == ["model", "fetch", "hf://Qwen/Qwen3-0.6B", "--dir", "/models/Qwen3-0.6B",
                                 "--revision", "c1899de"]
        assert fetch["image"] == pod["containers"][0]["image"] and fetch["securityContext"]["readOnlyRootFilesystem"]
        env = {e["name"]: e for e in fetch["env"]}
        if token:  # the Secret's default key
            assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
        else:
            assert "HF_TOKEN" not in env
        assert env["HOME"]["value"].startswith("/tmp") and env["HF_HOME"]["value"].startswith("/tmp")
        assert next(v for v in pod["volumes"] if v["name"] == "model") == {"name": "model", "emptyDir": {}}
        # The init container writes the volume; the stage reads it, read-only, at the path its --model names.
        assert {"name": "model", "mountPath": "/models/Qwen3-0.6B"} in fetch["volumeMounts"]
        assert {"name": "tmp", "mountPath": "/tmp"} in fetch["volumeMounts"]
        container = pod["containers"][0]
        assert {"name": "model", "mountPath": "/models/Qwen3-0.6B", "readOnly": True} in container["volumeMounts"]
        assert container["args"][container["args"].index("--model") + 1] == "/models/Qwen3-0.6B"


def test_other_model_sources_have_no_init_container(make_spec) -> None:
    for variant in ("minimal", "pvc", "hostpath"):
        for stage in STAGES:
            pod = _by(_children(make_spec(**VARIANTS[variant])), "Deployment", stage)["spec"]["template"]["spec"]
            assert "initContainers" not in pod


def test_api_keys_and_redis_secret_reach_only_the_router(make_spec) -> None:
    children = _children(make_spec(**VARIANTS["secrets"]))
    router = _by(children, "Deployment", "router")["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert args[args.index("--api-keys-file") + 1] == "/etc/qwen-serve/api-keys/api-keys.yaml"
    env = {e["name"]: e for e in router["containers"][0]["env"]}
    assert env["QWENSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "r", "key": "url"}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel:4317"
    decode = _by(children, "Deployment", "decode")["spec"]["template"]["spec"]
    assert "QWENSERVE_REDIS_URL" not in {e["name"] for e in decode["containers"][0]["env"]}
    assert decode["imagePullSecrets"] == [{"name": "regcred"}]


@pytest.mark.parametrize(("autoscaling", "autoscaled", "expected"), [
    ({"enabled": False}, {"decode": 7}, 2),  # off: the spec's replicas, whatever the autoscaler said
    ({"enabled": True, "minReplicas": 1, "maxReplicas": 5}, {"decode": 4}, 4),
    ({"enabled": True, "minReplicas": 1, "maxReplicas": 5}, {"decode": 9}, 5),  # bounds hold
    ({"enabled": True, "minReplicas": 3, "maxReplicas": 5}, {}, 3),  # first time: spec replicas, raised to min
])
def test_replicas_come_from_the_spec_or_the_autoscaler_within_bounds(make_spec, autoscaling, autoscaled,
                                                                     expected) -> None:
    spec = make_spec(stages={"decode": {"replicas": 2, "autoscaling": autoscaling}})
    assert manifests.spec_replicas(spec, "decode", autoscaled) == expected


def test_tokenizer_and_router_always_use_the_spec_replicas(make_spec) -> None:
    spec = make_spec(stages={"router": {"replicas": 3}})
    assert manifests.spec_replicas(spec, "router", {"router": 9}) == 3


@pytest.mark.parametrize(("spec", "problem"), [
    ({"model": {"name": "m", "source": "pvc"}}, "pvc.claimName"),
    ({"model": {"name": "m", "source": "hostPath"}}, "hostPath"),
    ({"model": {"name": "m", "source": "hf"}}, "hf.repo"),
    ({"model": {"name": "m"}, "stages": {"prefill": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}},
     "minReplicas"),
    ({"model": {"name": "m"}, "prefillDecodeRatio": {"min": 3, "max": 1}}, "prefillDecodeRatio"),
    ({"model": {}}, "model.name"),
])
def test_validate_spec_names_the_problem(spec, problem) -> None:
    from qwenserve_operator.crd import with_defaults

    problems = manifests.validate_spec(with_defaults(spec))
    assert problems and problem in problems[0]


def test_a_valid_spec_has_no_problems(make_spec) -> None:
    assert manifests.validate_spec(make_spec(**VARIANTS["pvc"])) == []


def test_the_router_environment_uses_names_the_router_reads(make_spec, monkeypatch) -> None:
    from qwenserve.flags import env_name
    from qwenserve.stages.router import parse_config

    spec = make_spec(rateLimits={"requestsPerMinute": 60, "tokensPerMinute": 0, "failOpen": False})
    env = router_config.router_environment("demo", "ns", spec)
    assert env["QWENSERVE_DEFAULT_REQUESTS_PER_MINUTE"] == "60"
    assert "QWENSERVE_DEFAULT_TOKENS_PER_MINUTE" not in env  # 0 means unlimited
    assert env["QWENSERVE_RATELIMIT_FAILURE_MODE"] == "closed"
    assert env["QWENSERVE_NO_AUTH"] == "true"  # no API key Secret in this spec
    for flag in ("--tokenizer", "--prefill", "--decode", "--prefill-metrics", "--served-model-name"):
        assert env_name(flag) in env
    # The router starts from exactly this environment (flags from QWENSERVE_* variables).
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = parse_config(["--model", "/models/x"])
    assert config.decode == [env["QWENSERVE_DECODE"]] and config.front.no_auth


ANYONE = "anyone"


def _admitted(policy: dict[str, Any], port: int) -> list[Any]:
    """The peers a NetworkPolicy admits on a TCP port (ANYONE for a rule without `from`)."""
    peers: list[Any] = []
    for rule in policy["spec"]["ingress"]:
        if "ports" not in rule or {"protocol": "TCP", "port": port} in rule["ports"]:
            peers += rule.get("from", [ANYONE])
    return peers


def _pods(*stages: str) -> list[dict[str, Any]]:
    return [{"podSelector": {"matchLabels": {"qwenserve.io/deployment": "demo", "qwenserve.io/stage": stage}}}
            for stage in stages]


@pytest.mark.parametrize("mode", ["network", "shm"])
def test_only_the_router_and_decode_reach_the_workers_grpc_ports_and_the_router_is_public(make_spec, mode) -> None:
    children = _children(make_spec(kvTransfer={"mode": mode}))
    policy = {stage: _by(children, "NetworkPolicy", stage) for stage in STAGES}
    grpc = naming.GRPC_PORTS
    # Besides its own router: another deployment's router that routes to this one (labelled so).
    routed = [{"podSelector": {"matchLabels": {"routes-to.qwenserve.io/demo": "true"}}}]
    assert _admitted(policy["tokenizer"], grpc["tokenizer"]) == _pods("router") + routed
    # KVTransfer (Fetch, Release) shares prefill's port: decode calls it in every mode.
    assert _admitted(policy["prefill"], grpc["prefill"]) == _pods("router", "decode") + routed
    assert _admitted(policy["decode"], grpc["decode"]) == _pods("router") + routed
    assert _admitted(policy["router"], grpc["router"]) == [ANYONE]
    assert _admitted(policy["router"], naming.HTTP_PORT) == [ANYONE]
    for stage in STAGES:
        assert policy[stage]["spec"]["policyTypes"] == ["Ingress"]
        assert _admitted(policy[stage], 12345) == []  # nothing else is open
        pod_labels = _by(children, "Deployment", stage)["spec"]["template"]["metadata"]["labels"]
        selector = policy[stage]["spec"]["podSelector"]["matchLabels"]
        assert selector.items() <= pod_labels.items()
        others = [_by(children, "Deployment", s)["spec"]["template"]["metadata"]["labels"] for s in STAGES if s != stage]
        assert not any(selector.items() <= labels.items() for labels in others)


def test_with_mooncake_decode_reaches_every_prefill_port(make_spec) -> None:
    prefill = manifests.network_policy("demo", "ns1", UID, "prefill", make_spec(kvTransfer={"mode": "mooncake"}))
    assert _admitted(prefill, 12345) == _pods("decode")  # the Transfer Engine picks its ports at start
    kubernetes_validate.validate(prefill, K8S_VERSION, strict=True)


def test_metrics_ports_admit_the_monitoring_namespaces_the_operator_and_the_router(make_spec) -> None:
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": naming.OPERATOR_POD_LABELS}}
    default = _children(make_spec())
    custom = _children(make_spec(**VARIANTS["monitoring"]))
    for stage in STAGES:
        assert _admitted(_by(default, "NetworkPolicy", stage), naming.METRICS_PORT) == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
            operator, *_pods("router")]
        assert _admitted(_by(custom, "NetworkPolicy", stage), naming.METRICS_PORT)[0] == {
            "namespaceSelector": VARIANTS["monitoring"]["telemetry"]["monitoringNamespaceSelector"]}


def test_a_fallback_and_a_canary_become_the_routers_models_file_and_open_their_policies(make_spec) -> None:
    spec = make_spec(fallback="backup", canary={"deployment": "demo-next", "percent": 10})
    children = _children(spec)
    config = next(c for c in children if c["kind"] == "ConfigMap")
    models = yaml.safe_load(config["data"]["models.yaml"])
    own = spec["model"]["name"]
    assert models["default"] == own
    assert [m["name"] for m in models["models"]] == [own, "backup", "demo-next"]
    first = models["models"][0]
    assert first["fallback"] == "backup" and first["canary"] == {"model": "demo-next", "percent": 10}
    assert models["models"][1]["decode"] == [f"{naming.service_host('backup', 'ns1', 'decode')}:50053"]
    assert all(m["model"] == first["model"] for m in models["models"])  # read with this model's vocabulary
    assert config["data"]["QWENSERVE_MODELS_FILE"] == "/etc/qwen-serve/routes/models.yaml"
    router = _by(children, "Deployment", "router")["spec"]["template"]
    assert router["metadata"]["labels"]["routes-to.qwenserve.io/backup"] == "true"
    assert router["metadata"]["labels"]["routes-to.qwenserve.io/demo-next"] == "true"
    mount = next(m for m in router["spec"]["containers"][0]["volumeMounts"] if m["name"] == "routes")
    assert mount["mountPath"] == "/etc/qwen-serve/routes"
    # The backup deployment's own policies admit that router.
    backup = manifests.network_policy("backup", "ns1", UID, "decode", make_spec())
    assert {"podSelector": {"matchLabels": {"routes-to.qwenserve.io/backup": "true"}}} in _admitted(
        backup, naming.GRPC_PORTS["decode"])
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
    # Without them: no models file, as before.
    assert "models.yaml" not in next(c for c in _children(make_spec()) if c["kind"] == "ConfigMap")["data"]


def test_a_stage_that_may_scale_to_zero_makes_the_router_hold_its_requests(make_spec) -> None:
    from qwenserve_operator.router_config import router_environment

    assert "QWENSERVE_COLD_START_WAIT_S" not in router_environment("q", "ns", make_spec())
    spec = make_spec(stages={"decode": {"autoscaling": {"enabled": True, "minReplicas": 0}}},
                     coldStartTimeoutSeconds=90)
    assert router_environment("q", "ns", spec)["QWENSERVE_COLD_START_WAIT_S"] == "90"


def test_every_stage_mounts_the_deployments_stage_secret_and_is_told_the_file(make_spec) -> None:
    secret = manifests.stage_secret("demo", "ns1", UID, "a" * 64)
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert secret["metadata"]["name"] == "demo-stage-secret"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == UID  # goes with its QwenDeployment
    assert base64.b64decode(secret["data"][naming.STAGE_SECRET_KEY]).decode() == "a" * 64
    children = _children(make_spec())
    for stage in STAGES:
        pod = _by(children, "Deployment", stage)["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "stage-secret")
        assert volume["secret"]["secretName"] == "demo-stage-secret"
        assert volume["secret"]["defaultMode"] & 0o007 == 0  # not readable by others
        container = pod["containers"][0]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "stage-secret")
        assert mount["readOnly"] and mount["mountPath"] == "/etc/qwen-serve/stage-secrets/demo"
        args = container["args"]
        assert args[args.index("--stage-secret-file") + 1] == f"/etc/qwen-serve/stage-secrets/demo/{naming.STAGE_SECRET_KEY}"
    assert all(c["kind"] != "Secret" for c in children)  # its value is drawn once by the reconciler


def test_a_router_that_routes_to_other_deployments_holds_their_stage_secrets(make_spec) -> None:
    children = _children(make_spec(fallback="backup"))
    router = _by(children, "Deployment", "router")["spec"]["template"]["spec"]
    secrets = {v["secret"]["secretName"] for v in router["volumes"] if "secret" in v}
    assert {"demo-stage-secret", "backup-stage-secret"} <= secrets
    models = yaml.safe_load(next(c for c in children if c["kind"] == "ConfigMap")["data"]["models.yaml"])
    files = {m["name"]: m["stage_secret_file"] for m in models["models"]}
    assert files["backup"] == naming.stage_secret_file("backup") != files[make_spec()["model"]["name"]]
    parsed = parse_models(models, "models.yaml")  # the router reads each model's secret file
    assert {e.name: e.stage_secret_file for e in parsed.entries} == files
    mounts = {m["mountPath"] for m in router["containers"][0]["volumeMounts"]}
    assert "/etc/qwen-serve/stage-secrets/backup" in mounts
    decode = _by(children, "Deployment", "decode")["spec"]["template"]["spec"]
    assert "backup-stage-secret" not in {v["secret"]["secretName"] for v in decode["volumes"] if "secret" in v}


def test_an_slo_change_does_not_roll_the_router(make_spec) -> None:
    # The SLO is the autoscaler's: the router reads nothing of it, so tightening it must not cut the routers' streams.
    def digest(spec: dict[str, Any]) -> str:
        return _by(_children(spec), "Deployment", "router")["spec"]["template"]["metadata"]["annotations"][
            "qwenserve.io/config-hash"]

    assert digest(make_spec()) == digest(make_spec(slo={"ttftSeconds": 0.01, "interTokenLatencySeconds": 0.005}))


def test_a_decode_stage_with_its_own_checkpoint_loads_it_and_continues_the_prefills_kv(make_spec) -> None:
    # The field report's per-stage precision: a bf16 prefill over the model's checkpoint, a W4A16 decode over its AWQ
    # copy, fetched into the decode pods only; everything is served under the deployment's model name.
    children = _children(make_spec(model={"name": "Qwen/Qwen3-0.6B", "source": "hf", "hf": {"repo": "Qwen/Qwen3-0.6B"}},
                                   **VARIANTS["per-stage-precision"]))

    def pod(stage: str) -> dict[str, Any]:
        return _by(children, "Deployment", stage)["spec"]["template"]["spec"]

    decode, prefill = pod("decode"), pod("prefill")
    args = decode["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/Qwen3-0.6B-AWQ"
    assert args[args.index("--served-model-name") + 1] == "Qwen/Qwen3-0.6B" and "--kv-from-other-weights" in args
    (fetch,) = decode["initContainers"]
    assert "hf://Qwen/Qwen3-0.6B-AWQ" in fetch["args"] and "/models/Qwen3-0.6B-AWQ" in fetch["args"]
    assert {"name": "model", "mountPath": "/models/Qwen3-0.6B-AWQ", "readOnly": True} in \
        decode["containers"][0]["volumeMounts"]
    for stage in ("prefill", "tokenizer", "router"):  # the others load the model's own checkpoint
        container = pod(stage)["containers"][0]
        assert container["args"][container["args"].index("--model") + 1] == "/models/Qwen3-0.6B", stage
        assert "--kv-from-other-weights" not in container["args"]
    assert "hf://Qwen/Qwen3-0.6B" in prefill["initContainers"][0]["args"]


def test_a_stage_model_is_checked_like_spec_model(make_spec) -> None:
    spec = make_spec(stages={"decode": {"model": {"name": "awq", "source": "pvc"}}})
    assert "spec.stages.decode.model.source=pvc needs spec.stages.decode.model.pvc.claimName" in \
        manifests.validate_spec(spec)
