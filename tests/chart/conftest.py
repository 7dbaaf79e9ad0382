"""Fixtures for the chart tests: render with Helm's own engine (helm-python-sdk)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/qwen-serve"
RELEASE = "qs"
NAMESPACE = "serving"


@pytest.fixture(scope="session")
def chart() -> Iterator[helm_python.Chart]:
    """The loaded chart."""
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture
def render(chart: helm_python.Chart) -> Callable[..., list[dict[str, Any]]]:
    """Render with values; returns every manifest (NOTES.txt excluded) as a dict."""

    def run(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        rendered = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
        docs = []
        for path, text in sorted(rendered.items()):
            if path.endswith("NOTES.txt"):
                continue
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
        return docs

    return run
