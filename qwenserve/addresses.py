"""Host and endpoint strings: what a server binds to versus what another process can dial.

Torch-free and gRPC-free, so the stages' light config modules can use it.
"""

from __future__ import annotations

import ipaddress
import socket

from qwenserve.preflight import StartupError


def is_wildcard_host(host: str) -> bool:
    """True for an address one binds to but nobody can dial (0.0.0.0, ::, or no host at all)."""
    host = host.strip().strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a name


def endpoint_of(host: str, port: int) -> str:
    """`host:port`, with an IPv6 address in brackets."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def endpoint_host(endpoint: str) -> str:
    """The host part of `host:port` or `[ipv6]:port`."""
    return endpoint.rpartition(":")[0].strip("[]")


def advertise_host(host: str, advertise: str = "") -> str:
    """The address a worker hands out for others to dial: `advertise` (its --advertise-host), else `host` (its
    --host) unless that is a wildcard, else the address of this host's default route. Raises StartupError when
    none is known."""
    if advertise:
        return advertise
    if not is_wildcard_host(host):
        return host
    primary = primary_address(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if primary is None:
        raise StartupError(f"--host {host} is a wildcard address and this host has no default route to take its "
                           "address from; set --advertise-host (QWENSERVE_ADVERTISE_HOST) to the address other "
                           "workers dial this one at (a pod: its status.podIP)")
    return primary


def primary_address(family: int = socket.AF_INET) -> str | None:
    """The local address of the default route (a UDP socket's connect sends nothing), or None without one."""
    probe = ("192.0.2.1", 9) if family == socket.AF_INET else ("2001:db8::1", 9)  # documentation addresses
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(probe)
            address: str = s.getsockname()[0]
    except OSError:
        return None
    return None if is_wildcard_host(address) else address
