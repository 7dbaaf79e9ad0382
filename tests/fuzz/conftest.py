"""One real cluster for the fuzz suite, one client per module for all its examples.

The cluster is small (tokenizer, one prefill, one decode, router; one thread each), needs an API key,
and its KV pool holds fewer tokens than the model's context. Before each test it is brought back to
life if an earlier test broke it.

CI runs a fixed, derandomized set of examples (the whole suite in about two minutes). For a longer
hand run, QWENSERVE_FUZZ_EXAMPLES sets the examples of every property and draws fresh ones each run
(QWENSERVE_FUZZ_SHRINK=1 also shrinks a failure to a minimal example, at some minutes' cost):

    QWENSERVE_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/fuzz -p no:cacheprovider
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.launcher import LocalCluster
from tests.fuzz.client import BLOCK_SIZE, KV_BYTES_PER_TOKEN, FuzzClient
from tests.fuzz.strategies import API_KEY, CONTEXT, MODEL_NAME, POOL_TOKENS
from tests.support.checkpoints import tiny_checkpoint
from tests.support.deployment import Deployment


@pytest.fixture(scope="session")
def fuzz_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("fuzz-model") / MODEL_NAME, max_position_embeddings=CONTEXT)


# One cluster for both modules: each test starts on a cluster brought back to serving (`serving` below).
@pytest.fixture(scope="package")
def deployment(fuzz_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Tokenizer, one prefill, one decode and the router, with an API key and a KV pool of POOL_TOKENS."""
    env = {
        "QWENSERVE_THREADS": "1",
        "QWENSERVE_KV_CACHE_GB": repr(POOL_TOKENS * KV_BYTES_PER_TOKEN / 2**30),  # exact: a power of two
        "QWENSERVE_KV_POOL_MIB": "16",
        "QWENSERVE_DTYPE": "float32",  # KV_BYTES_PER_TOKEN is fp32's
        "QWENSERVE_API_KEYS": f"{API_KEY}:fuzz",
    }
    cluster = LocalCluster(model=fuzz_model, env=env, log_dir=tmp_path_factory.mktemp("fuzz-logs"))
    with cluster:
        running = Deployment(cluster, MODEL_NAME, API_KEY)
        _check_pool(running)
        yield running


def _check_pool(deployment: Deployment) -> None:
    """The strategies' POOL_TOKENS must be the pool the engines really have."""
    deadline = time.monotonic() + 10
    while (blocks := deployment.samples("decode-0").get("qwenserve_kv_blocks_total", 0)) == 0:
        assert time.monotonic() < deadline, "decode-0 never published qwenserve_kv_blocks_total"
        time.sleep(0.2)
    assert blocks * BLOCK_SIZE == POOL_TOKENS, f"decode's pool has {blocks} blocks, not {POOL_TOKENS} tokens"


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> Iterator[FuzzClient]:
    fuzz_client = FuzzClient(deployment)
    yield fuzz_client
    fuzz_client.close()


@pytest.fixture(autouse=True)
def serving(deployment: Deployment) -> Deployment:
    """Each test starts on a cluster that serves, whatever the previous one did to it."""
    deployment.ensure_serving()
    return deployment
