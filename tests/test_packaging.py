"""Packaging: every package folder is installed under a prefixed name, nothing shadows the stdlib."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIXES = {"qwenserve": "qwenserve", "services/qwenserve_services": "qwenserve_services",
            "operator/qwenserve_operator": "qwenserve_operator",
            "devcluster/qwenserve_devcluster": "qwenserve_devcluster"}


def _package_folders() -> set[str]:
    found = set()
    for folder, prefix in PREFIXES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((prefix, *rel)))
    return found


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing = _package_folders() - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_operator_package_does_not_shadow_the_standard_library() -> None:
    import operator

    import qwenserve_operator

    assert hasattr(operator, "itemgetter")
    assert Path(qwenserve_operator.__file__).parent == ROOT / "operator" / "qwenserve_operator"
    assert not (ROOT / "operator" / "__init__.py").exists(), "operator/ must stay a plain folder"


def test_python_run_from_the_repository_root_imports_the_standard_library_operator() -> None:
    # No -P: the current directory comes first on sys.path, as for anyone typing `python` in a checkout.
    code = "import operator, qwenserve_operator; print(operator.eq, operator.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert "<built-in function eq>" in run.stdout
    assert str(ROOT / "operator") not in run.stdout


def test_console_script_lists_the_stages(capsys) -> None:
    from qwenserve.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for stage in ("tokenizer", "prefill", "decode", "router"):
        assert stage in out
    assert main(["serve", "nonsense"]) == 2


def test_test_modules_have_unique_names() -> None:
    # Test folders without __init__.py are imported by file name; two equal names break collection.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py") if not (p.parent / "__init__.py").exists()]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
