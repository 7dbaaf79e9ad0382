"""What runs in one stage's pods: the container (arguments, environment, ports, probes), its volumes, the
model's init container, security contexts and placement. manifests.deployment wraps it in a Deployment.
"""

from __future__ import annotations

import json
from typing import Any

from qwenserve_operator.naming import (
    API_KEYS_DIR,
    DRAIN_MARGIN_S,
    GRPC_PORTS,
    HTTP_PORT,
    METRICS_PORT,
    PRE_STOP_S,
    ROUTES_DIR,
    RUN_AS,
    SHM_DIR,
    STAGE_SECRETS_DIR,
    STAGES_WITH_MODEL,
    Spec,
    config_map_name,
    has_stage_models,
    model_dir,
    routed_to,
    selector_labels,
    stage_secret_file,
    stage_secret_name,
    with_stage_model,
)


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
            "--metrics-port", str(METRICS_PORT), "--grace-s", str(drain_seconds(spec["stages"][stage])),
            "--stage-secret-file", stage_secret_file(name)]
    mode = spec["kvTransfer"]["mode"]
    own = with_stage_model(spec, stage)  # prefill and decode may load the model in a precision of their own
    if stage == "tokenizer":
        args += ["--model", model_dir(spec)]
    elif stage == "prefill":
        # Shared-memory segments live in /dev/shm (the node's, mounted below), where POSIX shm puts them.
        # Handoffs name the pod's own IP (the downward API's POD_IP, expanded by the kubelet), never 0.0.0.0.
        args += ["--model", model_dir(own), "--kv-transfer", mode, "--served-model-name", spec["model"]["name"],
                 "--advertise-host", "$(POD_IP)"]
    elif stage == "decode":  # decode fetches over the deployment's transport alone
        args += ["--model", model_dir(own), "--kv-transfer", mode, "--served-model-name", spec["model"]["name"]]
        if has_stage_models(spec):  # the prompt's KV was computed by the other stage's weights of this architecture
            args += ["--kv-from-other-weights"]
        if mode == "mooncake":  # its Transfer Engine, too, announces the pod's own address
            args += ["--advertise-host", "$(POD_IP)"]
    else:  # the router takes its worker addresses from the ConfigMap's environment
        args += ["--model", model_dir(spec), "--http-port", str(HTTP_PORT)]
        if spec.get("apiKeysSecret"):
            args += ["--api-keys-file", f"{API_KEYS_DIR}/{spec['apiKeysSecret']['key']}"]
    if stage in ("prefill", "decode", "router") and spec.get("preset", "none") != "none":
        args += ["--preset", spec["preset"]]
    return args + list(spec["stages"][stage].get("args", []))


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


def pod_security_context() -> dict[str, Any]:
    """The pod-level security context: the image's non-root user and group, the runtime's seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def stage_affinity(name: str, stage: str, spec: Spec) -> dict[str, Any] | None:
    """The user's affinity, plus (shm mode) decode's required and prefill's preferred co-location."""
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


def spread_constraints(name: str, stage: str, spec: Spec) -> list[dict[str, Any]]:
    """Spread a stage's pods over nodes, except where shm mode's affinity decides placement."""
    # In shm mode the affinity decides placement; spreading there would fight it.
    if spec["kvTransfer"]["mode"] == "shm" and stage in ("prefill", "decode"):
        return []
    return [{
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": selector_labels(name, stage)},
    }]


def stage_volumes(name: str, stage: str, spec: Spec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A stage's pod volumes and its container's mounts of them."""
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    model = _model_volume(with_stage_model(spec, stage))
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
    # The deployment's stage secret; a router also gets the secrets of the deployments it routes to (its models
    # file names each). Readable by the pods' group (fsGroup), never by others.
    secrets = [name, *(other for other in routed_to(spec) if other != name)] if stage == "router" else [name]
    for i, deployment in enumerate(secrets):
        volume = "stage-secret" if i == 0 else f"stage-secret-{i}"
        volumes.append({"name": volume, "secret": {"secretName": stage_secret_name(deployment), "defaultMode": 0o440}})
        mounts.append({"name": volume, "mountPath": f"{STAGE_SECRETS_DIR}/{deployment}", "readOnly": True})
    if stage == "router" and spec.get("apiKeysSecret"):
        volumes.append({"name": "api-keys", "secret": {"secretName": spec["apiKeysSecret"]["name"]}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    if stage == "router" and routed_to(spec):
        volumes.append({"name": "routes", "configMap": {"name": config_map_name(name),
                                                        "items": [{"key": "models.yaml", "path": "models.yaml"}]}})
        mounts.append({"name": "routes", "mountPath": ROUTES_DIR, "readOnly": True})
    return volumes, mounts


def stage_container(name: str, namespace: str, stage: str, spec: Spec) -> dict[str, Any]:
    """The stage's one container."""
    stage_spec = spec["stages"][stage]
    _, mounts = stage_volumes(name, stage, spec)
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
