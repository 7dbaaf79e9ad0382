"""Per-pod discovery: a worker address that is a DNS name stands for every pod behind it.

In a cluster each stage is a headless Service whose name resolves to the IP of every ready pod. The
router resolves each such name (all A/AAAA records) when it starts and again every `interval_s`, and
keeps one worker, with its own channel, per pod address `ip:port`; so least outstanding work, prefix
affinity and failover choose among pods rather than gRPC's pick_first choosing one for all calls.
Literal `ip:port` entries are pods already and are never resolved.

`diff()` is the decision (which pods came, which went); `PodDiscovery` is the loop that resolves and
reports each change to a callback. A name the DNS says does not exist (NXDOMAIN, no records: a headless
Service with no ready pod) has no pods; a name that cannot be resolved for another reason (timeout,
SERVFAIL) keeps the pods it had: a DNS outage must not empty a stage that still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

# (host, port) -> the IP addresses the host stands for.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
# How long one resolution may take before the name keeps its pods until the next round.
RESOLVE_TIMEOUT_S = 10.0
DNS_SCHEME = "dns:///"
# getaddrinfo's answers that the name has no address at all (rather than that none could be had now).
NO_SUCH_NAME = {socket.EAI_NONAME, *([socket.EAI_NODATA] if hasattr(socket, "EAI_NODATA") else [])}


@dataclass(frozen=True, slots=True)
class Target:
    """One entry of a stage's address list: a literal pod address, or a name to resolve."""

    entry: str  # as given
    host: str
    port: int

    @property
    def literal(self) -> bool:
        return _is_ip(self.host)


@dataclass(frozen=True, slots=True)
class Change:
    """What a new resolution changed: pod addresses that appeared and ones that went."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


def parse_target(entry: str) -> Target:
    """`host:port`, `[v6]:port` or `dns:///host:port`; ValueError with the entry otherwise."""
    rest = entry[len(DNS_SCHEME):] if entry.startswith(DNS_SCHEME) else entry
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address {entry!r} is not host:port (or dns:///host:port)")
    return Target(entry, host, int(port))


def pod_address(ip: str, port: int) -> str:
    """The gRPC target of one pod: `ip:port`, `[ip]:port` for IPv6."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def diff(old: Collection[str], new: Collection[str]) -> Change:
    """Pods in `new` but not `old` (added) and in `old` but not `new` (removed), each sorted."""
    return Change(tuple(sorted(set(new) - set(old))), tuple(sorted(set(old) - set(new))))


def pods_of(targets: Iterable[Target], resolved: Mapping[str, Sequence[str]]) -> list[str]:
    """Every pod address of a stage, in the order of its entries: literal entries as they are, names as the IPs
    `resolved` maps them to."""
    pods: dict[str, None] = {}  # ordered, without repeats
    for target in targets:
        ips = [target.host] if target.literal else resolved.get(target.entry, ())
        pods.update(dict.fromkeys(pod_address(ip, target.port) for ip in ips))
    return list(pods)


def metrics_address(pod: str, entries: Sequence[str], metrics: Sequence[str]) -> str:
    """Where a pod's Prometheus endpoint is, given the stage's metrics addresses in the order of its worker
    entries: a literal entry's own metrics address; for a pod of a name, the pod's IP at the port of that
    name's metrics address (every pod of a Service listens on the same ports). "" when not known."""
    pairs = [(parse_target(e), parse_target(m)) for e, m in zip(entries, metrics, strict=False) if m]
    for target, at in pairs:
        if target.literal and pod_address(target.host, target.port) == pod:
            return at.entry
    host, _, port = pod.rpartition(":")
    for target, at in pairs:
        if not target.literal and str(target.port) == port:
            return pod_address(host.strip("[]"), at.port)
    return ""


async def system_resolver(host: str, port: int) -> list[str]:
    """All A and AAAA records of `host`, through the system resolver (getaddrinfo: /etc/hosts, cluster DNS)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class PodDiscovery:
    """Keeps each stage's pod addresses current; tells `on_change(stage, change)` whenever they change.

    `pods[stage]` starts with the literal entries, so the workers named by address exist before `refresh()`.
    """

    def __init__(
        self,
        stages: Mapping[str, Sequence[str]],
        on_change: Callable[[str, Change], None],
        resolver: Resolver = system_resolver,
        interval_s: float = 5.0,
    ) -> None:
        self.targets = {stage: [parse_target(e) for e in entries] for stage, entries in stages.items()}
        self.on_change = on_change
        self.resolver = resolver
        self.interval_s = interval_s
        self.pods = {stage: pods_of(targets, {}) for stage, targets in self.targets.items()}
        self._resolved: dict[str, list[str]] = {}  # name entry -> its IPs at the last good resolution
        self._failing: dict[str, str] = {}  # name entry -> why it last failed (logged once per failure)
        self._task: asyncio.Task[None] | None = None

    @property
    def has_names(self) -> bool:
        return any(not t.literal for targets in self.targets.values() for t in targets)

    async def refresh(self) -> None:
        """Resolve every name once and report each stage's change."""
        names = {t.entry: t for targets in self.targets.values() for t in targets if not t.literal}
        results = await asyncio.gather(*(self._resolve(t) for t in names.values()))
        for entry, ips in zip(names, results, strict=True):
            if ips is not None:
                self._resolved[entry] = ips
        for stage, targets in self.targets.items():
            new = pods_of(targets, self._resolved)
            change = diff(self.pods[stage], new)
            self.pods[stage] = new
            if change:
                log.info("%s pods: %s (added %s, removed %s)", stage, new, list(change.added),
                         list(change.removed))
                self.on_change(stage, change)

    async def _resolve(self, target: Target) -> list[str] | None:
        """The name's IPs, or None when it cannot be resolved now (it then keeps its pods)."""
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                ips = sorted(set(await self.resolver(target.host, target.port)))
        except socket.gaierror as e:
            if e.errno not in NO_SUCH_NAME:
                return self._failed(target, e)
            if self._resolved.get(target.entry):
                log.warning("%s has no addresses any more (%s): its pods drain", target.entry, e)
            ips = []
        except (OSError, TimeoutError) as e:
            return self._failed(target, e)
        self._failing.pop(target.entry, None)
        return ips

    def _failed(self, target: Target, error: Exception) -> None:
        """The name keeps its pods this round; said once per kind of failure."""
        why = str(error) or type(error).__name__
        if self._failing.get(target.entry) != why:
            log.warning("cannot resolve %s (%s); keeping its %d pods", target.entry, why,
                        len(self._resolved.get(target.entry, ())))
        self._failing[target.entry] = why

    def start(self) -> None:
        """Re-resolve every `interval_s` until close(); nothing to do when every entry is literal."""
        if self._task is None and self.has_names:
            self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # a bug in one round must not stop discovery for the router's lifetime
                log.exception("pod discovery round failed; trying again in %gs", self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
