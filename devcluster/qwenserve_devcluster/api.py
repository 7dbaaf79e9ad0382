"""The API side of the local cluster: the kmock Kubernetes emulator, the operator against it, and a client.

The emulator is kmock's `KubernetesEmulator` (the one tests/operator runs the operator against) plus
what a real API server does that the operator and kubectl rely on (see `ApiServer`). The operator is the real one
(kopf and our handlers) in a thread with its own event loop, as in production. `ApiClient` is the
small REST client the pod runner and `dev-cluster scale` use: list, create, merge-patch, delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import kmock
import kopf

from qwenserve_devcluster.discovery import (
    QWENDEPLOYMENTS,
    RESOURCES,
    VERBS,
    api_group,
    api_group_list,
    api_resource_list,
    api_versions,
    find,
    openapi_v3,
    unknown_fields,
)
from qwenserve_devcluster.tables import table, wants_table
from qwenserve_operator.crd import openapi_schema

QD = QWENDEPLOYMENTS.key


def _header(request: kmock.Request, name: str) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == name.lower()), "")


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    """An error as the API server answers it (a meta/v1 Status), which kubectl prints as its message."""
    return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


_TERM = re.compile(r"\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*")


def label_selector(selector: str) -> Callable[[dict[str, str]], bool]:
    """A predicate on labels for a list's `labelSelector` (`a=b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x)`)."""
    checks: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(str.strip, re.split(r",(?![^(]*\))", selector)):
        match = _TERM.fullmatch(term)
        if match is None:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=f"unable to parse requirement: {term!r}")
        negated, key, operator, value, set_operator, values = match.groups()
        if set_operator:
            allowed = {v.strip() for v in values.split(",")}
            checks.append(lambda labels, k=key, a=allowed, o=set_operator: (labels.get(k) in a) == (o == "in")
                          if k in labels else o == "notin")
        elif operator:
            checks.append(lambda labels, k=key, v=value, o=operator: (labels.get(k) == v) == (o != "!="))
        else:
            checks.append(lambda labels, k=key, n=bool(negated): (k in labels) != n)
    return lambda labels: all(check(labels) for check in checks)


def merge_patch(target: Any, patch: Any) -> Any:
    """`target` with a JSON merge patch (RFC 7386) applied: objects merged key by key, null removing a key, anything
    else replacing."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


DISCOVERY = (  # exact paths -> their document (None when not served: a 404)
    (re.compile(r"/api/?"), lambda m: api_versions()),
    (re.compile(r"/apis/?"), lambda m: api_group_list()),
    (re.compile(r"/api/(v1)/?"), lambda m: api_resource_list(m.group(1))),
    (re.compile(r"/apis/([^/]+)/?"), lambda m: api_group(m.group(1))),
    (re.compile(r"/apis/([^/]+/[^/]+)/?"), lambda m: api_resource_list(m.group(1))),
    (re.compile(r"/openapi/v3/?(.*)"), lambda m: openapi_v3(m.group(1).rstrip("/"))),
)


class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator plus what a real API server does that the operator and kubectl rely on.

    On create: a name from generateName (kopf's Events use it), the path's namespace, a uid and a
    creationTimestamp. On every write a new resourceVersion, and on a spec change a new generation. For kubectl:
    discovery and OpenAPI v3 (discovery.py), Tables (tables.py), lists with their kind, QwenDeployment fields
    checked against the CRD under `fieldValidation=Strict`, and pod logs from the pod runner's files under
    `pod_logs`. After a delete or an update, objects whose every owner is gone are deleted (the garbage
    collector's background cascade), so deleting a QwenDeployment removes its Deployments and so its pods.
    """

    pod_logs: Path | None = None  # <pod_logs>/<pod name>/log, set by whoever runs the pods
    request_log: int | None = None  # past requests kept for kmock's assertions (None: all, as tests read them)
    _versions = itertools.count(1)  # resourceVersions: increasing over every object, as etcd's revision

    async def _handle(self, request: kmock.Request) -> Any:
        if self.request_log is not None and len(self._requests) > 2 * self.request_log:
            # kmock matches each request to its reactions by scanning every request it has kept: after a minute a
            # running cluster's API answered in 0.2-0.4 s, its process busy with that while the cluster idled.
            for log in (self._requests, *(reaction._requests for reaction in self._payloads)):
                del log[:-self.request_log]
        path = request.url.path
        if request.method == "GET":
            for pattern, document in DISCOVERY:
                if match := pattern.fullmatch(path):
                    found = document(match)
                    return aiohttp.web.json_response(found) if found is not None else \
                        _status(404, "NotFound", f"the server could not find the requested resource ({path})")
        if request.resource is not None and request.subresource == "log" and request.method == "GET":
            return await self._serve_log(request)
        if request.action == kmock.action.WATCH:
            return await self._stream_watch(request)
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE) and isinstance(request.data, dict):
            if refusal := self._check_fields(request):
                return refusal
            # Every write makes a new resourceVersion, as on a real server. kopf tells the echo of its own patch
            # from an event sent before it by this: with one version for every state, it took stale events for
            # current ones and ran the create and update handlers again and again (seconds each, here).
            request.data.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
            if request.action == kmock.action.UPDATE and request.subresource is None and "spec" in request.data:
                self._count_generation(request)
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data["metadata"]
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
            if request.namespace:
                meta.setdefault("namespace", request.namespace)  # clients key their caches by namespace/name
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("generation", 1)
            meta.setdefault("creationTimestamp",
                            datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        try:
            return await super()._handle(request)
        finally:
            if request.action in (kmock.action.DELETE, kmock.action.UPDATE):
                await self._collect_garbage()

    def _count_generation(self, request: kmock.Request) -> None:
        """metadata.generation one up when a patch changes the spec, as the API server counts it (status.observedGeneration
        and a Deployment's rollout are read against it); metadata or status alone leave it."""
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or (current := self._objects[key]).deleted:
            return
        spec = current.raw.get("spec")
        if merge_patch(spec, request.data["spec"]) != spec:
            request.data["metadata"]["generation"] = int(current.raw.get("metadata", {}).get("generation", 1)) + 1

    def _check_fields(self, request: kmock.Request) -> aiohttp.web.Response | None:
        """A 422 naming the fields the CRD does not declare, when the client asked for strict validation."""
        resource = request.resource
        if request.params.get("fieldValidation") != "Strict" or resource is None or request.subresource or \
                find(resource.group or "", resource.version or "", resource.plural or "") != QWENDEPLOYMENTS:
            return None
        unknown = unknown_fields(request.data, openapi_schema())
        if not unknown:
            return None
        return _status(422, "Invalid", f"{QWENDEPLOYMENTS.kind}.{QWENDEPLOYMENTS.group} "
                       f"\"{request.name or request.data.get('metadata', {}).get('name', '')}\" is invalid: strict decoding error: "
                       + ", ".join(f'unknown field "{f.lstrip(".")}"' for f in unknown))

    def _kind(self, request: kmock.Request) -> tuple[str, str]:
        """(kind, apiVersion) of the request's resource; ("", "") for one the catalogue does not hold."""
        r = request.resource
        found = find(r.group or "", r.version or "", r.plural or "") if r is not None else None
        return (found.kind, found.group_version) if found is not None else ("", "")

    async def _serve_list(self, request: kmock.Request) -> Any:
        listed = await super()._serve_list(request)
        kind, api_version = self._kind(request)
        wanted = label_selector(request.params.get("labelSelector", ""))
        items = [{"kind": kind, "apiVersion": api_version, **item} for item in listed["items"]
                 if wanted((item.get("metadata") or {}).get("labels") or {})]
        if kind and wants_table(_header(request, "Accept")):
            return table(kind, items, request.params.get("includeObject", "PartialObjectMetadata"))
        return {**listed, "kind": f"{kind}List", "apiVersion": api_version, "items": items}

    async def _stream_watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """A watch as JSON lines labelled application/json: client-go (kubectl) refuses kmock's own stream, labelled
        application/octet-stream, and `kubectl delete` then waits for the deletion until its timeout."""
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        with contextlib.suppress(ConnectionError):
            async for event in self._serve_watch(request):
                if isinstance(event, dict):
                    await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
        return response

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """The objects there are (ADDED), then every change after them, with nothing lost in between.

        kmock's own watch lists the objects and only then starts reading its event bus, so a change made while
        it sends the list is never sent: `kubectl delete` waited for a deletion that happened in that moment until
        its timeout. Here the bus position is marked under the lock that every write takes, with the listing. A
        watch by name (fieldSelector metadata.name) of an object deleted since the client listed it gets its
        DELETED event, which a real server replays from the client's resourceVersion.
        """
        named = re.fullmatch(r"metadata\.name==?([^,]+)", request.params.get("fieldSelector", ""))
        name = named.group(1) if named else request.name

        def wanted(resource: Any, namespace: str | None, object_name: str | None) -> bool:
            return resource == request.resource and (request.namespace is None or namespace == request.namespace) \
                and (name is None or object_name == name)

        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            existing = [o.raw for (r, ns, n), o in self._objects.items() if wanted(r, ns, n) and not o.deleted]
            gone = [o.last.raw for (r, ns, n), o in self._objects.items()
                    if named and wanted(r, ns, n) and o.deleted and not o.empty]
        try:
            yield b""
            for raw in existing:
                yield {"type": "ADDED", "object": raw}
            if not existing and gone:
                yield {"type": "DELETED", "object": gone[0]}
                return
            async for event in mark:
                meta = event.get("object", {}).get("metadata", {})
                if wanted(request.resource, meta.get("namespace"), meta.get("name")):
                    yield event
        finally:
            await bus.unmark(mark)

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        obj = await super()._serve_fetch(request)
        kind, api_version = self._kind(request)
        if kind and request.subresource is None and wants_table(_header(request, "Accept")):
            return table(kind, [{"kind": kind, "apiVersion": api_version, **obj}],
                         request.params.get("includeObject", "PartialObjectMetadata"))
        return obj

    async def _serve_log(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """`kubectl logs POD [--tail N] [-f]`: the pod's log file, its last lines, or followed until the pod goes."""
        log = self.pod_logs / str(request.name) / "log" if self.pod_logs is not None else None
        if log is None or not log.exists():
            return _status(404, "NotFound", f'pods "{request.name}" not found (or it has no log yet)')
        content = log.read_bytes()
        offset = len(content)  # what follows is read from here on, whatever is appended while this is sent
        if (tail := request.params.get("tailLines", "")).isdigit():
            content = b"".join(content.splitlines(keepends=True)[-int(tail):]) if int(tail) else b""
        if request.params.get("follow") != "true":
            return aiohttp.web.Response(body=content, content_type="text/plain")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request._raw_request)
        await response.write(content)
        with contextlib.suppress(ConnectionResetError, FileNotFoundError):
            while log.exists():  # the pod runner removes a pod's folder's volumes, not its log: stop on the pod
                size = log.stat().st_size
                if size > offset:
                    with log.open("rb") as f:
                        f.seek(offset)
                        await response.write(f.read(size - offset))
                    offset = size
                if not any(o.get("metadata", {}).get("name") == request.name and not o.deleted
                           for (r, _, _), o in self._objects.items() if r == request.resource):
                    break
                await asyncio.sleep(0.5)
        return response

    async def _collect_garbage(self) -> None:
        """Delete every object all of whose owners are gone, until none is left (a cascade runs level by level)."""
        async with self._lock:
            while True:
                live = {o.get("metadata", {}).get("uid") for o in self._objects.values() if not o.deleted}
                orphans = [(key, o) for key, o in self._objects.items() if not o.deleted
                           and (owners := o.get("metadata", {}).get("ownerReferences"))
                           and not any(owner.get("uid") in live for owner in owners)]
                if not orphans:
                    return
                for (resource, _, _), o in orphans:
                    raw = o.raw
                    o.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})


def declare_resources(api: kmock.KubernetesEmulator) -> None:
    """Make every resource we serve known to kmock (it lists only those; kopf looks them up before watching)."""
    for r in RESOURCES:
        # kopf waits until namespaces are discoverable, even when it watches one namespace.
        api.resources[r.key] = kmock.ResourceInfo(kind=r.kind, namespaced=r.namespaced, singular=r.kind.lower(),
                                                  verbs=set(VERBS), subresources=set(r.subresources))


def resource_path(resource: str, namespace: str, name: str = "", subresource: str = "") -> str:
    """The REST path of a resource ("apps/v1/deployments") in a namespace, of one object if `name`."""
    group_version, plural = resource.rsplit("/", 1)
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}{subresource}" if name else path


class ApiError(RuntimeError):
    """The API answered with an error status."""


class ApiClient:
    """A minimal client of the emulator's REST API."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, body: Any = None, missing_ok: bool = False) -> Any:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.session.request(method, self.url + path, json=body, headers=headers) as response:
            if response.status == 404 and missing_ok:
                return None
            if response.status >= 400:
                raise ApiError(f"{method} {path}: {response.status} {await response.text()}")
            return await response.json()

    async def list(self, resource: str, namespace: str) -> list[dict[str, Any]]:
        """Every object of `resource` in `namespace`."""
        return (await self._call("GET", resource_path(resource, namespace)))["items"]

    async def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None."""
        return await self._call("GET", resource_path(resource, namespace, name), missing_ok=True)

    async def create(self, resource: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create an object; returns it as stored."""
        return await self._call("POST", resource_path(resource, namespace), body)

    async def patch(self, resource: str, namespace: str, name: str, body: dict[str, Any],
                    subresource: str = "") -> dict[str, Any] | None:
        """Merge-patch an object (or its /status); None if it is gone."""
        return await self._call("PATCH", resource_path(resource, namespace, name, subresource), body,
                                missing_ok=True)

    async def delete(self, resource: str, namespace: str, name: str) -> None:
        """Delete an object; a missing one is fine."""
        await self._call("DELETE", resource_path(resource, namespace, name), missing_ok=True)


class OperatorThread:
    """The real operator (kopf + our handlers) against `api_url`, watching `namespace`, in its own thread.

    kopf cancels every task of its loop when it exits, so it gets a loop of its own.
    """

    def __init__(self, api_url: str, namespace: str, interval: float = 5.0) -> None:
        self.api_url = api_url
        self.namespace = namespace
        self.interval = interval
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def _run(self) -> None:
        from qwenserve_operator.handlers import make_registry
        from qwenserve_operator.reconciler import OperatorConfig

        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True
        settings.watching.reconnect_backoff = 0.5
        settings.background.instant_exit_timeout = 0.5
        # A stopped dev cluster goes away: its workers need not idle out first (kopf's defaults add ~7 s to a stop).
        settings.queueing.idle_timeout = 0.5
        settings.queueing.exit_timeout = 0.5
        settings.posting.idle_timeout = 0.5
        registry = make_registry(OperatorConfig(interval=self.interval, scrape_timeout=2.0),
                                 connection=kopf.ConnectionInfo(server=self.api_url))
        try:
            asyncio.run(kopf.operator(registry=registry, settings=settings, standalone=True,
                                      namespaces=[self.namespace], stop_flag=self._stop,
                                      ready_flag=self._ready))
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)

    async def start(self, timeout: float = 30.0) -> None:
        """Start the operator and wait until kopf says it is ready."""
        self._thread.start()
        if not await asyncio.to_thread(self._ready.wait, timeout):
            raise RuntimeError(f"the operator did not start within {timeout:.0f} s: {self.errors}")

    async def stop(self, timeout: float = 15.0) -> None:
        """Stop the operator and wait for its thread."""
        self._stop.set()
        await asyncio.to_thread(self._thread.join, timeout)
