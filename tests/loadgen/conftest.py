"""Fixtures for the load generator's tests (the real cluster they run against is the session's traced_cluster)."""

from __future__ import annotations

import pytest

from qwenserve.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.builtin()
