"""Per-stage precision under `qwen-serve up` (issue 30; the field report's bf16 prefill in front of a W4A16 decode):
`up MODEL --decode-model AWQ_COPY` runs prefill on the model's 16-bit checkpoint and decode on its AWQ copy, whose
4-bit codes stay codes (W4A16). Every prompt's KV is computed by prefill and handed to decode, which continues it;
the precision of each side is in /v1/models, `qwen-serve status`, the decode worker's metrics and the handoff span.
A decode model of another architecture stops `up` in one line before anything starts."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import quantized_checkpoints as qc
from tests.support.checkpoints import tiny_checkpoint
from tests.support.clusters import WORKER_ENV
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(300)
MODEL_NAME = "per-stage"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The model's 16-bit checkpoint, its AWQ copy (groups of 32), and a checkpoint of another shape."""
    root = tmp_path_factory.mktemp("decode-model")
    plain = tiny_checkpoint(root / MODEL_NAME, seed=5, intermediate_size=160, torch_dtype="bfloat16")
    qc.quantize_checkpoint(plain, root / "awq", "awq", group_size=32)
    return {"plain": plain, "awq": root / "awq",
            "wider": tiny_checkpoint(root / "wider", seed=5, intermediate_size=192)}


def _up(args: list[str], tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, **WORKER_ENV, "QWENSERVE_PROGRESS": "off", "QWENSERVE_DTYPE": "bfloat16"}
    return subprocess.Popen([sys.executable, "-m", "qwenserve.cli", "up", *args, "--log-dir", str(tmp / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def served(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`up` of the plain checkpoint with the AWQ copy for decode: the router's HTTP and gRPC addresses and each
    child's metrics address, by name."""
    http, grpc_port = free_port(), free_port()
    process = _up([str(checkpoints["plain"]), "--decode-model", str(checkpoints["awq"]), "--port", str(http),
                   "--grpc-port", str(grpc_port)], tmp_path_factory.mktemp("up-decode-model"))
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or ()], daemon=True).start()
    try:
        first = lines.get(timeout=240)
        assert "ready" in first, first
        addresses = {"http": f"127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc_port}"}
        for _ in range(4):
            name, _address, url = lines.get(timeout=10).split()
            addresses[name] = url.removeprefix("metrics=http://").removesuffix("/metrics")
        yield addresses
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def _metrics(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _sample(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples carrying `labels`."""
    total = 0.0
    for match in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if all(f'{key}="{value}"' in (match.group(1) or "") for key, value in labels.items()):
            total += float(match.group(2))
    return total


def test_a_bf16_prefill_hands_every_prompt_to_a_w4a16_decode_on_the_models_awq_checkpoint(
        served: dict[str, str]) -> None:
    for n in range(3):
        body = json.dumps({"model": MODEL_NAME, "max_tokens": 12, "ignore_eos": True,
                           "messages": [{"role": "user", "content": f"Prompt {n}: the quick brown fox " * 4}]})
        request = urllib.request.Request(f"http://{served['http']}/v1/chat/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.load(reply)
        assert answer["choices"][0]["finish_reason"] == "length", answer
        assert answer["usage"]["completion_tokens"] == 12, answer

    decode = _metrics(served["decode-0"])
    # Each prompt was computed once, by prefill, and continued by decode: imported, never refused.
    assert _sample(decode, "qwenserve_handoff_bytes_total") > 0
    assert _sample(decode, "qwenserve_handoff_failures_total") == 0
    assert _sample(decode, "qwenserve_handoff_precision_total", exporter_weights="bfloat16",
                   importer_weights="w4a16") == 3
    assert _sample(decode, "qwenserve_engine_precision_info", weights="w4a16", kv="bfloat16") == 1
    assert _sample(_metrics(served["prefill-0"]), "qwenserve_engine_precision_info", weights="bfloat16") == 1

    with urllib.request.urlopen(f"http://{served['http']}/v1/models", timeout=10) as reply:
        (card,) = json.load(reply)["data"]
    assert card["precision"]["prefill"].startswith("bfloat16"), card
    assert card["precision"]["decode"].startswith("weights=w4a16 kv=bfloat16"), card
    status = subprocess.run([sys.executable, "-m", "qwenserve.cli", "status", "--router", served["grpc"], "--json"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    shown = {row["stage"]: row["precision"] for row in json.loads(status.stdout)}
    assert shown["prefill"].startswith("bfloat16") and "weights=w4a16" in shown["decode"], shown


def test_a_decode_model_of_another_architecture_stops_up_in_one_line_before_anything_starts(
        checkpoints: dict[str, Path], tmp_path: Path) -> None:
    process = _up([str(checkpoints["plain"]), "--decode-model", str(checkpoints["wider"])], tmp_path)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1 and out == "", (out, err)
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert "--decode-model" in line and "intermediate_size: 160 vs 192" in line, line
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())  # no stage was started
