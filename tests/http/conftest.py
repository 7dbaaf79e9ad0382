"""Fixtures for the router's front door: certificates, a real redis-server, a running LocalCluster."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from qwenserve.launcher import LocalCluster
from tests.support.ports import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"

# Tenants of the cluster tests; each limited test has its own tenant, so tests never share a window.
API_KEYS = {
    "sk-acme": "acme",
    "sk-tight": "tight",
    "sk-refund": "refund",
    "sk-capped": "capped",
    "sk-flags": "flags",
    "sk-billed": "billed",
    "sk-ops": "ops",
}
TENANT_LIMITS = {
    "acme": {},
    "tight": {"tokens_per_minute": 100},
    "refund": {"tokens_per_minute": 300},
    "capped": {"max_tokens": 8},
    "flags": {"tokens_per_minute": 1000},
    "billed": {},
    "ops": {"admin": True},  # sees the workers' addresses in GetStatus
}


# -- certificates ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate, all PEM."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True)


def _signed(name: str, cn: str, ext: str, folder: Path) -> None:
    (folder / f"{name}.ext").write_text(ext)
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={cn}", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=folder)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """Made with the openssl command line, fresh for each session."""
    folder = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=qwen-serve test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=folder)
    _signed("server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n", folder)
    _signed("client", "test-client", "extendedKeyUsage=clientAuth\n", folder)
    return Certs(folder / "ca.pem", folder / "server.pem", folder / "server.key",
                 folder / "client.pem", folder / "client.key")


# -- redis -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free port, for the whole session."""
    workdir = tmp_path_factory.mktemp("redis-http")
    port = free_port()
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.2, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        process.kill()
        process.wait(timeout=10)


# -- the cluster -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The limiter engineer's key-file format (qwenserve.tenancy.keys)."""
    path = tmp_path_factory.mktemp("keys") / "api-keys.json"
    path.write_text(json.dumps({
        "tenants": TENANT_LIMITS,
        "keys": [{"tenant": tenant, "key": key} for key, tenant in API_KEYS.items()],
    }))
    return path


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_url: str, key_file: Path) -> Iterator[LocalCluster]:
    """The four stages on loopback with the default tiny model, API keys and a Redis-backed limiter."""
    from qwenserve.default_model import ensure_default_model

    logs = tmp_path_factory.mktemp("cluster-logs")
    env = {
        "QWENSERVE_API_KEYS_FILE": str(key_file),
        "QWENSERVE_REDIS_URL": redis_url,
        "QWENSERVE_RATELIMIT_FAILURE_MODE": "closed",
        # fp32: answers are compared token for token and logprob for logprob across requests whose batches differ
        # (under --dtype auto a step's row count picks the bf16 product it runs).
        "QWENSERVE_DTYPE": "float32",
    }
    with LocalCluster(model=ensure_default_model(), env=env, log_dir=logs) as running:
        _wait_for_http(running.http_port, logs)
        yield running


def _wait_for_http(port: int, logs: Path, timeout_s: float = 20.0) -> None:
    """The router's health check covers gRPC only; the HTTP front must answer too."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"the router serves no HTTP on port {port} (services/qwenserve_services/router/server.py must start "
                            f"qwenserve.router.front_door.start_http_front); logs in {logs}")
            time.sleep(0.2)


@pytest.fixture(scope="session")
def base_url(cluster: LocalCluster) -> str:
    return f"http://127.0.0.1:{cluster.http_port}/v1"
