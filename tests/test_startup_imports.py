"""What a stage imports to start: the router and the tokenizer never touch a tensor, so they start without torch
(its import is seconds of CPU and hundreds of MB in every cluster a test or an operator starts)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("server", ["qwenserve_services.router.server", "qwenserve_services.tokenizer.server"])
def test_the_router_and_tokenizer_servers_import_no_torch(server: str) -> None:
    code = f"import sys, {server}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout.strip() == "[]", run.stdout
