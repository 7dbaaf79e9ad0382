"""The QwenDeployment CustomResourceDefinition, built here and nowhere else.

The chart ships the rendered YAML in `charts/qwen-serve/crds/`; a test proves that file equals
`render_yaml()`. Regenerate it with `python -m qwenserve_operator.crd > <that file>`.

The operator also reads the schema at run time: `with_defaults()` applies the schema's defaults to
a spec, so the operator sees the same values the API server would have stored (and old objects,
created before a default was added, behave like new ones).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

GROUP = "qwenserve.io"
VERSION = "v1alpha1"
KIND = "QwenDeployment"
PLURAL = "qwendeployments"
SINGULAR = "qwendeployment"
SHORT_NAMES = ["qwd", "qwendep"]

STAGES: tuple[str, ...] = ("tokenizer", "prefill", "decode", "router")
# The stages' --kv-transfer choices (qwenserve.stages.common.KV_TRANSFER_MODES; a test keeps them equal).
KV_TRANSFER_MODES: tuple[str, ...] = ("shm", "network", "mooncake")
# The engine stages' --preset choices (qwenserve.presets.PRESET_NAMES; a test keeps them equal).
PRESET_NAMES: tuple[str, ...] = ("none", "latency", "throughput")
# Only the engine stages carry an autoscaler: tokenizer and router are cheap and stateless.
AUTOSCALED_STAGES: tuple[str, ...] = ("prefill", "decode")

# Per-stage defaults that differ: decode holds long streams, so it gets the longest drain.
_GRACE_SECONDS = {"tokenizer": 30, "prefill": 60, "decode": 180, "router": 60}

Schema = dict[str, Any]


def _str(description: str, **extra: Any) -> Schema:
    return {"type": "string", "description": description, **extra}


def _int(description: str, **extra: Any) -> Schema:
    return {"type": "integer", "format": "int32", "description": description, **extra}


def _num(description: str, **extra: Any) -> Schema:
    return {"type": "number", "description": description, **extra}


def _obj(description: str, properties: Schema, **extra: Any) -> Schema:
    return {"type": "object", "description": description, "properties": properties, **extra}


def _free_object(description: str) -> Schema:
    """A Kubernetes type we pass through untouched (affinity, toleration, env var...)."""
    return {"type": "object", "description": description, "x-kubernetes-preserve-unknown-fields": True}


def _secret_key_ref(description: str, default_key: str) -> Schema:
    return _obj(
        description,
        {"name": _str("Secret name (same namespace)."), "key": _str("Key inside the Secret.", default=default_key)},
        required=["name"],
    )


def _autoscaling_schema(stage: str) -> Schema:
    targets: Schema = {
        "targetQueueDepth": _num(
            "Waiting requests per replica the autoscaler aims for.", minimum=0.1, default=4.0
        ),
    }
    if stage == "decode":
        targets["targetKVUsage"] = _num(
            "Mean KV-block usage (0..1) per replica the autoscaler aims for.", minimum=0.05, maximum=1.0, default=0.75
        )
        targets["targetRunningRequests"] = _num(
            "Running (streaming) requests per replica the autoscaler aims for.", minimum=1, default=32.0
        )
    return _obj(
        "Replicas computed from the stage's metrics instead of `replicas`.",
        {
            "enabled": {"type": "boolean", "default": False},
            "minReplicas": _int("Lower bound; 0 (prefill and decode): scaled to zero after "
                                "scaleDownStabilizationSeconds without work, and back to one when a router holds "
                                "a request for the stage.", minimum=0, default=1),
            "maxReplicas": _int("Upper bound.", minimum=1, default=4),
            "scaleDownStabilizationSeconds": _int(
                "Scale down only to the highest recommendation seen in this window.", minimum=0, default=300
            ),
            "maxScaleUpStep": _int("At most this many replicas added per decision.", minimum=1, default=4),
            **targets,
        },
        default={},
        **{"x-kubernetes-validations": [{"rule": "self.minReplicas <= self.maxReplicas",
                                          "message": "minReplicas must not exceed maxReplicas"}]},
    )


def _model_schema(description: str) -> Schema:
    """A checkpoint and where it lives (spec.model, and a stage's own model)."""
    return _obj(
        description,
        {
            "name": _str("Served model name, e.g. Qwen/Qwen3-0.6B.", minLength=1),
            "source": _str("Where the checkpoint lives (hf: downloaded from the Hugging Face Hub by an init "
                           "container into each pod).", enum=["image", "pvc", "hostPath", "hf"], default="image"),
            "path": _str("Folder inside the image (source=image).", default="/models/model"),
            "hf": _obj(
                "source=hf: a Hugging Face Hub repository, downloaded into an emptyDir mounted read-only at "
                "/models/<name> (the image needs the hf extra).",
                {
                    "repo": _str("Repository, org/name or hf://org/name.",
                                 pattern=r"^(hf://)?[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$"),
                    "revision": _str("Branch, tag or commit (default: the repository's default branch)."),
                    "tokenSecretRef": _secret_key_ref("A Secret holding a Hub token (private or gated "
                                                      "repositories), given to the download as HF_TOKEN.", "token"),
                    "sizeLimit": {"x-kubernetes-int-or-string": True,
                                  "description": "The download volume's size limit, e.g. 20Gi (default: none)."},
                },
                required=["repo"],
            ),
            "pvc": _obj(
                "source=pvc: a PersistentVolumeClaim holding the checkpoint.",
                {
                    "claimName": _str("PVC name.", minLength=1),
                    "subPath": _str("Folder of the checkpoint inside the volume.", default=""),
                },
                required=["claimName"],
            ),
            "hostPath": _str("source=hostPath: folder of the checkpoint on every node."),
        },
        required=["name"],
        **{"x-kubernetes-validations": [
            {"rule": "self.source != 'pvc' || has(self.pvc)", "message": "source=pvc needs model.pvc"},
            {"rule": "self.source != 'hostPath' || has(self.hostPath)", "message": "source=hostPath needs model.hostPath"},
            {"rule": "self.source != 'hf' || has(self.hf)", "message": "source=hf needs model.hf"},
        ]},
    )


def _stage_schema(stage: str) -> Schema:
    props: Schema = {
        "replicas": _int("Replicas when autoscaling is off.", minimum=0, default=1),
        "resources": {
            "type": "object",
            "description": "Container resources (requests/limits), as in a Pod spec.",
            "properties": {
                "requests": {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True}},
                "limits": {"type": "object", "additionalProperties": {"x-kubernetes-int-or-string": True}},
            },
        },
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": _free_object("A Pod toleration.")},
        "affinity": _free_object("Pod affinity; the operator adds its own co-location terms."),
        "args": {"type": "array", "description": "Extra arguments after the operator's.", "items": {"type": "string"}},
        "env": {"type": "array", "description": "Extra environment variables (EnvVar).", "items": _free_object("EnvVar")},
        "terminationGracePeriodSeconds": _int(
            "Time the stage gets to drain on scale-down or rollout.", minimum=0, default=_GRACE_SECONDS[stage]
        ),
    }
    if stage in AUTOSCALED_STAGES:
        props["autoscaling"] = _autoscaling_schema(stage)
        props["model"] = _model_schema(
            "This stage's own checkpoint of spec.model in another precision (default: spec.model), e.g. decode on "
            "the model's AWQ copy behind a bf16 prefill; the decode pods then continue KV that the other weights "
            "computed (--kv-from-other-weights). Served under spec.model.name.")
    return _obj(f"The {stage} stage.", props, default={})


def spec_schema() -> Schema:
    """The openAPIV3Schema of `spec`."""
    model = _model_schema("The checkpoint to serve.")
    image = _obj(
        "The qwen-serve container image.",
        {
            "repository": _str("Image repository.", default="ghcr.io/qwen-serve/qwen-serve"),
            "tag": _str("Image tag.", default="0.1.0"),
            "pullPolicy": _str("Image pull policy.", enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"),
            "pullSecrets": {"type": "array", "items": {"type": "string"}, "description": "imagePullSecrets names."},
        },
        default={},
    )
    kv = _obj(
        "How prefill hands its KV cache to decode.",
        {
            "mode": _str(
                "shm: same node, through the node's /dev/shm (prefill and decode co-located); "
                "network: across nodes, a gRPC byte stream; mooncake: across nodes, Mooncake Transfer Engine "
                "(TCP, or RDMA where the nodes have it; the image needs the mooncake extra).",
                enum=list(KV_TRANSFER_MODES),
                default="network",
            ),
        },
        default={},
    )
    stages = _obj("Per-stage settings.", {stage: _stage_schema(stage) for stage in STAGES}, default={})
    slo = _obj(
        "Latency objectives the autoscaler defends.",
        {
            "ttftSeconds": _num("Time to first token target.", exclusiveMinimum=True, minimum=0, default=1.0),
            "interTokenLatencySeconds": _num("Inter-token latency target.", exclusiveMinimum=True, minimum=0,
                                             default=0.05),
            "quantile": _num("Latency quantile compared with the targets.", minimum=0.5, maximum=0.999, default=0.9),
        },
        default={},
    )
    ratio = _obj(
        "Bounds on prefill replicas divided by decode replicas, kept while autoscaling.",
        {
            "min": _num("Lowest prefill:decode ratio.", exclusiveMinimum=True, minimum=0, default=0.25),
            "max": _num("Highest prefill:decode ratio.", exclusiveMinimum=True, minimum=0, default=4.0),
        },
        default={},
        **{"x-kubernetes-validations": [{"rule": "self.min <= self.max", "message": "min must not exceed max"}]},
    )
    rate_limits = _obj(
        "Default per-tenant limits enforced by the router.",
        {
            "requestsPerMinute": _int("0 = unlimited.", minimum=0, default=0),
            "tokensPerMinute": _int("0 = unlimited.", minimum=0, default=0),
            "failOpen": {"type": "boolean", "description": "Admit requests when Redis is down.", "default": True},
        },
        default={},
    )
    redis = _obj(
        "Redis for shared rate limits and usage metering (in-process limits when unset).",
        {
            "url": _str("redis://host:port/db"),
            "urlSecretRef": _secret_key_ref("A Secret holding the URL (wins over url).", "url"),
        },
        default={},
    )
    telemetry = _obj(
        "Traces, logs and who may read metrics.",
        {
            "otlpEndpoint": _str("OTLP endpoint for traces; tracing is off when empty."),
            "logFormat": _str("Log line format.", enum=["plain", "json"], default="plain"),
            "monitoringNamespaceSelector": _obj(
                "Namespaces whose pods may scrape the stages' metrics ports (the NetworkPolicies' label "
                "selector); {} admits every namespace.",
                {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array", "items": _free_object("A label selector requirement.")},
                },
                default={"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            ),
        },
        default={},
    )
    router_service = _obj(
        "How the router is exposed.",
        {
            "type": _str("Service type.", enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP"),
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        default={},
    )
    return _obj(
        "Desired state of a qwen-serve deployment.",
        {
            "model": model,
            "image": image,
            "kvTransfer": kv,
            "coldStartTimeoutSeconds": _int(
                "How long the router holds a request for a stage scaled to zero (autoscaling minReplicas 0) while "
                "a pod starts; then it answers 503 with Retry-After.", minimum=1, default=120),
            "preset": _str("Operating mode of prefill, decode and the router: latency (short prompts first, at "
                           "most 32 streams per decode worker with the rest waiting at the router before prefill, "
                           "every token sent at once) or throughput (arrival order, up to 256 streams a batch, "
                           "tokens coalesced); a stage's own args win over it. Each router replica counts its own "
                           "streams.", enum=list(PRESET_NAMES), default="none"),
            "stages": stages,
            "slo": slo,
            "prefillDecodeRatio": ratio,
            "rateLimits": rate_limits,
            "redis": redis,
            "apiKeysSecret": _secret_key_ref("API keys file for the router (keys, tenants, limits).", "api-keys.yaml"),
            "fallback": _str("Another QwenDeployment in this namespace that answers this model's requests while its "
                             "decode pods are all unavailable (it must share this model's vocabulary; answers name it).",
                             maxLength=52, pattern="^[a-z]([-a-z0-9]*[a-z0-9])?$"),
            "canary": _obj(
                "Send a share of tenants (a stable hash of the tenant, or of the request's user) to another "
                "QwenDeployment in this namespace, a new version of this model (sharing its vocabulary).",
                {"deployment": _str("The canary's QwenDeployment.", maxLength=52,
                                    pattern="^[a-z]([-a-z0-9]*[a-z0-9])?$"),
                 "percent": _num("Share of tenants, 0 to 100.", minimum=0, maximum=100)},
                required=["deployment", "percent"],
            ),
            "telemetry": telemetry,
            "routerService": router_service,
        },
        required=["model"],
    )


def status_schema() -> Schema:
    """The openAPIV3Schema of `status` (written by the operator only)."""
    stage_status = _obj(
        "Replicas of one stage.",
        {
            "desiredReplicas": _int("Replicas the operator asks for."),
            "readyReplicas": _int("Replicas passing readiness."),
            "summary": _str("ready/desired, for kubectl get."),
            "autoscaled": {"type": "boolean"},
            "lastScaleTime": _str("Last autoscaler change.", format="date-time"),
            "lastScaleReason": _str("Why the autoscaler last changed the replicas."),
        },
    )
    condition = _obj(
        "A condition, as in metav1.Condition.",
        {
            "type": _str("Ready, Progressing or Degraded."),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("CamelCase reason."),
            "message": _str("Human-readable details."),
            "lastTransitionTime": _str("When status last changed.", format="date-time"),
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
        required=["type", "status"],
    )
    return _obj(
        "Observed state, kept true from the children.",
        {
            "observedGeneration": {"type": "integer", "format": "int64"},
            "routerEndpoint": _str("In-cluster HTTP endpoint of the router."),
            "stages": _obj("Per-stage replicas.", {stage: stage_status for stage in STAGES}),
            "conditions": {
                "type": "array",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
        },
        # kopf keeps its own progress bookkeeping under status.kopf.
        **{"x-kubernetes-preserve-unknown-fields": True},
    )


def printer_columns() -> list[dict[str, Any]]:
    """Columns of `kubectl get qwendeployments`."""
    cols: list[dict[str, Any]] = [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    ]
    cols += [
        {"name": stage.capitalize(), "type": "string", "jsonPath": f".status.stages.{stage}.summary"}
        for stage in STAGES
    ]
    cols.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
    return cols


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest."""
    schema: Schema = {
        "type": "object",
        "description": "A qwen-serve deployment: tokenizer, prefill, decode and router stages.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Names become Service names ("<name>-tokenizer"), so they must be short DNS-1035 labels.
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 52, "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"}},
            },
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "required": ["spec"],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "qwen-serve", "app.kubernetes.io/part-of": "qwen-serve"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["all", "qwen-serve"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def render_yaml() -> str:
    """The CRD as the YAML file the chart ships."""
    header = "# Generated by `python -m qwenserve_operator.crd`; edit operator/qwenserve_operator/crd.py instead.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


def openapi_schema() -> Schema:
    """The whole object's openAPIV3Schema."""
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _apply_defaults(value: Any, schema: Schema) -> Any:
    if schema.get("type") != "object" or not isinstance(value, dict):
        return value
    for key, sub in schema.get("properties", {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            value[key] = _apply_defaults(value[key], sub)
    return value


def with_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """A copy of `spec` with the schema's defaults filled in, as the API server stores it."""
    return _apply_defaults(copy.deepcopy(dict(spec)), spec_schema())


if __name__ == "__main__":
    sys.stdout.write(render_yaml())
