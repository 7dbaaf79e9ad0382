"""A small async Kubernetes client for the operator's own calls (children, status, pods).

kopf watches and patches the QwenDeployments itself; the operator's reconciler needs a handful of
plain REST calls more. It uses the same credentials kopf logged in with (`kopf.ConnectionInfo`),
so there is one place that knows how to reach the cluster.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from typing import Any

import aiohttp
import kopf

# kind -> (API prefix, plural) for every kind the operator touches.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "QwenDeployment": ("/apis/qwenserve.io/v1alpha1", "qwendeployments"),
}


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API {status}: {message}")
        self.status = status


def resource_path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    """The REST path of a namespaced object (or of its collection when name is None)."""
    prefix, plural = RESOURCES[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name is not None:
        path += f"/{name}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    context = ssl.create_default_context()
    if info.ca_path:
        context.load_verify_locations(cafile=os.fsdecode(info.ca_path))
    elif info.ca_data:
        data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        context.load_verify_locations(cadata=data if "BEGIN" in data else base64.b64decode(data).decode())
    if info.certificate_path or info.certificate_data:
        context.load_cert_chain(*_client_cert_files(info))
    return context


def _client_cert_files(info: kopf.ConnectionInfo) -> tuple[str, str]:
    # ssl wants files; kubeconfig may carry the key pair inline.
    def as_file(path: Any, data: Any) -> str:
        if path:
            return os.fsdecode(path)
        raw = data if isinstance(data, bytes) else data.encode()
        raw = raw if b"BEGIN" in raw else base64.b64decode(raw)
        handle = tempfile.NamedTemporaryFile(delete=False, suffix=".pem")
        handle.write(raw)
        handle.close()
        return handle.name

    return (as_file(info.certificate_path, info.certificate_data),
            as_file(info.private_key_path, info.private_key_data))


class KubeClient:
    """JSON in, JSON out; raises KubeError on any non-2xx answer."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.info = info
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.info.token:
            headers["Authorization"] = f"{self.info.scheme or 'Bearer'} {self.info.token}"
        return headers

    async def _request(self, method: str, path: str, body: Any = None,
                       content_type: str = "application/json",
                       params: dict[str, str] | None = None) -> dict[str, Any]:
        if self._closed:
            raise KubeError(0, "the client is closed (the operator is stopping)")
        if self._session is None:
            auth = aiohttp.BasicAuth(self.info.username, self.info.password or "") if self.info.username else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=_ssl_context(self.info)),
                auth=auth, timeout=aiohttp.ClientTimeout(total=30))
        headers = self._headers()
        if body is not None:
            headers["Content-Type"] = content_type
        url = self.info.server.rstrip("/") + path
        async with self._session.request(method, url, json=body, headers=headers, params=params) as response:
            payload = await response.json(content_type=None) if response.content_length != 0 else {}
            if response.status >= 400:
                message = payload.get("message") if isinstance(payload, dict) else None
                raise KubeError(response.status, message or response.reason or "error")
            return payload or {}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._request("GET", resource_path(kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace carrying all of `labels`."""
        selector = ",".join(f"{key}={value}" for key, value in labels.items())
        answer = await self._request("GET", resource_path(kind, namespace), params={"labelSelector": selector})
        # Filtered again here: cheap, and a proxy or mock that ignores the selector cannot mislead us.
        return [item for item in answer.get("items") or []
                if labels.items() <= ((item.get("metadata") or {}).get("labels") or {}).items()]

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create an object from its manifest."""
        meta = manifest["metadata"]
        return await self._request("POST", resource_path(manifest["kind"], meta["namespace"]), manifest)

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None) -> dict[str, Any]:
        """An RFC 7386 merge patch (lists are replaced whole, which is what a desired state wants)."""
        return await self._request("PATCH", resource_path(kind, namespace, name, subresource), patch,
                                   "application/merge-patch+json")

    async def close(self) -> None:
        """Close the HTTP session; later calls fail instead of opening a new one."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
