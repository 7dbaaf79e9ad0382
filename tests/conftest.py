"""Fixtures every test folder may use: the processes this test session started (whose shared-memory segments
the leak checks count; tests/support/processes.py says why), the tiny checkpoint most tests serve, and the traced
cluster of the observability and load-generator tests; and the markers and xdist groups of every test."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from qwenserve.launcher import LocalCluster
from tests.support.checkpoints import tiny_checkpoint
from tests.support.clusters import make_cluster
from tests.support.processes import SessionProcesses
from tests.support.spans import SpanReceiver


@pytest.fixture(scope="session")
def session_processes() -> Iterator[SessionProcesses]:
    watcher = SessionProcesses().start()
    yield watcher
    watcher.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 (tests/support/checkpoints.py), written once per session."""
    return tiny_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-tiny")


@pytest.fixture(scope="session")
def span_receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SpanReceiver, int]]:
    """An OTLP/gRPC collector in its own process, and the port it listens on."""
    path = tmp_path_factory.mktemp("otlp") / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.otlp_receiver", str(path)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield SpanReceiver(path), port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def traced_cluster(tiny_model: Path, span_receiver: tuple[SpanReceiver, int],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One tokenizer, prefill, decode and router on the tiny model; every service exports spans over OTLP to the
    receiver. Shared by the observability and load-generator tests (in one xdist group), whose checks read
    counters as deltas and spans by request id, so they need no cluster of their own."""
    _, port = span_receiver
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "QWENSERVE_DTYPE": "auto",  # the default path (make_cluster's is fp32): status shows what it chose
    }
    with make_cluster(tiny_model, tmp_path_factory.mktemp("traced"), prefill=1, decode=1, env=env) as cluster:
        yield cluster


# -- markers and xdist groups, by where a test lives ----------------------------------------------------------

# Tests that start processes (stage clusters, dev clusters, `qwen-serve` runs, exporters, Redis) are marked
# `cluster`; `pytest -m "not cluster and not slow"` is the unit tier (`make check`). Paths are relative to
# tests/; one ending in "/" stands for every module under it.
CLUSTER_TESTS = (
    "chaos/", "devcluster/", "e2e/", "fuzz/", "observability/",
    "http/test_billing.py", "http/test_generation_defaults.py", "http/test_openai_cluster.py",
    "http/test_reasoning_and_tools.py", "http/test_router_privacy.py", "http/test_router_redis_outage.py",
    "http/test_streams_and_limits.py", "http/test_structured_output.py", "http/test_tls.py",
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
# Tests that need the machine to themselves: many processes of real size, or latencies under injected faults.
# `make test` runs them after the rest, one at a time (scripts/test.sh): beside three other workers on two cores
# they took 2-5x their time alone (the realistic-size fp32 test 241-625 s against 49 s) and failed on timing.
EXCLUSIVE_TESTS = (
    "chaos/", "devcluster/test_dev_cluster.py", "devcluster/test_autoscaling.py",
    "devcluster/test_scaled_cluster.py", "e2e/test_realistic_sizes.py",
)
# With pytest-xdist (scripts/test.sh: `-n 3 --dist loadgroup`) a module's tests stay on one worker, so a
# module-scoped cluster starts once. These share a worker wider than a module: one dev cluster runs on a
# machine at a time (its lock and network namespaces); a package- or session-scoped cluster, and a session's
# whole-vocabulary tokenizers, would otherwise start once per worker that uses them.
SHARED_WORKER = {
    "devcluster/": "devcluster", "chaos/": "chaos", "fuzz/": "fuzz", "tokenizer/": "tokenizer",
    "http/test_billing.py": "http-cluster", "http/test_openai_cluster.py": "http-cluster",
    "http/test_router_privacy.py": "http-cluster",
    "observability/test_service_telemetry.py": "traced-cluster", "loadgen/test_cluster.py": "traced-cluster",
}


# The groups that take longest, longest first (minutes of a 2-core machine). xdist hands groups out in the order
# the tests were collected; these go first, then every other group that starts processes, then the slow unit
# tests, then the rest, so the run ends on short groups instead of one worker finishing a long one alone.
# (xdist's own reordering sorts by test count, which put these few long tests last.)
LONGEST_GROUPS = ("chaos", "devcluster", "fuzz", "e2e/test_realistic_sizes.py", "e2e/test_failover.py",
                  "e2e/test_router_faults.py", "http-cluster")


def _matches(path: str, patterns: Iterable[str]) -> str | None:
    return next((p for p in patterns if path == p or (p.endswith("/") and path.startswith(p))), None)


def worker_group(path: str) -> str:
    """The xdist group of the tests in `path` (relative to tests/): its shared group, or the module itself."""
    shared = _matches(path, SHARED_WORKER)
    return SHARED_WORKER[shared] if shared else path


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marks `cluster`, `slow` and `exclusive` tests by where they live."""
    path = item.path.relative_to(Path(__file__).parent).as_posix()
    if _matches(path, CLUSTER_TESTS):
        item.add_marker(pytest.mark.cluster)
    if _matches(path, SLOW_TESTS):
        item.add_marker(pytest.mark.slow)
    if _matches(path, EXCLUSIVE_TESTS):
        item.add_marker(pytest.mark.exclusive)


def _start_rank(item: pytest.Item) -> tuple[int, int]:
    group = worker_group(item.path.relative_to(Path(__file__).parent).as_posix())
    if group in LONGEST_GROUPS:
        return (0, LONGEST_GROUPS.index(group))
    if item.get_closest_marker("cluster"):
        return (1, 0)
    return (2, 0) if item.get_closest_marker("slow") else (3, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest groups first (LONGEST_GROUPS); a module's tests keep their order and stay together."""
    items.sort(key=_start_rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadgroup` with the groups above. (xdist's own loadgroup reads `xdist_group` markers into the
    node ids, which pytest 9 no longer lets a plugin rewrite, so every test became a group of its own.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid.split("::")[0].removeprefix("tests/"))

    config.option.loadscopereorder = False  # keep pytest_collection_modifyitems' order
    return GroupScheduling(config, log)  # type: ignore[arg-type]
