"""Server-side Tables: what `kubectl get` prints, as a real API server computes it.

kubectl asks for `application/json;as=Table;v=v1;g=meta.k8s.io` and prints the columns it gets back (the
priority-1 ones only with `-o wide`); without a Table it would print NAME and AGE at most. QwenDeployments
get the CRD's additionalPrinterColumns (their JSONPaths evaluated here), pods, Deployments, Services and
NetworkPolicies the columns kubectl users know, everything else NAME and AGE.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from typing import Any

from qwenserve_operator.crd import printer_columns

Obj = dict[str, Any]

TABLE_ACCEPT = "as=Table"


def wants_table(accept: str) -> bool:
    """Whether an Accept header asks for a meta.k8s.io Table."""
    return TABLE_ACCEPT in accept and "g=meta.k8s.io" in accept


def age(timestamp: str | None, now: datetime.datetime | None = None) -> str:
    """kubectl's short age ("42s", "5m", "3h", "2d") of an RFC 3339 timestamp; "<unknown>" without one."""
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int(((now or datetime.datetime.now(datetime.UTC)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:  # "90s", "119m", "47h" as kubectl shows them, then the larger unit
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


_FILTER = re.compile(r'\[\?\(@\.(\w+)==["\']([^"\']*)["\']\)\]')


def json_path(obj: Any, path: str) -> Any:
    """The value at a printer column's JSONPath: `.a.b`, `[N]` and `[?(@.key=="value")]` steps; None if absent."""
    tokens = re.findall(r'\.[\w-]+|\[\d+\]|\[\?\(@\.\w+==["\'][^"\']*["\']\)\]', path)
    value = obj
    for token in tokens:
        if value is None:
            return None
        if token.startswith("."):
            value = value.get(token[1:]) if isinstance(value, dict) else None
        elif match := _FILTER.fullmatch(token):
            key, wanted = match.groups()
            value = next((v for v in value if isinstance(v, dict) and str(v.get(key)) == wanted), None) \
                if isinstance(value, list) else None
        else:
            index = int(token[1:-1])
            value = value[index] if isinstance(value, list) and index < len(value) else None
    return value


def _column(name: str, kind: str = "string", priority: int = 0, fmt: str = "") -> Obj:
    return {"name": name, "type": kind, "format": fmt, "description": "", "priority": priority}


NAME = _column("Name", fmt="name")
AGE = _column("Age")


def _created(obj: Obj) -> str:
    return age(obj.get("metadata", {}).get("creationTimestamp"))


def _qwendeployment() -> tuple[list[Obj], Callable[[Obj], list[Any]]]:
    columns = printer_columns()

    def cells(obj: Obj) -> list[Any]:
        row: list[Any] = [obj["metadata"]["name"]]
        for column in columns:
            value = json_path(obj, column["jsonPath"])
            row.append(age(value) if column["type"] == "date" else ("" if value is None else value))
        return row

    return [NAME, *(_column(c["name"], "string", c.get("priority", 0)) for c in columns)], cells


def _pod() -> tuple[list[Obj], Callable[[Obj], list[Any]]]:
    def cells(obj: Obj) -> list[Any]:
        status = obj.get("status", {})
        containers = status.get("containerStatuses", [])
        ready = sum(bool(c.get("ready")) for c in containers)
        phase = "Terminating" if obj["metadata"].get("deletionTimestamp") else status.get("phase", "Pending")
        restarts = sum(int(c.get("restartCount", 0)) for c in containers)
        return [obj["metadata"]["name"], f"{ready}/{max(len(containers), 1)}", phase, str(restarts), _created(obj),
                status.get("podIP") or "<none>", obj.get("spec", {}).get("nodeName") or "<none>", "<none>",
                "<none>"]

    return [NAME, _column("Ready"), _column("Status"), _column("Restarts"), AGE, _column("IP", priority=1),
            _column("Node", priority=1), _column("Nominated Node", priority=1),
            _column("Readiness Gates", priority=1)], cells


def _deployment() -> tuple[list[Obj], Callable[[Obj], list[Any]]]:
    def cells(obj: Obj) -> list[Any]:
        status = obj.get("status", {})
        want = obj.get("spec", {}).get("replicas", 1)
        container = (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}])[0]
        return [obj["metadata"]["name"], f"{status.get('readyReplicas', 0)}/{want}",
                status.get("updatedReplicas", 0), status.get("availableReplicas", 0), _created(obj),
                container.get("name", ""), container.get("image", "")]

    return [NAME, _column("Ready"), _column("Up-to-date", "integer"), _column("Available", "integer"), AGE,
            _column("Containers", priority=1), _column("Images", priority=1)], cells


def _service() -> tuple[list[Obj], Callable[[Obj], list[Any]]]:
    def cells(obj: Obj) -> list[Any]:
        spec = obj.get("spec", {})
        ports = ",".join(f"{p['port']}/{p.get('protocol', 'TCP')}" for p in spec.get("ports", []))
        return [obj["metadata"]["name"], spec.get("type", "ClusterIP"), spec.get("clusterIP", "<none>"), "<none>",
                ports or "<none>", _created(obj)]

    return [NAME, _column("Type"), _column("Cluster-IP"), _column("External-IP"), _column("Port(s)"), AGE], cells


def _network_policy() -> tuple[list[Obj], Callable[[Obj], list[Any]]]:
    def cells(obj: Obj) -> list[Any]:
        labels = obj.get("spec", {}).get("podSelector", {}).get("matchLabels", {})
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "<none>"
        return [obj["metadata"]["name"], selector, _created(obj)]

    return [NAME, _column("Pod-Selector"), AGE], cells


def _default() -> tuple[list[Obj], Callable[[Obj], list[Any]]]:
    return [NAME, AGE], lambda obj: [obj["metadata"]["name"], _created(obj)]


LAYOUTS: dict[str, Callable[[], tuple[list[Obj], Callable[[Obj], list[Any]]]]] = {
    "QwenDeployment": _qwendeployment, "Pod": _pod, "Deployment": _deployment, "Service": _service,
    "NetworkPolicy": _network_policy,
}


def table(kind: str, objects: list[Obj], include_object: str = "PartialObjectMetadata") -> Obj:
    """A meta.k8s.io/v1 Table of `objects` of `kind`; each row carries its object (or its metadata only)."""
    columns, cells = LAYOUTS.get(kind, _default)()
    rows = []
    for obj in objects:
        if include_object == "Object":
            carried: Obj | None = obj
        elif include_object == "None":
            carried = None
        else:
            carried = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
        rows.append({"cells": cells(obj), "object": carried})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": "1"},
            "columnDefinitions": columns, "rows": rows}
