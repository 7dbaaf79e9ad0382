"""Each stage's configuration is parsed once into one value and checked once: `qwen-serve serve STAGE` hands
the checked config to the server; `qwen-serve up` parses each child's command line with the environment the child
will get, passed as a value, never by changing its own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwenserve import cli, up
from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.launcher import SHARED_CORES_SPINCOUNT, LocalCluster
from qwenserve.stages import tokenizer as tokenizer_stage
from qwenserve.telemetry import logs


class ReadOnlyEnviron(dict[str, str]):
    """os.environ that refuses every change: the code under test may read its environment, never write it
    (pytest's own PYTEST_CURRENT_TEST aside)."""

    PYTEST = "PYTEST_CURRENT_TEST"

    def __setitem__(self, key: str, value: str) -> None:
        if key != self.PYTEST:
            raise AssertionError(f"os.environ[{key!r}] was set")
        super().__setitem__(key, value)

    def pop(self, key: str, *default: Any) -> Any:
        if key != self.PYTEST:
            raise AssertionError(f"os.environ[{key!r}] was removed")
        return super().pop(key, *default)

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("os.environ was changed")

    update = clear = popitem = setdefault = _refuse  # type: ignore[assignment]


@pytest.fixture
def read_only_environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadOnlyEnviron]:
    environ = ReadOnlyEnviron({k: v for k, v in os.environ.items() if not k.startswith("QWENSERVE_")})
    monkeypatch.setattr(os, "environ", environ)
    yield environ


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("models") / "once-tiny", TINY_CONFIG, seed=3)


def test_serve_parses_and_checks_once_and_starts_the_server_with_the_checked_config(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    from qwenserve_services.tokenizer import server

    calls: dict[str, int] = {"parse": 0, "check": 0}
    started: list[Any] = []
    parse, check = tokenizer_stage.parse_config, tokenizer_stage.check

    def counting_parse(*args: Any, **kwargs: Any) -> Any:
        calls["parse"] += 1
        return parse(*args, **kwargs)

    def counting_check(config: Any) -> Any:
        calls["check"] += 1
        return check(config)

    monkeypatch.setattr(tokenizer_stage, "parse_config", counting_parse)
    monkeypatch.setattr(tokenizer_stage, "check", counting_check)
    monkeypatch.setattr(server, "start", lambda config: started.append(config) or 0)
    monkeypatch.setattr(cli.supervision, "apply", lambda: None)

    assert cli.main(["serve", "tokenizer", str(tiny_model), "--port", "0", "--workers", "3"]) == 0
    assert calls == {"parse": 1, "check": 1}
    [config] = started
    assert config.model == str(tiny_model) and config.workers == 3


def test_serve_refuses_a_failed_check_in_one_line_without_importing_the_server(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli.supervision, "apply", lambda: None)
    monkeypatch.setattr(cli, "_call", lambda *args: pytest.fail("the server was started"))
    # As in a fresh process: an earlier test in this one may have set up logging onto its own captured stderr.
    monkeypatch.setattr(logs, "_console_handlers", [])
    assert cli.main(["serve", "tokenizer", str(tmp_path / "missing"), "--port", "0"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "tokenizer: cannot start" in line


def test_a_stage_parser_reads_the_environment_it_is_given(read_only_environ: ReadOnlyEnviron) -> None:
    dict.__setitem__(read_only_environ, "QWENSERVE_WORKERS", "3")  # this process's: not the one asked about
    assert tokenizer_stage.parse_config([], environ={"QWENSERVE_WORKERS": "7"}).workers == 7
    assert tokenizer_stage.parse_config([], environ={}).workers == tokenizer_stage.TokenizerServiceConfig().workers
    assert tokenizer_stage.parse_config([]).workers == 3


def test_up_parses_each_child_with_its_environment_without_changing_its_own(
        read_only_environ: ReadOnlyEnviron, tiny_model: Path) -> None:
    cluster = LocalCluster(model=tiny_model, prefill=1, decode=2, env={"QWENSERVE_WORKERS": "5"},
                           stage_values={"api_key": "sk-test-secret"})
    cluster.plan()
    router = cluster.child("router")
    assert router.env and not any("sk-test-secret" in arg for arg in router.argv)  # the secret is no argument
    configs = up._child_configs(cluster)
    assert [(name, stage) for name, stage, _ in configs] == [
        ("tokenizer", "tokenizer"), ("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"),
        ("router", "router")]
    by_name = {name: config for name, _, config in configs}
    assert by_name["tokenizer"].workers == 5  # the cluster's environment, as the child gets it
    assert by_name["router"].front.api_key == "sk-test-secret"  # from the router child's own variables
    assert by_name["decode-1"].port != by_name["decode-0"].port
    assert "QWENSERVE_WORKERS" not in os.environ


def test_up_gives_its_engines_short_openmp_spins_unless_the_user_set_how_threads_wait(
        read_only_environ: ReadOnlyEnviron, tiny_model: Path) -> None:
    # On shared cores an idle engine's spinning OpenMP threads hold the cores the other engine needs (launcher.py).
    cluster = LocalCluster(model=tiny_model, prefill=1, decode=1)
    cluster.plan()
    spins = {c.name: cluster.child_environment(c).get("GOMP_SPINCOUNT") for c in cluster.children}
    assert spins == {"tokenizer": None, "prefill-0": SHARED_CORES_SPINCOUNT, "decode-0": SHARED_CORES_SPINCOUNT,
                     "router": None}
    for given in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}):
        cluster = LocalCluster(model=tiny_model, prefill=1, decode=1, env=given)
        cluster.plan()
        env = cluster.child_environment(cluster.child("decode-0"))
        assert {k: env.get(k) for k in given} == given and ("GOMP_SPINCOUNT" in env) == ("GOMP_SPINCOUNT" in given)
