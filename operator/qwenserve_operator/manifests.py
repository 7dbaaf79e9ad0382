"""Pure functions from a QwenDeployment to the manifests of its children.

Every function takes the QwenDeployment (name, namespace, uid and a spec already passed through
`crd.with_defaults`) and returns plain dicts; nothing here talks to a cluster.

Children of a QwenDeployment `NAME`:
- one Deployment and one Service per stage, both named `NAME-<stage>`;
- a ConfigMap `NAME-config` with the router's generated configuration;
- one NetworkPolicy per stage, also `NAME-<stage>` (see `network_policy`).

How the router finds the workers: through the Services' DNS names, written into the ConfigMap
(`QWENSERVE_TOKENIZER`, `QWENSERVE_PREFILL`, `QWENSERVE_DECODE`, read by the router as flags).

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

import hashlib
import json
from typing import Any

import yaml

from qwenserve_operator.crd import AUTOSCALED_STAGES, GROUP, KIND, STAGES, VERSION

Manifest = dict[str, Any]
Spec = dict[str, Any]

GRPC_PORTS = {"tokenizer": 50051, "prefill": 50052, "decode": 50053, "router": 50050}
HTTP_PORT = 8000
METRICS_PORT = 9090
# The preStop pause that lets Service DNS drop a pod before SIGTERM, and the time kept back from the
# grace period for the process to exit after its drain.
PRE_STOP_S = 5
DRAIN_MARGIN_S = 2
RUN_AS = 10001  # the image's non-root user (Dockerfile)
SHM_DIR = "/dev/shm"
MODELS_DIR = "/models"
API_KEYS_DIR = "/etc/qwen-serve/api-keys"
ROUTES_DIR = "/etc/qwen-serve/routes"  # the router's models file, when it also routes to other deployments
# A router pod that may call another QwenDeployment's stages (its fallback, its canary) carries this label
# with the other's name; that deployment's NetworkPolicies admit it.
ROUTES_TO = "routes-to.qwenserve.io/"
MANAGER = "qwen-serve-operator"
STAGES_WITH_MODEL = ("tokenizer", "prefill", "decode", "router")  # the router detokenizes locally
# The headless stages: the router resolves every pod behind them through DNS.
HEADLESS_STAGES = ("tokenizer", "prefill", "decode")
# Who calls each worker's gRPC port: the router calls all three; decode calls prefill's KVTransfer
# (Fetch in network mode, Release in every mode), which prefill serves on its own gRPC port.
GRPC_CALLERS = {"tokenizer": ("router",), "prefill": ("router", "decode"), "decode": ("router",)}
# The chart's operator pods, which scrape every stage's metrics for the autoscaler.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "qwen-serve", "app.kubernetes.io/component": "operator"}


def child_name(name: str, stage: str) -> str:
    """The Deployment and Service name of one stage."""
    return f"{name}-{stage}"


def config_map_name(name: str) -> str:
    """The name of the generated ConfigMap."""
    return f"{name}-config"


def selector_labels(name: str, stage: str) -> dict[str, str]:
    """Labels that select one stage's pods; never change them (Deployment selectors are immutable)."""
    return {"qwenserve.io/deployment": name, "qwenserve.io/stage": stage}


def labels(name: str, stage: str | None = None) -> dict[str, str]:
    """Labels on every child; `stage` is None for objects shared by all stages."""
    out = {
        "app.kubernetes.io/name": "qwen-serve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/part-of": "qwen-serve",
        "app.kubernetes.io/managed-by": MANAGER,
        "qwenserve.io/deployment": name,
    }
    if stage is not None:
        out["app.kubernetes.io/component"] = stage
        out["qwenserve.io/stage"] = stage
    return out


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """The controller reference that makes deleting the QwenDeployment delete its children."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(name: str, namespace: str, uid: str, child: str, stage: str | None) -> dict[str, Any]:
    return {
        "name": child,
        "namespace": namespace,
        "labels": labels(name, stage),
        "ownerReferences": [owner_reference(name, uid)],
    }


def service_host(name: str, namespace: str, stage: str) -> str:
    """The in-cluster DNS name of a stage's Service."""
    return f"{child_name(name, stage)}.{namespace}.svc.cluster.local"


def router_endpoint(name: str, namespace: str) -> str:
    """The router's in-cluster OpenAI-compatible HTTP endpoint."""
    return f"http://{service_host(name, namespace, 'router')}:{HTTP_PORT}"


def model_dir(spec: Spec) -> str:
    """Where the checkpoint is inside the containers (`--model`)."""
    model = spec["model"]
    if model["source"] == "image":
        return model["path"]
    # A mounted checkpoint sits at /models/<last part of the model name>, e.g. /models/Qwen3-0.6B.
    folder = model["name"].rstrip("/").split("/")[-1] or "model"
    return f"{MODELS_DIR}/{folder}"


def _model_volume(spec: Spec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    model = spec["model"]
    mount: dict[str, Any] = {"name": "model", "mountPath": model_dir(spec), "readOnly": True}
    if model["source"] == "pvc":
        pvc = model["pvc"]
        if pvc.get("subPath"):
            mount["subPath"] = pvc["subPath"]
        return {"name": "model", "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}}, mount
    if model["source"] == "hostPath":
        return {"name": "model", "hostPath": {"path": model["hostPath"], "type": "Directory"}}, mount
    if model["source"] == "hf":  # filled by the fetch-model init container
        size = model["hf"].get("sizeLimit")
        return {"name": "model", "emptyDir": {"sizeLimit": size} if size else {}}, mount
    return None


def model_fetch_container(spec: Spec) -> dict[str, Any] | None:
    """source=hf: the init container that downloads the checkpoint into the pod's model volume before the stage
    starts (`qwen-serve model fetch`, huggingface_hub's snapshot_download; the token Secret as HF_TOKEN)."""
    model = spec["model"]
    if model["source"] != "hf":
        return None
    hf = model["hf"]
    args = ["model", "fetch", f"hf://{hf['repo'].removeprefix('hf://')}", "--dir", model_dir(spec)]
    if hf.get("revision"):
        args += ["--revision", hf["revision"]]
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if hf.get("tokenSecretRef"):
        ref = hf["tokenSecretRef"]
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}})
    return {
        "name": "fetch-model",
        "image": _image(spec),
        "imagePullPolicy": spec["image"]["pullPolicy"],
        "args": args,
        "env": env,
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "model", "mountPath": model_dir(spec)}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def _image(spec: Spec) -> str:
    return f"{spec['image']['repository']}:{spec['image']['tag']}"


def drain_seconds(stage_spec: dict[str, Any]) -> int:
    """How long a stage drains on SIGTERM: the pod's grace period less the preStop pause and a margin, so
    streams finish where they run instead of being cut off by SIGKILL (a stage's own default is 10 s)."""
    return max(1, int(stage_spec["terminationGracePeriodSeconds"]) - PRE_STOP_S - DRAIN_MARGIN_S)


def stage_args(name: str, namespace: str, stage: str, spec: Spec) -> list[str]:
    """The container arguments after the `qwen-serve` entrypoint (flags of `qwen-serve serve STAGE`)."""
    args = ["serve", stage, "--host", "0.0.0.0", "--port", str(GRPC_PORTS[stage]),
            "--metrics-port", str(METRICS_PORT), "--grace-s", str(drain_seconds(spec["stages"][stage]))]
    mode = spec["kvTransfer"]["mode"]
    if stage == "tokenizer":
        args += ["--model", model_dir(spec)]
    elif stage == "prefill":
        # Shared-memory segments live in /dev/shm (the node's, mounted below), where POSIX shm puts them.
        # Handoffs name the pod's own IP (the downward API's POD_IP, expanded by the kubelet), never 0.0.0.0.
        args += ["--model", model_dir(spec), "--kv-transfer", mode, "--served-model-name", spec["model"]["name"],
                 "--advertise-host", "$(POD_IP)"]
    elif stage == "decode":  # decode fetches over the deployment's transport alone
        args += ["--model", model_dir(spec), "--kv-transfer", mode, "--served-model-name", spec["model"]["name"]]
        if mode == "mooncake":  # its Transfer Engine, too, announces the pod's own address
            args += ["--advertise-host", "$(POD_IP)"]
    else:  # the router takes its worker addresses from the ConfigMap's environment
        args += ["--model", model_dir(spec), "--http-port", str(HTTP_PORT)]
        if spec.get("apiKeysSecret"):
            args += ["--api-keys-file", f"{API_KEYS_DIR}/{spec['apiKeysSecret']['key']}"]
    if stage in ("prefill", "decode") and spec.get("preset", "none") != "none":
        args += ["--preset", spec["preset"]]
    return args + list(spec["stages"][stage].get("args", []))


def router_environment(name: str, namespace: str, spec: Spec) -> dict[str, str]:
    """The router's generated configuration (flags as QWENSERVE_* variables)."""
    def address(stage: str) -> str:
        return f"{service_host(name, namespace, stage)}:{GRPC_PORTS[stage]}"

    def metrics(stage: str) -> str:
        return f"{service_host(name, namespace, stage)}:{METRICS_PORT}"

    limits = spec["rateLimits"]
    env = {
        "QWENSERVE_TOKENIZER": address("tokenizer"),
        "QWENSERVE_PREFILL": address("prefill"),
        "QWENSERVE_DECODE": address("decode"),
        # For `qwen-serve status`: where the stages' load can be read.
        "QWENSERVE_TOKENIZER_METRICS": metrics("tokenizer"),
        "QWENSERVE_PREFILL_METRICS": metrics("prefill"),
        "QWENSERVE_DECODE_METRICS": metrics("decode"),
        "QWENSERVE_SERVED_MODEL_NAME": spec["model"]["name"],
        "QWENSERVE_RATELIMIT_FAILURE_MODE": "open" if limits["failOpen"] else "closed",
    }
    # Limits of tenants the API key Secret does not set itself (and of everyone without keys); 0: none.
    if limits["requestsPerMinute"]:
        env["QWENSERVE_DEFAULT_REQUESTS_PER_MINUTE"] = str(limits["requestsPerMinute"])
    if limits["tokensPerMinute"]:
        env["QWENSERVE_DEFAULT_TOKENS_PER_MINUTE"] = str(limits["tokensPerMinute"])
    if routed_to(spec):
        env["QWENSERVE_MODELS_FILE"] = f"{ROUTES_DIR}/models.yaml"
    if any((scaling := spec["stages"][s].get("autoscaling", {})).get("enabled") and scaling.get("minReplicas") == 0
           for s in AUTOSCALED_STAGES):
        # A stage may have no pod: hold its requests while the operator starts one (it reads the held count).
        env["QWENSERVE_COLD_START_WAIT_S"] = str(spec["coldStartTimeoutSeconds"])
    if not spec.get("apiKeysSecret"):
        # Without a key Secret the router serves everyone as one tenant (still rate-limited).
        env["QWENSERVE_NO_AUTH"] = "true"
    redis = spec.get("redis", {})
    if redis.get("url") and not redis.get("urlSecretRef"):
        env["QWENSERVE_REDIS_URL"] = redis["url"]
    return env


def routed_to(spec: Spec) -> list[str]:
    """The other QwenDeployments this one's router sends requests to (fallback, canary)."""
    others = [spec.get("fallback"), (spec.get("canary") or {}).get("deployment")]
    return sorted({o for o in others if o})


def models_file(name: str, namespace: str, spec: Spec) -> dict[str, Any] | None:
    """The router's --models-file when it routes to other deployments: this model, then each other one by its
    QwenDeployment's name, at its Services, read with this model's vocabulary."""
    if not routed_to(spec):
        return None

    def entry(deployment: str, served: str, **more: Any) -> dict[str, Any]:
        def address(stage: str) -> str:
            return f"{service_host(deployment, namespace, stage)}:{GRPC_PORTS[stage]}"

        return {"name": served, "model": model_dir(spec), "tokenizer": address("tokenizer"),
                "prefill": [address("prefill")], "decode": [address("decode")], **more}

    more: dict[str, Any] = {}
    if spec.get("fallback"):
        more["fallback"] = spec["fallback"]
    if spec.get("canary"):
        more["canary"] = {"model": spec["canary"]["deployment"], "percent": spec["canary"]["percent"]}
    own = spec["model"]["name"]
    return {"default": own,
            "models": [entry(name, own, **more), *(entry(other, other) for other in routed_to(spec) if other != own)]}


def config_map(name: str, namespace: str, uid: str, spec: Spec) -> Manifest:
    """The ConfigMap with the router's environment and the resolved deployment, for humans."""
    resolved = {
        "model": spec["model"],
        "kvTransfer": spec["kvTransfer"],
        "slo": spec["slo"],
        "endpoints": {stage: f"{service_host(name, namespace, stage)}:{GRPC_PORTS[stage]}" for stage in STAGES},
    }
    data = {**router_environment(name, namespace, spec), "qwenserve.json": json.dumps(resolved, indent=2, sort_keys=True)}
    models = models_file(name, namespace, spec)
    if models is not None:  # not a variable name: envFrom skips it; the router mounts it as a file
        data["models.yaml"] = yaml.safe_dump(models, sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(name, namespace, uid, config_map_name(name), None),
        "data": data,
    }


def config_hash(config: Manifest) -> str:
    """A short digest of a ConfigMap's data; a new value rolls the router."""
    return hashlib.sha256(json.dumps(config["data"], sort_keys=True).encode()).hexdigest()[:16]


def _common_env(name: str, namespace: str, stage: str, spec: Spec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
        {"name": "QWENSERVE_LOG_FORMAT", "value": spec["telemetry"]["logFormat"]},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "OTEL_SERVICE_NAME", "value": f"qwen-serve-{stage}"},
        {"name": "OTEL_RESOURCE_ATTRIBUTES",
         "value": f"k8s.namespace.name={namespace},qwenserve.deployment={name}"},
    ]
    endpoint = spec["telemetry"].get("otlpEndpoint")
    if endpoint:
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": endpoint})
    else:
        env.append({"name": "OTEL_TRACES_EXPORTER", "value": "none"})
    secret = spec.get("redis", {}).get("urlSecretRef")
    if stage == "router" and secret:
        env.append({"name": "QWENSERVE_REDIS_URL",
                    "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}}})
    return env + list(spec["stages"][stage].get("env", []))


def _ports(stage: str) -> list[dict[str, Any]]:
    ports = [{"name": "grpc", "containerPort": GRPC_PORTS[stage], "protocol": "TCP"}]
    if stage == "router":
        ports.append({"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"})
    ports.append({"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"})
    return ports


def _probes(stage: str) -> dict[str, Any]:
    grpc = {"port": GRPC_PORTS[stage]}
    return {
        # The services report SERVING only after loading the model and a warm-up pass: allow 20 min.
        "startupProbe": {"grpc": grpc, "periodSeconds": 10, "failureThreshold": 120},
        "readinessProbe": {"grpc": grpc, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"grpc": grpc, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _affinity(name: str, stage: str, spec: Spec) -> dict[str, Any] | None:
    user = json.loads(json.dumps(spec["stages"][stage].get("affinity") or {}))
    if spec["kvTransfer"]["mode"] != "shm" or stage not in ("prefill", "decode"):
        return user or None
    host = "kubernetes.io/hostname"
    pod_affinity = user.setdefault("podAffinity", {})
    if stage == "decode":
        term = {"labelSelector": {"matchLabels": selector_labels(name, "prefill")}, "topologyKey": host}
        pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    else:
        term = {"weight": 100, "podAffinityTerm": {
            "labelSelector": {"matchLabels": selector_labels(name, "decode")}, "topologyKey": host}}
        pod_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(term)
    return user


def _spread(name: str, stage: str, spec: Spec) -> list[dict[str, Any]]:
    # In shm mode the affinity decides placement; spreading there would fight it.
    if spec["kvTransfer"]["mode"] == "shm" and stage in ("prefill", "decode"):
        return []
    return [{
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": selector_labels(name, stage)},
    }]


def _volumes(name: str, stage: str, spec: Spec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    model = _model_volume(spec)
    if model is not None and stage in STAGES_WITH_MODEL:
        volumes.append(model[0])
        mounts.append(model[1])
    if stage in ("prefill", "decode"):
        if spec["kvTransfer"]["mode"] == "shm":
            volumes.append({"name": "shm", "hostPath": {"path": SHM_DIR, "type": "Directory"}})
        else:
            # A private tmpfs: the default 64 MiB /dev/shm is too small for torch's workers.
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "shm", "mountPath": SHM_DIR})
    if stage == "router" and spec.get("apiKeysSecret"):
        volumes.append({"name": "api-keys", "secret": {"secretName": spec["apiKeysSecret"]["name"]}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    if stage == "router" and routed_to(spec):
        volumes.append({"name": "routes", "configMap": {"name": config_map_name(name),
                                                        "items": [{"key": "models.yaml", "path": "models.yaml"}]}})
        mounts.append({"name": "routes", "mountPath": ROUTES_DIR, "readOnly": True})
    return volumes, mounts


def _container(name: str, namespace: str, stage: str, spec: Spec) -> dict[str, Any]:
    stage_spec = spec["stages"][stage]
    _, mounts = _volumes(name, stage, spec)
    container: dict[str, Any] = {
        "name": stage,
        "image": _image(spec),
        "imagePullPolicy": spec["image"]["pullPolicy"],
        "args": stage_args(name, namespace, stage, spec),
        "env": _common_env(name, namespace, stage, spec),
        "ports": _ports(stage),
        "resources": stage_spec.get("resources", {}),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
        # Let the Service's DNS drop the pod before SIGTERM starts the service's own drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_S}}},
        **_probes(stage),
    }
    if stage == "router":
        container["envFrom"] = [{"configMapRef": {"name": config_map_name(name)}}]
    return container


def deployment(name: str, namespace: str, uid: str, stage: str, spec: Spec, replicas: int,
               config_digest: str = "") -> Manifest:
    """The Deployment of one stage with `replicas` pods."""
    stage_spec = spec["stages"][stage]
    volumes, _ = _volumes(name, stage, spec)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the stages never call the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": _pod_security_context(),
        "terminationGracePeriodSeconds": stage_spec["terminationGracePeriodSeconds"],
        "containers": [_container(name, namespace, stage, spec)],
        "volumes": volumes,
    }
    fetch = model_fetch_container(spec)
    if fetch is not None and stage in STAGES_WITH_MODEL:
        pod_spec["initContainers"] = [fetch]
    for key, value in (("nodeSelector", stage_spec.get("nodeSelector")),
                       ("tolerations", stage_spec.get("tolerations")),
                       ("affinity", _affinity(name, stage, spec)),
                       ("topologySpreadConstraints", _spread(name, stage, spec)),
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
        "metadata": _metadata(name, namespace, uid, child_name(name, stage), stage),
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
    metadata = _metadata(name, namespace, uid, child_name(name, stage), stage)
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
        "metadata": _metadata(name, namespace, uid, child_name(name, stage), stage),
        "spec": {"podSelector": {"matchLabels": selector_labels(name, stage)}, "policyTypes": ["Ingress"],
                 "ingress": rules},
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
    model = spec.get("model") or {}
    if not model.get("name"):
        problems.append("spec.model.name is required")
    if model.get("source") == "pvc" and not (model.get("pvc") or {}).get("claimName"):
        problems.append("spec.model.source=pvc needs spec.model.pvc.claimName")
    if model.get("source") == "hostPath" and not model.get("hostPath"):
        problems.append("spec.model.source=hostPath needs spec.model.hostPath")
    if model.get("source") == "hf" and not (model.get("hf") or {}).get("repo"):
        problems.append("spec.model.source=hf needs spec.model.hf.repo")
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
    from qwenserve_services.stage_config import undefined_flags

    problems = []
    for stage in STAGES:
        args = (spec.get("stages", {}).get(stage) or {}).get("args") or []
        taken = ["--host", "--port", "--metrics-port", "--model", *(["--http-port"] if stage == "router" else [])]
        for flag in dict.fromkeys(undefined_flags(stage, args, taken)):
            why = "is set by the operator" if flag in taken else f"is not a flag of `qwen-serve serve {stage}`"
            problems.append(f"spec.stages.{stage}.args: {flag} {why}")
    return problems
