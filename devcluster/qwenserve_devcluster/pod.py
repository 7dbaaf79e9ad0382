"""A pod of the dev cluster as the runner (pods.py), its container's setup (container.py) and its probes
(probes.py) all see it: one replica's identity, network, process and probe state."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qwenserve_devcluster.network import PodInterface


class PodConfigError(RuntimeError):
    """A pod cannot start as specified (a missing ConfigMap key, an unsupported probe or volume)."""


@dataclass
class Pod:
    """One replica: its identity, network, process and probe state."""

    name: str
    namespace: str
    deployment: str
    template_hash: str
    template: dict[str, Any]
    iface: PodInterface
    dir: Path
    created: float = field(default_factory=time.monotonic)
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    started: bool = False
    restarts: int = 0
    terminating: bool = False
    task: asyncio.Task[None] | None = None

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.template.get("metadata", {}).get("labels", {}))

    @property
    def container(self) -> dict[str, Any]:
        return self.template["spec"]["containers"][0]

    def port(self, name_or_number: int | str) -> int:
        """A container port by number or by name."""
        if isinstance(name_or_number, int) or str(name_or_number).isdigit():
            return int(name_or_number)
        for port in self.container.get("ports", []):
            if port.get("name") == name_or_number:
                return int(port["containerPort"])
        raise PodConfigError(f"pod {self.name}: no container port named {name_or_number!r}")
