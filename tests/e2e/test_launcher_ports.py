"""A port taken between being picked and being bound costs the launcher a second plan, not the start."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from qwenserve import launcher
from tests.e2e.conftest import make_cluster


def test_a_cluster_whose_picked_port_was_taken_starts_on_other_ports(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real_free_port = launcher.free_port
        # The first port handed out (the tokenizer's) is one another process holds.
        monkeypatch.setattr(launcher, "free_port", lambda host: next(picks, None) or real_free_port(host))
        with make_cluster(tiny_model, tmp_path, prefill=0, decode=1) as cluster:
            assert cluster.children[0].address != f"127.0.0.1:{taken}"
            assert all(c.process is not None and c.process.poll() is None for c in cluster.children)
