"""Pure functions from a QwenDeployment to the manifests of its children.

Every function takes the QwenDeployment (name, namespace, uid and a spec already passed through
`crd.with_defaults`) and returns plain dicts; nothing here talks to a cluster.

Children of a QwenDeployment `NAME`:
- one Deployment and one Service per stage, both named `NAME-<stage>`;
- a ConfigMap `NAME-config` with the router's generated configuration;
- one NetworkPolicy per stage, also `NAME-<stage>` (see `network_policy`);
- a Secret `NAME-stage-secret` (see `stage_secret`): the stages serve only callers that know it. Its value is
  random, so it is not among `children` (which are reconciled to a fixed desired state): the reconciler creates
  it once and never reads or rewrites it. Deleting it makes a new one; restart the stages then.

Where the parts live: naming.py (names, labels, ports), router_config.py (the ConfigMap), pod_template.py
(a stage's pods); this module makes the objects and lists them (`children`).

The contract with the stages: every argument a container gets is a flag its stage defines, and every
`QWENSERVE_*` variable one its stage reads (a flag's `QWENSERVE_<FLAG>`, or the log format);
tests/operator/test_stage_contract.py parses the rendered manifests with the stages' own strict parsers.
The tokenizer, prefill and decode Services are headless, so their DNS name resolves to the IP of
every ready pod and the router can balance per worker (least load, prefix affinity) instead of
per connection; the operator needs no Endpoints watch and the router no API access.

The model: `image` is a folder in the image (the CPU image bakes the built-in default model); `pvc` and
`hostPath` mount a volume read-only at /models/<name>; `hf` gives every pod that reads the model a `fetch-model`
init container (`qwen-serve model fetch hf://org/name`, token Secret as HF_TOKEN) that fills an emptyDir, mounted
read-only at /models/<name> in the stage.

KV transfer `network` and `mooncake` (Mooncake Transfer Engine) work across nodes: each stage spreads over
nodes, and prefill (and decode's Transfer Engine, with Mooncake) advertises its pod IP, never 0.0.0.0.

KV transfer `shm`: prefill and decode exchange KV blocks through POSIX shared memory, which only
works between pods on one node that see the same /dev/shm. Separate pods cannot share an
emptyDir, and a new hostPath directory would be created root-owned (unwritable for our non-root
user), so both stages mount the node's own /dev/shm (a world-writable tmpfs) and run as the same
UID; segments are created owner-only, so other workloads cannot read them. Decode pods *require*
a prefill pod of the same QwenDeployment on their node (required pod affinity); prefill pods
*prefer* nodes with decode pods (mutual required affinity could never schedule the first pod).
hostPath needs a namespace that admits it (Pod Security "privileged"); `network` mode has no
hostPath and spreads each stage across nodes instead.
"""

from __future__ import annotations

import base64
from typing import Any

from qwenserve_operator.crd import AUTOSCALED_STAGES, STAGES
from qwenserve_operator.naming import (
    GRPC_CALLERS,
    GRPC_PORTS,
    HEADLESS_STAGES,
    HTTP_PORT,
    METRICS_PORT,
    OPERATOR_POD_LABELS,
    ROUTES_TO,
    STAGE_SECRET_KEY,
    STAGES_WITH_MODEL,
    Manifest,
    Spec,
    child_metadata,
    child_name,
    labels,
    routed_to,
    selector_labels,
    stage_secret_name,
    with_stage_model,
)
from qwenserve_operator.pod_template import (
    model_fetch_container,
    pod_security_context,
    spread_constraints,
    stage_affinity,
    stage_container,
    stage_volumes,
)
from qwenserve_operator.router_config import config_hash, config_map


def deployment(name: str, namespace: str, uid: str, stage: str, spec: Spec, replicas: int,
               config_digest: str = "") -> Manifest:
    """The Deployment of one stage with `replicas` pods."""
    stage_spec = spec["stages"][stage]
    volumes, _ = stage_volumes(name, stage, spec)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the stages never call the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": stage_spec["terminationGracePeriodSeconds"],
        "containers": [stage_container(name, namespace, stage, spec)],
        "volumes": volumes,
    }
    fetch = model_fetch_container(with_stage_model(spec, stage))
    if fetch is not None and stage in STAGES_WITH_MODEL:
        pod_spec["initContainers"] = [fetch]
    for key, value in (("nodeSelector", stage_spec.get("nodeSelector")),
                       ("tolerations", stage_spec.get("tolerations")),
                       ("affinity", stage_affinity(name, stage, spec)),
                       ("topologySpreadConstraints", spread_constraints(name, stage, spec)),
                       ("imagePullSecrets", [{"name": s} for s in spec["image"].get("pullSecrets", [])])):
        if value:
            pod_spec[key] = value
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                   "prometheus.io/path": "/metrics"}
    if stage == "router" and config_digest:
        annotations["qwenserve.io/config-hash"] = config_digest
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(name, namespace, uid, child_name(name, stage), stage),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name, stage)},
            # Never drop below the wanted capacity during a rollout: surge first, then drain.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": {**labels(name, stage), **_routes_to(stage, spec)}, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def service(name: str, namespace: str, uid: str, stage: str, spec: Spec) -> Manifest:
    """The Service of one stage: headless for the workers, a normal one for the router."""
    ports = [{"name": "grpc", "port": GRPC_PORTS[stage], "targetPort": "grpc", "protocol": "TCP",
              "appProtocol": "grpc"}]
    if stage == "router":
        ports.append({"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"})
    ports.append({"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"})
    svc_spec: dict[str, Any] = {"selector": selector_labels(name, stage), "ports": ports}
    metadata = child_metadata(name, namespace, uid, child_name(name, stage), stage)
    if stage in HEADLESS_STAGES:
        svc_spec["clusterIP"] = "None"
    else:
        svc_spec["type"] = spec["routerService"]["type"]
        if spec["routerService"].get("annotations"):
            metadata["annotations"] = dict(spec["routerService"]["annotations"])
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": svc_spec}


def _pods_of(name: str, *stages: str) -> list[dict[str, Any]]:
    return [{"podSelector": {"matchLabels": selector_labels(name, stage)}} for stage in stages]


def _routes_to(stage: str, spec: Spec) -> dict[str, str]:
    """The router's labels that let it through the NetworkPolicies of the deployments it routes to."""
    return {ROUTES_TO + other: "true" for other in routed_to(spec)} if stage == "router" else {}


def network_policy(name: str, namespace: str, uid: str, stage: str, spec: Spec) -> Manifest:
    """Who may reach one stage's pods; everything else is refused once a policy selects them.

    The router's gRPC and HTTP ports are public. A worker's gRPC port admits only its callers of this
    QwenDeployment (GRPC_CALLERS), so no other pod can call Prefill, Decode or KVTransfer.Fetch past the
    router's keys and limits. Mooncake's Transfer Engine listens on ports it picks at start, so with it
    decode may reach any prefill port. Metrics ports admit the monitoring namespaces
    (spec.telemetry.monitoringNamespaceSelector), the operator's pods (autoscaling) and the router
    (`qwen-serve status`). Kubelet probes come from the node, which NetworkPolicy implementations admit.
    """
    def tcp(*ports: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": port} for port in ports]

    if stage == "router":
        rules: list[dict[str, Any]] = [{"ports": tcp(GRPC_PORTS[stage], HTTP_PORT)}]  # no `from`: anyone
    else:
        # Another deployment's router that names this one its fallback or canary (labelled so) may call it too.
        callers = [*_pods_of(name, *GRPC_CALLERS[stage]), {"podSelector": {"matchLabels": {ROUTES_TO + name: "true"}}}]
        rules = [{"from": callers, "ports": tcp(GRPC_PORTS[stage])}]
    if stage == "prefill" and spec["kvTransfer"]["mode"] == "mooncake":
        rules.append({"from": _pods_of(name, "decode")})
    scrapers = [{"namespaceSelector": spec["telemetry"]["monitoringNamespaceSelector"]},
                {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_POD_LABELS}},
                *_pods_of(name, "router")]
    rules.append({"from": scrapers, "ports": tcp(METRICS_PORT)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(name, namespace, uid, child_name(name, stage), stage),
        "spec": {"podSelector": {"matchLabels": selector_labels(name, stage)}, "policyTypes": ["Ingress"],
                 "ingress": rules},
    }


def stage_secret(name: str, namespace: str, uid: str, value: str) -> Manifest:
    """The Secret with the deployment's stage secret `value` (the reconciler draws it at random, once), mounted
    by every stage as its --stage-secret-file."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": child_metadata(name, namespace, uid, stage_secret_name(name), None),
        "data": {STAGE_SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }


def spec_replicas(spec: Spec, stage: str, autoscaled: dict[str, int] | None = None) -> int:
    """Replicas a stage should run: the autoscaler's value (within bounds) or `replicas` from the spec."""
    stage_spec = spec["stages"][stage]
    scaling = stage_spec.get("autoscaling", {})
    if stage not in AUTOSCALED_STAGES or not scaling.get("enabled"):
        return int(stage_spec["replicas"])
    current = (autoscaled or {}).get(stage, stage_spec["replicas"])
    return max(scaling["minReplicas"], min(scaling["maxReplicas"], int(current)))


def children(name: str, namespace: str, uid: str, spec: Spec, replicas: dict[str, int]) -> list[Manifest]:
    """Every child of the QwenDeployment: the ConfigMap first (the router Deployment refers to it), then
    the NetworkPolicies (so no pod runs unprotected), then each stage's Service and Deployment."""
    config = config_map(name, namespace, uid, spec)
    digest = config_hash(config)
    out = [config, *(network_policy(name, namespace, uid, stage, spec) for stage in STAGES)]
    for stage in STAGES:
        out.append(service(name, namespace, uid, stage, spec))
        out.append(deployment(name, namespace, uid, stage, spec, replicas[stage], digest))
    return out


def validate_spec(spec: Spec) -> list[str]:
    """Problems the API server's CEL rules would reject, checked again for objects stored without them."""
    problems = []
    models = {"spec.model": spec.get("model") or {}}
    for stage in AUTOSCALED_STAGES:  # prefill and decode may load the model in a precision of their own
        if (own := (spec.get("stages", {}).get(stage) or {}).get("model")) is not None:
            models[f"spec.stages.{stage}.model"] = own
    for where, model in models.items():
        if not model.get("name"):
            problems.append(f"{where}.name is required")
        if model.get("source") == "pvc" and not (model.get("pvc") or {}).get("claimName"):
            problems.append(f"{where}.source=pvc needs {where}.pvc.claimName")
        if model.get("source") == "hostPath" and not model.get("hostPath"):
            problems.append(f"{where}.source=hostPath needs {where}.hostPath")
        if model.get("source") == "hf" and not (model.get("hf") or {}).get("repo"):
            problems.append(f"{where}.source=hf needs {where}.hf.repo")
    for stage in AUTOSCALED_STAGES:
        scaling = spec.get("stages", {}).get(stage, {}).get("autoscaling", {})
        if scaling.get("minReplicas", 1) > scaling.get("maxReplicas", 1):
            problems.append(f"spec.stages.{stage}.autoscaling: minReplicas exceeds maxReplicas")
    ratio = spec.get("prefillDecodeRatio", {})
    if ratio.get("min", 0) > ratio.get("max", 1):
        problems.append("spec.prefillDecodeRatio: min exceeds max")
    problems += _stage_arg_problems(spec)
    return problems


def _stage_arg_problems(spec: Spec) -> list[str]:
    """Extra stage arguments that the stage would refuse (it starts only with flags it defines), or that would
    override what the operator sets (the ports its Services and probes point at, the model it mounts)."""
    from qwenserve.stages.common import undefined_flags

    problems = []
    for stage in STAGES:
        args = (spec.get("stages", {}).get(stage) or {}).get("args") or []
        taken = ["--host", "--port", "--metrics-port", "--model", *(["--http-port"] if stage == "router" else [])]
        for flag in dict.fromkeys(undefined_flags(stage, args, taken)):
            why = "is set by the operator" if flag in taken else f"is not a flag of `qwen-serve serve {stage}`"
            problems.append(f"spec.stages.{stage}.args: {flag} {why}")
    return problems
