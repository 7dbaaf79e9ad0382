"""Fixtures every test folder may use: the processes this test session started (whose shared-memory segments
the leak checks count; tests/support/processes.py says why), and the tiny checkpoint most tests serve."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from tests.support.checkpoints import tiny_checkpoint
from tests.support.processes import SessionProcesses


@pytest.fixture(scope="session")
def session_processes() -> Iterator[SessionProcesses]:
    watcher = SessionProcesses().start()
    yield watcher
    watcher.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 (tests/support/checkpoints.py), written once per session."""
    return tiny_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-tiny")


# -- markers and xdist groups, by where a test lives ----------------------------------------------------------

# Tests that start processes (stage clusters, dev clusters, `qwen-serve` runs, exporters, Redis) are marked
# `cluster`; `pytest -m "not cluster and not slow"` is the unit tier (`make check`). Paths are relative to
# tests/; one ending in "/" stands for every module under it.
CLUSTER_TESTS = (
    "chaos/", "devcluster/", "e2e/", "fuzz/", "observability/",
    "http/test_billing.py", "http/test_generation_defaults.py", "http/test_openai_cluster.py",
    "http/test_reasoning_and_tools.py", "http/test_router_redis_outage.py", "http/test_streams_and_limits.py",
    "http/test_structured_output.py", "http/test_tls.py",
    "kv_transfer/test_kv_cross_process.py", "loadgen/test_cluster.py", "loadgen/test_runner.py",
    "telemetry/test_vllm_metrics_cluster.py", "test_command_line.py", "test_presets.py", "test_progress.py",
    "test_stage_config_once.py", "test_startup_imports.py",
)
# Tests that start no process but take tens of seconds (reference models, whole vocabularies, kernel builds).
SLOW_TESTS = (
    "engine/test_cpu_kernels.py", "engine/test_engine_matches_transformers.py", "engine/test_engine_structured.py",
    "engine/test_grammar_limits.py", "engine/test_hybrid_models.py", "engine/test_linear_attention_gpu.py",
    "tokenizer/test_builtin_vocab.py",
)
# With pytest-xdist (`--dist loadgroup`, scripts/test.sh) a module's tests stay on one worker, so a
# module-scoped cluster starts once. These share a worker wider than a module: one dev cluster runs on a
# machine at a time (its lock and network namespaces); a package- or session-scoped cluster, and a session's
# whole-vocabulary tokenizers, would otherwise start once per worker that uses them.
SHARED_WORKER = {
    "devcluster/": "devcluster", "chaos/": "chaos", "fuzz/": "fuzz", "tokenizer/": "tokenizer",
    "http/test_billing.py": "http-cluster", "http/test_openai_cluster.py": "http-cluster",
}


def _matches(path: str, patterns: Iterable[str]) -> str | None:
    return next((p for p in patterns if path == p or (p.endswith("/") and path.startswith(p))), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks `cluster` and `slow` tests, and puts each test in its xdist group (its module's, or a shared one)."""
    root = Path(__file__).parent
    for item in items:
        path = item.path.relative_to(root).as_posix()
        if _matches(path, CLUSTER_TESTS):
            item.add_marker(pytest.mark.cluster)
        if _matches(path, SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
        shared = _matches(path, SHARED_WORKER)
        item.add_marker(pytest.mark.xdist_group(SHARED_WORKER[shared] if shared else path))
