"""Reading a service's Prometheus /metrics page, parsed by prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# Every sample on a page: (name, labels) -> value.
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 10.0) -> Samples:
    """Every sample of the /metrics page at host:port."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when there is none)."""
    want = set(labels.items())
    return sum(value for (sample, got), value in samples.items() if sample == name and want <= got)


def by_labels(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples called `name`, by their label sets."""
    return {labels: value for (sample, labels), value in samples.items() if sample == name}


def metric(port: int, name: str, host: str = "127.0.0.1", **labels: str) -> float:
    """The sum of one metric's samples that carry `labels` on host:port's page; fails when it has none."""
    samples = scrape(port, host)
    want = set(labels.items())
    found = [value for (sample, got), value in samples.items() if sample == name and want <= got]
    assert found, f"{name} {labels or ''} not exported on {host}:{port}"
    return sum(found)
