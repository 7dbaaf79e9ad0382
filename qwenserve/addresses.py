"""Host and endpoint strings: what a server binds to versus what another process can dial.

Torch-free and gRPC-free, so the stages' light config modules can use it.
"""

from __future__ import annotations

import ipaddress


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
