"""The operator's own Kubernetes calls (children, status, pods) through the official `kubernetes` client.

kopf watches and patches the QwenDeployments itself; the reconciler needs a handful of plain calls
more. Both use one set of credentials: the `kopf.ConnectionInfo` the operator logged in with, which
`handlers.login` gets from the `kubernetes` library's own loaders (service account, then kubeconfig;
the library keeps any certificate files a kubeconfig inlines and removes them at exit). The library
is synchronous, so every call runs in a worker thread; answers stay plain JSON dicts.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes import client

from qwenserve_operator.crd import GROUP, KIND, PLURAL, VERSION

TIMEOUT_SECONDS = 30
MERGE_PATCH = "application/merge-patch+json"

# kind -> (typed API, the name its methods use) for every built-in kind the operator touches.
BUILTIN: dict[str, tuple[type, str]] = {
    "ConfigMap": (client.CoreV1Api, "config_map"),
    "Service": (client.CoreV1Api, "service"),
    "Pod": (client.CoreV1Api, "pod"),
    "Deployment": (client.AppsV1Api, "deployment"),
    "NetworkPolicy": (client.NetworkingV1Api, "network_policy"),
    "Secret": (client.CoreV1Api, "secret"),  # created only: the operator never reads one
}


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0 when no answer came)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API {status}: {message}")
        self.status = status


class KubeClosed(KubeError):
    """A call made after the client was closed: the operator is stopping."""

    def __init__(self) -> None:
        super().__init__(0, "the client is closed (the operator is stopping)")


def configuration(info: kopf.ConnectionInfo) -> client.Configuration:
    """The client library's settings for the credentials kopf logged in with."""
    if info.ca_data or info.certificate_data or info.private_key_data:
        raise KubeError(0, "certificates must be given as files (ca_path, certificate_path, private_key_path)")
    config = client.Configuration(host=info.server.rstrip("/"))
    config.verify_ssl = not info.insecure
    config.ssl_ca_cert = os.fsdecode(info.ca_path) if info.ca_path else None
    config.cert_file = os.fsdecode(info.certificate_path) if info.certificate_path else None
    config.key_file = os.fsdecode(info.private_key_path) if info.private_key_path else None
    if info.token:
        config.api_key["authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
    return config


def _message(exc: client.ApiException) -> str:
    try:
        return str(json.loads(exc.body or "")["message"])
    except (ValueError, KeyError, TypeError):
        return exc.reason or "error"


class KubeClient:
    """JSON in, JSON out; raises KubeError on any non-2xx answer."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.api = client.ApiClient(configuration(info))
        self._closed = False

    def _method(self, verb: str, kind: str, subresource: str | None) -> tuple[Callable[..., Any], dict[str, str]]:
        suffix = f"_{subresource}" if subresource else ""
        if kind == KIND:
            custom = client.CustomObjectsApi(self.api)
            method = getattr(custom, f"{'get' if verb == 'read' else verb}_namespaced_custom_object{suffix}")
            return method, {"group": GROUP, "version": VERSION, "plural": PLURAL}
        api, noun = BUILTIN[kind]
        return getattr(api(self.api), f"{verb}_namespaced_{noun}{suffix}"), {}

    async def _call(self, verb: str, kind: str, subresource: str | None = None, **arguments: Any) -> dict[str, Any]:
        if self._closed:
            raise KubeClosed()
        method, fixed = self._method(verb, kind, subresource)
        try:
            response = await asyncio.to_thread(method, **fixed, **arguments, _preload_content=False,
                                               _request_timeout=TIMEOUT_SECONDS)
        except client.ApiException as exc:
            raise KubeError(exc.status or 0, _message(exc)) from exc
        except ValueError as exc:  # the library's own schema refused a manifest before sending it
            raise KubeError(422, f"{kind} refused by the client's schema: {' '.join(str(exc).split())}") from exc
        return json.loads(response.data or b"{}")

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._call("read", kind, namespace=namespace, name=name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace carrying all of `labels`."""
        selector = ",".join(f"{key}={value}" for key, value in labels.items())
        answer = await self._call("list", kind, namespace=namespace, label_selector=selector)
        # Filtered again here: cheap, and a proxy or mock that ignores the selector cannot mislead us.
        return [item for item in answer.get("items") or []
                if labels.items() <= ((item.get("metadata") or {}).get("labels") or {}).items()]

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create an object from its manifest."""
        return await self._call("create", manifest["kind"], namespace=manifest["metadata"]["namespace"],
                                body=manifest)

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None) -> dict[str, Any]:
        """An RFC 7386 merge patch (lists are replaced whole, which is what a desired state wants)."""
        return await self._call("patch", kind, subresource, namespace=namespace, name=name, body=patch,
                                _content_type=MERGE_PATCH)

    async def close(self) -> None:
        """Close the connection pool; later calls fail instead of opening a new one."""
        self._closed = True
        self.api.close()
