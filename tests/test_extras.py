"""What a server install carries: the operator, the dev cluster and the load generator's plots are extras, and a
command whose extra is missing says so in one line."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from qwenserve.cli import COMMAND_EXTRAS, EXTRAS

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Distribution name -> the module it installs, where they differ.
MODULE_OF = {"pyyaml": "yaml"}


def _names(requirements: list[str]) -> list[str]:
    """Distribution names of requirement strings, lower case, versions and markers dropped."""
    return [re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in requirements]


def _extra_modules(extra: str) -> set[str]:
    """The modules `extra` installs, the extras it names (qwen-serve[...]) included."""
    modules: set[str] = set()
    for requirement in PROJECT["optional-dependencies"][extra]:
        if requirement.startswith("qwen-serve["):
            for inner in requirement[len("qwen-serve["):-1].split(","):
                modules |= _extra_modules(inner)
        else:
            name = _names([requirement])[0]
            modules.add(MODULE_OF.get(name, name))
    return modules


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_the_cli_knows_each_extras_modules_as_pyproject_lists_them(extra: str) -> None:
    assert set(EXTRAS[extra]) == _extra_modules(extra)


def test_a_server_install_carries_no_operator_dev_cluster_or_plotting_packages() -> None:
    core = set(_names(PROJECT["dependencies"]))
    assert not core & {"kopf", "kubernetes", "kmock", "dnslib", "matplotlib"}


def test_dev_installs_every_extra_but_the_gpu_kernels() -> None:
    dev = _extra_modules("dev")
    for extra in set(PROJECT["optional-dependencies"]) - {"dev", "gpu", "mooncake"}:
        assert _extra_modules(extra) <= dev, extra


def _run_cli_without(blocked: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """`qwen-serve ARGV` in a Python where `blocked` cannot be imported (as if its extra were not installed)."""
    code = (f"import sys; sys.modules[{blocked!r}] = None; from qwenserve.cli import main; "
            f"sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(("command", "blocked"), [("dev-cluster", "kmock"), ("dev-cluster", "kopf"),
                                                   ("operator", "kubernetes")])
def test_a_command_whose_extra_is_missing_names_it_in_one_line(command: str, blocked: str) -> None:
    extra = COMMAND_EXTRAS[command]
    run = _run_cli_without(blocked, command, "--help")
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.splitlines() == [
        f"qwen-serve {command} needs the '{extra}' extra ({blocked} not installed): "
        f"pip install 'qwen-serve[{extra}]'"]


def test_a_command_with_its_extra_installed_runs() -> None:
    run = _run_cli_without("matplotlib", "dev-cluster", "--help")
    assert run.returncode == 0, run.stderr
    assert "usage: qwen-serve dev-cluster" in run.stdout


async def test_bench_without_matplotlib_reports_and_names_the_extra_for_its_plots(tmp_path: Path, monkeypatch,
                                                                                  capsys) -> None:
    from qwenserve.loadgen.cli import BenchConfig, bench
    from qwenserve.loadgen.targets import SyntheticTarget

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the bench extra were not installed
    config = BenchConfig(target="synthetic", mix="chat", scale=0.05, progress=False, seed=1, concurrencies=[2],
                         num_requests=4, out_dir=tmp_path)
    [run] = await bench(config, target=SyntheticTarget(ttft_s=0.001, itl_s=0.001))
    assert run.summary.successes == 4
    assert (tmp_path / "report.json").exists() and not list(tmp_path.glob("*.png"))
    assert ("qwen-serve bench: no plots: they need the 'bench' extra (matplotlib): pip install 'qwen-serve[bench]'"
            in capsys.readouterr().err.splitlines())
