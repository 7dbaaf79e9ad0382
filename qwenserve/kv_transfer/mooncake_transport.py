"""Mooncake Transfer Engine adapter: the importer reads the exporter's registered memory directly.

Mooncake runs over TCP here and over RDMA where the hardware exists. Sessions use its
peer-to-peer handshake ("P2PHANDSHAKE"), so no metadata server is needed: a handle's location
is the exporter's "host:rpc_port" and its offset the virtual address of the bytes there.
The package is optional (`mooncake-transfer-engine-non-cuda` on PyPI; it needs `libibverbs1`
even for TCP); without it this transport raises KVTransportUnavailable with the reason.
"""

from __future__ import annotations

import threading

import torch

from qwenserve.kv_transfer.errors import KVTransportUnavailable
from qwenserve.kv_transfer.pool import MemoryRegion

_P2P_HANDSHAKE = "P2PHANDSHAKE"


def mooncake_unavailable_reason() -> str | None:
    """None when Mooncake can be used in this process, else why not (for logs and test skips)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return (
            f"Mooncake Transfer Engine is not importable ({e}); install "
            "mooncake-transfer-engine-non-cuda (and libibverbs1 on Debian)"
        )
    return None


class MooncakeEndpoint:
    """One Transfer Engine instance: registers local memory and reads remote memory."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        reason = mooncake_unavailable_reason()
        if reason is not None:
            raise KVTransportUnavailable(reason)
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        rc = self._engine.initialize(host, _P2P_HANDSHAKE, protocol, device)
        if rc != 0:
            raise KVTransportUnavailable(
                f"Mooncake Transfer Engine failed to start on {host} over {protocol} (code {rc})"
            )
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        # Registration and transfers are not documented as thread-safe; serialise them.
        self._lock = threading.Lock()

    def register(self, region: MemoryRegion) -> None:
        """Make a region readable by remote engines."""
        with self._lock:
            rc = self._engine.register_memory(region.bytes.data_ptr(), region.size)
        if rc != 0:
            raise KVTransportUnavailable(f"Mooncake could not register {region.size} bytes (code {rc})")

    def unregister(self, region: MemoryRegion) -> None:
        with self._lock:
            self._engine.unregister_memory(region.bytes.data_ptr())

    def close(self) -> None:
        """Stop the Transfer Engine: its listening port and peer connections go with the last reference."""
        with self._lock:
            self._engine = None

    def read(self, session: str, remote_address: int, into: torch.Tensor) -> None:
        """Blocking read of `into.numel()` bytes at `remote_address` of `session` into a uint8 tensor."""
        length = into.numel()
        with self._lock:
            rc = self._engine.register_memory(into.data_ptr(), length)
            if rc != 0:
                raise KVTransportUnavailable(f"Mooncake could not register {length} bytes (code {rc})")
            try:
                rc = self._engine.transfer_sync_read(session, into.data_ptr(), remote_address, length)
            finally:
                self._engine.unregister_memory(into.data_ptr())
        if rc != 0:
            raise KVTransportUnavailable(
                f"Mooncake read of {length} bytes from {session} failed (code {rc}): the exporter "
                "may have exited"
            )
