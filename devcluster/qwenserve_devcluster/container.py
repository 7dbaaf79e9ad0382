"""A pod's container as this machine runs it: argv, environment and the /dev/shm mount, from the container's
spec with its ConfigMaps, Secrets and volumes resolved.

Where a container path does not exist on this machine, it is mapped rather than mounted (no mount
namespace tricks beyond /dev/shm): an argument or variable naming a volume's mount path, or a path
the image would hold (`HostPaths.image`, the model), is rewritten to the host folder that stands in
for it. /dev/shm is really mounted, so POSIX shared memory works: a private tmpfs for an emptyDir,
one folder shared by every pod of this node for a hostPath /dev/shm (the `shm` KV transfer mode).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenserve_devcluster.api import ApiClient
from qwenserve_devcluster.pod import Pod, PodConfigError

CONFIGMAPS, SECRETS = "v1/configmaps", "v1/secrets"
NODE_NAME = "dev-cluster-node"
ENTRYPOINT = ["qwen-serve"]  # the image's entrypoint: run as this repository's CLI with this Python
SHM = "/dev/shm"


@dataclass
class HostPaths:
    """What stands in, on this machine, for what the image and the cluster's storage would hold."""

    state_dir: Path  # pods' folders and logs
    image: dict[str, str] = field(default_factory=dict)  # a path inside the image -> a host path
    claims: dict[str, str] = field(default_factory=dict)  # a PersistentVolumeClaim's name -> a host folder
    env: dict[str, str] = field(default_factory=dict)  # added to every pod's environment

    @property
    def node_shm(self) -> Path:
        """The folder every pod of this node sees as a hostPath /dev/shm."""
        return self.state_dir / "node-shm"


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable is replaced, $$(VAR) stays literal."""
    return re.sub(r"\$(\$)?\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: m.group(0)[1:] if m.group(1) else env.get(m.group(2), m.group(0)), value)


def translate(value: str, paths: dict[str, str]) -> str:
    """Rewrite a container path (or `--flag=path`) that starts with a mapped folder to its host folder."""
    prefix, _, rest = value.partition("=") if value.startswith("-") and "=" in value else ("", "", value)
    for container_path in sorted(paths, key=len, reverse=True):
        if rest == container_path or rest.startswith(container_path.rstrip("/") + "/"):
            rest = paths[container_path] + rest[len(container_path):]
            break
    return f"{prefix}={rest}" if prefix else rest


class ContainerSetup:
    """Resolves pods' containers against the API's ConfigMaps and Secrets and this machine's folders."""

    def __init__(self, api: ApiClient, host: HostPaths, gateway: str) -> None:
        self.api = api
        self.host = host
        self.gateway = gateway  # the node's address, the pods' status.hostIP

    async def resolve(self, pod: Pod) -> tuple[list[str], dict[str, str], list[str]]:
        """argv, environment and the /dev/shm mount command of the pod's container."""
        container, spec = pod.container, pod.template["spec"]
        paths = dict(self.host.image)
        shm_mount = ["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", SHM]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"])
            if volume is None:
                raise PodConfigError(f"pod {pod.name}: volumeMount {mount['name']!r} names no volume")
            if mount["mountPath"] == SHM:
                if "hostPath" in volume:  # the node's /dev/shm: one folder every pod of this node shares
                    shm_mount = ["mount", "--bind", str(self.host.node_shm), SHM]
                continue
            source = await self._volume_dir(pod, volume)
            paths[mount["mountPath"]] = str(source / mount["subPath"]) if mount.get("subPath") else str(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **self.host.env}
        for source in container.get("envFrom", []):
            data = await self._config_data(pod, source, optional=source.get(next(iter(source)), {}).get("optional"))
            env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for var in container.get("env", []):
            value = expand(var["value"], env) if "value" in var else await self._env_from(pod, var)
            if value is not None:
                env[var["name"]] = translate(value, paths)
        command = container.get("command") or ENTRYPOINT
        args = [translate(expand(a, env), paths) for a in container.get("args", [])]
        if command == ENTRYPOINT:  # the image's entrypoint is this host's qwen-serve: a host path, never a volume's
            return [sys.executable, "-m", "qwenserve.cli", *args], env, shm_mount
        return [translate(expand(a, env), paths) for a in command] + args, env, shm_mount

    async def _env_from(self, pod: Pod, var: dict[str, Any]) -> str | None:
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            fields = {"metadata.name": pod.name, "metadata.namespace": pod.namespace,
                      "status.podIP": pod.iface.ip, "status.hostIP": self.gateway,
                      "spec.nodeName": NODE_NAME, "spec.serviceAccountName": "default"}
            path = source["fieldRef"]["fieldPath"]
            if path not in fields:
                raise PodConfigError(f"pod {pod.name}: env {var['name']}: unsupported fieldRef {path}")
            return fields[path]
        for kind in ("configMapKeyRef", "secretKeyRef"):
            if kind in source:
                ref = source[kind]
                data = await self._config_data(pod, {kind.replace("KeyRef", "Ref"): ref}, ref.get("optional"))
                if ref["key"] not in data and not ref.get("optional"):
                    raise PodConfigError(f"pod {pod.name}: env {var['name']}: no key {ref['key']!r} in {ref['name']}")
                return data.get(ref["key"])
        raise PodConfigError(f"pod {pod.name}: env {var['name']}: unsupported valueFrom {sorted(source)}")

    async def _config_data(self, pod: Pod, source: dict[str, Any], optional: bool | None) -> dict[str, str]:
        """The data of a {configMapRef: {name}} or {secretRef: {name}} (Secrets decoded)."""
        is_secret = "secretRef" in source
        name = (source.get("secretRef") or source.get("configMapRef") or {})["name"]
        obj = await self.api.get(SECRETS if is_secret else CONFIGMAPS, pod.namespace, name)
        if obj is None:
            if optional:
                return {}
            raise PodConfigError(f"pod {pod.name}: {'Secret' if is_secret else 'ConfigMap'} {name!r} not found")
        data = dict(obj.get("data") or {})
        if is_secret:
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update(obj.get("stringData") or {})
        return data

    async def _volume_dir(self, pod: Pod, volume: dict[str, Any]) -> Path:
        """The host folder that stands in for a volume."""
        target = pod.dir / "volumes" / volume["name"]
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            return target
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in self.host.claims:
                raise PodConfigError(f"pod {pod.name}: no host folder given for PersistentVolumeClaim {claim!r}")
            return Path(self.host.claims[claim])
        for kind, ref in (("configMap", "configMapRef"), ("secret", "secretRef")):
            if kind in volume:
                spec = volume[kind]
                name = spec.get("name") or spec.get("secretName")
                data = await self._config_data(pod, {ref: {"name": name}}, spec.get("optional"))
                items = spec.get("items") or [{"key": k, "path": k} for k in data]
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir(parents=True)
                for item in items:
                    if item["key"] in data:
                        (target / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                        (target / item["path"]).write_text(data[item["key"]])
                return target
        raise PodConfigError(f"pod {pod.name}: unsupported volume {volume['name']!r} ({sorted(volume)})")
