"""The router and tokenizer stages never load torch: they start in a second and stay small (CI once saw a router
that did abort at start, out of threads, on a machine full of engines)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["qwenserve_services.router.server", "qwenserve_services.tokenizer.server"])
def test_the_stage_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
