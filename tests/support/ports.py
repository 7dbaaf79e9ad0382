"""Loopback ports for servers the tests start."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the server that gets it binds it moments later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
