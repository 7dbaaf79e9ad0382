"""The router's generated configuration: the ConfigMap `NAME-config` its pods read their environment from.

How the router finds the workers: through the Services' DNS names, written here as flags' QWENSERVE_*
variables (`QWENSERVE_TOKENIZER`, `QWENSERVE_PREFILL`, `QWENSERVE_DECODE`); when it also routes to other
QwenDeployments (fallback, canary), a models file beside them, mounted into the router.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from qwenserve_operator.crd import AUTOSCALED_STAGES, STAGES
from qwenserve_operator.naming import (
    GRPC_PORTS,
    METRICS_PORT,
    ROUTES_DIR,
    Manifest,
    Spec,
    child_metadata,
    config_map_name,
    model_dir,
    routed_to,
    service_host,
    stage_secret_file,
)

# The ConfigMap key with the resolved deployment for humans; the router never reads it.
HUMAN_VIEW = "qwenserve.json"


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


def models_file(name: str, namespace: str, spec: Spec) -> dict[str, Any] | None:
    """The router's --models-file when it routes to other deployments: this model, then each other one by its
    QwenDeployment's name, at its Services, read with this model's vocabulary."""
    if not routed_to(spec):
        return None

    def entry(deployment: str, served: str, **more: Any) -> dict[str, Any]:
        def address(stage: str) -> str:
            return f"{service_host(deployment, namespace, stage)}:{GRPC_PORTS[stage]}"

        return {"name": served, "model": model_dir(spec), "tokenizer": address("tokenizer"),
                "prefill": [address("prefill")], "decode": [address("decode")],
                "stage_secret_file": stage_secret_file(deployment), **more}

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
    data = {**router_environment(name, namespace, spec), HUMAN_VIEW: json.dumps(resolved, indent=2, sort_keys=True)}
    models = models_file(name, namespace, spec)
    if models is not None:  # not a variable name: envFrom skips it; the router mounts it as a file
        data["models.yaml"] = yaml.safe_dump(models, sort_keys=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(name, namespace, uid, config_map_name(name), None),
        "data": data,
    }


def config_hash(config: Manifest) -> str:
    """A short digest of what the router reads from its ConfigMap; a new value rolls the router.

    The resolved deployment (qwenserve.json) is for humans: an SLO target changed for the autoscaler must not
    restart the routers and cut their streams."""
    read = {key: value for key, value in config["data"].items() if key != HUMAN_VIEW}
    return hashlib.sha256(json.dumps(read, sort_keys=True).encode()).hexdigest()[:16]
