"""Fixtures for the KV handoff tests: a small layout, exporters on private segment prefixes,
a real grpc.aio KVTransfer server, and leak checks on /dev/shm after every test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest
import torch

from qwenserve.kv_transfer import (
    ExporterConfig,
    ImporterConfig,
    KVExporter,
    KVImporter,
    KVLayout,
    KVTransport,
    add_kv_transfer_service,
    leaked_segments,
)
from tests.support.processes import SessionProcesses

TEST_PREFIX = "qwenserve-kvtest"
MiB = 1 << 20


@pytest.fixture(scope="session", autouse=True)
def no_segment_left_after_the_suite(session_processes: SessionProcesses) -> Iterator[None]:
    """No segment that this session's processes made, under any test prefix or the default, outlives it."""
    before = session_processes.segments()
    yield
    assert session_processes.segments() - before == set()


@pytest.fixture
def segment_prefix() -> Iterator[str]:
    """A prefix of this test's own; the test fails if any segment under it outlives it."""
    prefix = f"{TEST_PREFIX}-{uuid.uuid4().hex[:8]}"
    yield prefix
    assert leaked_segments(prefix) == [], "a shared-memory segment leaked"


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(
        dtype="float16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8, model_fingerprint="fp-test"
    )


@pytest.fixture
def make_kv() -> Callable[..., torch.Tensor]:
    """Deterministic random KV of a layout: make_kv(layout, num_tokens, seed=0)."""

    def make(layout: KVLayout, num_tokens: int, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(layout.token_shape(num_tokens), generator=generator).to(layout.torch_dtype())

    return make


@pytest.fixture
def make_exporter(segment_prefix: str) -> Iterator[Callable[..., KVExporter]]:
    """Build started exporters (1 MiB pool, fast sweeper) that are closed after the test."""
    exporters: list[KVExporter] = []

    def make(**overrides: object) -> KVExporter:
        config = ExporterConfig(
            pool_bytes=MiB, max_bytes=64 * MiB, segment_prefix=segment_prefix, sweep_interval_s=0.02
        )
        for key, value in overrides.items():
            setattr(config, key, value)
        exporter = KVExporter(config).start()
        exporters.append(exporter)
        return exporter

    yield make
    for exporter in exporters:
        exporter.close()


@pytest.fixture
async def importer() -> AsyncIterator[KVImporter]:
    imp = KVImporter(ImporterConfig(release_timeout_s=1.0))
    yield imp
    await imp.close()


@pytest.fixture
async def grpc_exporter(make_exporter: Callable[..., KVExporter]) -> AsyncIterator[Callable[..., KVExporter]]:
    """Start exporters behind a real in-process grpc.aio KVTransfer server on loopback."""
    servers: list[grpc.aio.Server] = []

    async def start(transport: int = KVTransport.KV_TRANSPORT_GRPC, **overrides: object) -> KVExporter:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        exporter = make_exporter(
            transport=transport,
            control_endpoint=f"127.0.0.1:{port}",
            use_shm=transport == KVTransport.KV_TRANSPORT_SHM,
            **overrides,
        )
        add_kv_transfer_service(server, exporter)
        await server.start()
        servers.append(server)
        return exporter

    yield start
    for server in servers:
        await server.stop(grace=None)
