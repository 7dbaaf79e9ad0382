"""What every child manifest of a QwenDeployment shares: names, labels, ports and paths.

Pure functions of the QwenDeployment's name, namespace and spec (see manifests.py for the children).
"""

from __future__ import annotations

from typing import Any

from qwenserve_operator.crd import GROUP, KIND, VERSION

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
# Each deployment's stage secret (the key STAGE_SECRET_KEY of its Secret), in a folder named after the deployment:
# every stage mounts its own, a router that routes to other deployments theirs too.
STAGE_SECRETS_DIR = "/etc/qwen-serve/stage-secrets"
STAGE_SECRET_KEY = "secret"
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


def stage_secret_name(name: str) -> str:
    """The Secret holding a deployment's stage secret (the operator makes it once; its stages only serve callers
    that know it)."""
    return f"{name}-stage-secret"


def stage_secret_file(name: str) -> str:
    """Where a pod finds deployment `name`'s stage secret (its `--stage-secret-file`)."""
    return f"{STAGE_SECRETS_DIR}/{name}/{STAGE_SECRET_KEY}"


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


def child_metadata(name: str, namespace: str, uid: str, child: str, stage: str | None) -> dict[str, Any]:
    """The metadata of one child: its name, namespace, labels and owner."""
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


def with_stage_model(spec: Spec, stage: str) -> Spec:
    """`spec` as `stage` sees it: its own `stages.<stage>.model` (the same model in another precision) in place of
    spec.model where it has one."""
    own = (spec.get("stages", {}).get(stage) or {}).get("model")
    return {**spec, "model": own} if own else spec


def has_stage_models(spec: Spec) -> bool:
    """Whether prefill or decode loads a checkpoint of its own (their KV then comes from other weights)."""
    return any((spec.get("stages", {}).get(stage) or {}).get("model") for stage in ("prefill", "decode"))


def routed_to(spec: Spec) -> list[str]:
    """The other QwenDeployments this one's router sends requests to (fallback, canary)."""
    others = [spec.get("fallback"), (spec.get("canary") or {}).get("deployment")]
    return sorted({o for o in others if o})
