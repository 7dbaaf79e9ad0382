"""The dev cluster's resource catalogue as an API server publishes it: discovery documents and OpenAPI v3.

kubectl maps `get pods`, `get qwd` or a manifest's kind to a REST path through discovery (`/api`, `/api/v1`,
`/apis`, `/apis/<group>/<version>`), and `apply` decides whether the server validates fields itself by
looking for the `fieldValidation` parameter on the kind's PATCH operation in `/openapi/v3`. Every document
here is a pure function of `RESOURCES` (and of the CRD for the QwenDeployment's schema).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from qwenserve_operator import crd

VERBS = ("get", "list", "watch", "create", "update", "patch", "delete")


@dataclass(frozen=True)
class Resource:
    """One kind the emulator serves, as discovery names it."""

    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    short_names: tuple[str, ...] = ()
    namespaced: bool = True
    subresources: tuple[str, ...] = ("status",)
    categories: tuple[str, ...] = ()

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """The "group/version/plural" key api.py and the pod runner use ("v1/pods")."""
        return f"{self.group_version}/{self.plural}"


QWENDEPLOYMENTS = Resource(crd.GROUP, crd.VERSION, crd.PLURAL, crd.KIND, tuple(crd.SHORT_NAMES),
                           categories=("all", "qwen-serve"))
PODS = Resource("", "v1", "pods", "Pod", ("po",), subresources=("status", "log"), categories=("all",))
RESOURCES = (
    QWENDEPLOYMENTS,
    PODS,
    Resource("", "v1", "services", "Service", ("svc",), categories=("all",)),
    Resource("", "v1", "configmaps", "ConfigMap", ("cm",)),
    Resource("", "v1", "secrets", "Secret"),
    Resource("", "v1", "events", "Event", ("ev",)),
    Resource("", "v1", "namespaces", "Namespace", ("ns",), namespaced=False),
    Resource("apps", "v1", "deployments", "Deployment", ("deploy",), categories=("all",)),
    Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", ("netpol",)),
)
BY_KEY = {r.key: r for r in RESOURCES}


def find(group: str, version: str, plural: str) -> Resource | None:
    """The catalogue's entry for a REST path's group, version and plural, if served."""
    return BY_KEY.get(f"{group}/{version}/{plural}" if group else f"{version}/{plural}")


def api_versions() -> dict[str, Any]:
    """`/api`: the core group's versions."""
    return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}


def _group(name: str) -> dict[str, Any]:
    versions = sorted({r.version for r in RESOURCES if r.group == name})
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def api_group_list() -> dict[str, Any]:
    """`/apis`: every named group."""
    groups = sorted({r.group for r in RESOURCES if r.group})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group(g) for g in groups]}


def api_group(name: str) -> dict[str, Any] | None:
    """`/apis/<group>`, or None when the group is not served."""
    if not any(r.group == name for r in RESOURCES if r.group):
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name)}


def api_resource_list(group_version: str) -> dict[str, Any] | None:
    """`/api/v1` or `/apis/<group>/<version>`, or None when that version is not served."""
    served = [r for r in RESOURCES if r.group_version == group_version]
    if not served:
        return None
    resources: list[dict[str, Any]] = []
    for r in served:
        resources.append({"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced,
                          "kind": r.kind, "verbs": list(VERBS), "shortNames": list(r.short_names),
                          "categories": list(r.categories)})
        for sub in r.subresources:
            verbs = ["get"] if sub == "log" else ["get", "patch", "update"]
            resources.append({"name": f"{r.plural}/{sub}", "singularName": "", "namespaced": r.namespaced,
                              "kind": r.kind, "verbs": verbs})
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources}


# -- OpenAPI v3: only what tells kubectl that this server validates QwenDeployment fields itself ----------

OPENAPI_QD_PATH = f"apis/{crd.GROUP}/{crd.VERSION}"


def _qd_document() -> dict[str, Any]:
    gvk = {"group": crd.GROUP, "version": crd.VERSION, "kind": crd.KIND}  # one on an operation, a list on a schema
    field_validation = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True},
                        "description": "Strict: unknown fields are refused; Ignore: they are dropped silently."}
    item = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{{namespace}}/{crd.PLURAL}/{{name}}"
    operation = {"x-kubernetes-group-version-kind": gvk, "parameters": [field_validation],
                 "responses": {"200": {"description": "OK"}}}
    return {
        "openapi": "3.0.0",
        "info": {"title": "qwen-serve dev-cluster", "version": crd.VERSION},
        "paths": {item: {"patch": {**operation, "operationId": "patchQwenDeployment"},
                         "put": {**operation, "operationId": "replaceQwenDeployment"}},
                  item.rsplit("/", 1)[0]: {"post": {**operation, "operationId": "createQwenDeployment"}}},
        "components": {"schemas": {f"io.qwenserve.{crd.VERSION}.{crd.KIND}": {
            **crd.openapi_schema(), "x-kubernetes-group-version-kind": [gvk]}}},
    }


def openapi_v3(path: str) -> dict[str, Any] | None:
    """`/openapi/v3` (the index) or `/openapi/v3/<group version path>`; None for anything else."""
    document = _qd_document()
    if path == "":
        digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16].upper()
        return {"paths": {OPENAPI_QD_PATH: {"serverRelativeURL": f"/openapi/v3/{OPENAPI_QD_PATH}?hash={digest}"}}}
    return document if path == OPENAPI_QD_PATH else None


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths of fields in `obj` that `schema` (a CRD's structural schema) does not declare, as the API server's
    strict field validation names them (".spec.stages.decode.replica")."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(obj, dict | list):
        return []
    if isinstance(obj, list):
        items = schema.get("items") or {}
        return [f for i, v in enumerate(obj) for f in unknown_fields(v, items, f"{path}[{i}]")]
    properties: dict[str, Any] = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    found: list[str] = []
    for key, value in obj.items():
        if key in properties:
            found += unknown_fields(value, properties[key], f"{path}.{key}")
        elif isinstance(extra, dict):
            found += unknown_fields(value, extra, f"{path}.{key}")
        elif not (path == ".metadata" or extra is True):  # metadata is the API server's own type, not the CRD's
            found.append(f"{path}.{key}")
    return found
