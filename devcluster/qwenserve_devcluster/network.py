"""Pod networking: a Linux bridge, one network namespace and veth pair per pod, and leftovers' cleanup.

Every name made here starts with the prefix (`qs-` by default), so whatever a crashed run left behind
is found and removed by name at the next start. A pod's namespace has its loopback and `eth0` on the
bridge's subnet and no default route: its traffic reaches the other pods and the host's bridge
address (where the DNS server listens), nothing else.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "qs-"
SUBNET = "10.213.0.0/24"
NETNS_DIR = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/resolv.conf


class NetworkError(RuntimeError):
    """An `ip` command failed; the message has the command and its error."""


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS...`, returning stdout; raises NetworkError with stderr when it fails and `check`."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class PodInterface:
    """One pod's network: its namespace, its address and the host end of its veth pair."""

    netns: str
    ip: str
    host_veth: str


class PodNetwork:
    """The bridge and the pods' namespaces; `close()` removes everything it made."""

    def __init__(self, prefix: str = PREFIX, subnet: str = SUBNET) -> None:
        self.prefix = prefix
        self.subnet = ipaddress.ip_network(subnet)
        hosts = list(self.subnet.hosts())
        self.gateway = str(hosts[0])  # the host's address on the bridge: DNS, probes, the user's requests
        self.bridge = f"{prefix}br0"
        self._free = [str(h) for h in hosts[1:]]
        self._next_veth = 0
        self.pods: dict[str, PodInterface] = {}

    def open(self) -> None:
        """Create the bridge with the gateway address."""
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def add_pod(self, pod: str, resolv_conf: str) -> PodInterface:
        """A namespace for `pod` with an address of its own and `resolv_conf` as its /etc/resolv.conf."""
        if not self._free:
            raise NetworkError(f"no free address left in {self.subnet}")
        address = self._free.pop(0)
        netns = f"{self.prefix}{pod}"
        self._next_veth += 1
        host_veth, pod_veth = f"{self.prefix}v{self._next_veth}", f"{self.prefix}p{self._next_veth}"
        iface = PodInterface(netns=netns, ip=address, host_veth=host_veth)
        self.pods[pod] = iface
        etc = NETNS_ETC / netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(resolv_conf)
        ip("netns", "add", netns)
        ip("link", "add", host_veth, "type", "veth", "peer", "name", pod_veth)
        ip("link", "set", pod_veth, "netns", netns)
        ip("link", "set", host_veth, "master", self.bridge)
        ip("link", "set", host_veth, "up")
        ip("-n", netns, "link", "set", pod_veth, "name", "eth0")
        ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "link", "set", "lo", "up")
        return iface

    def remove_pod(self, pod: str) -> None:
        """Kill whatever still runs in the pod's namespace, then remove the namespace and its veth."""
        iface = self.pods.pop(pod, None)
        if iface is None:
            return
        _remove_netns(iface.netns)
        ip("link", "del", iface.host_veth, check=False)  # gone with its peer's namespace already
        self._free.append(iface.ip)

    def close(self) -> None:
        """Remove every pod's namespace and the bridge."""
        for pod in list(self.pods):
            self.remove_pod(pod)
        ip("link", "del", self.bridge, check=False)


def _remove_netns(netns: str) -> None:
    for pid in ip("netns", "pids", netns, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    ip("netns", "del", netns, check=False)
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces, links and /etc/netns folders whose names start with `prefix` (what a run made)."""
    found = [f"netns {name}" for name in _netns_names() if name.startswith(prefix)]
    found += [f"link {name}" for name in _link_names() if name.startswith(prefix)]
    if NETNS_ETC.is_dir():
        found += [f"dir {p}" for p in NETNS_ETC.iterdir() if p.name.startswith(prefix)]
    return found


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Remove what an earlier run with `prefix` left behind (it crashed); returns what was removed."""
    removed = leftovers(prefix)
    for name in _netns_names():
        if name.startswith(prefix):
            _remove_netns(name)
    for name in _link_names():
        if name.startswith(prefix):
            ip("link", "del", name, check=False)
    if NETNS_ETC.is_dir():
        for path in NETNS_ETC.iterdir():
            if path.name.startswith(prefix):
                shutil.rmtree(path, ignore_errors=True)
    return removed


def _netns_names() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list", check=False).splitlines() if line.strip()]


def _link_names() -> list[str]:
    # `ip -o link` lines look like "7: qs-v1@if6: <...>"; the part after @ is the peer's index.
    return [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").splitlines()
            if line.count(":") >= 2]
