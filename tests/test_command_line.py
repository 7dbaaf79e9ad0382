"""The command line as a newcomer meets it, through real `qwen-serve` processes: a mistyped flag or an unusable
setting is one line naming the cause and the fix, with a non-zero exit and no traceback; `up MODEL` serves MODEL.

Most of these end before any model loads, so they take a second each.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ports import free_port

ENV = {**os.environ, "QWENSERVE_KV_CACHE_GB": "0.05", "QWENSERVE_THREADS": "1", "QWENSERVE_KV_POOL_MIB": "16",
       "QWENSERVE_PROGRESS": "off"}
# A prefix each subcommand accepts, so that the flag after it is the only mistake.
SUBCOMMANDS = {
    "up": ["up"], "serve tokenizer": ["serve", "tokenizer"], "serve prefill": ["serve", "prefill"],
    "serve decode": ["serve", "decode"], "serve router": ["serve", "router"], "generate": ["generate", "hi"],
    "status": ["status"], "tokens": ["tokens", "count", "-"], "model": ["model", "path"],
    "operator": ["operator"], "bench": ["bench"], "usage": ["usage", "show"],
}


def qwen_serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qwenserve.cli", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout, stdin=subprocess.DEVNULL)


def free_ports(command: list[str]) -> list[str]:
    """Free ports for every listening port `command` checks at start, so that the default ones (50050, 8000,
    ...) being taken on this machine cannot answer before the check a test is about."""
    if command[:1] == ["up"]:
        return ["--port", str(free_port()), "--grpc-port", str(free_port())]
    return ["--port", str(free_port())]


def assert_one_line(done: subprocess.CompletedProcess[str], *fragments: str, code: int = 1) -> str:
    """The process exited with `code` and wrote exactly one line on stderr, containing every fragment."""
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == code and len(lines) == 1, (done.returncode, done.stderr)
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("subcommand", sorted(SUBCOMMANDS))
def test_an_unknown_flag_is_one_line_naming_it_and_exit_2(subcommand: str) -> None:
    done = qwen_serve(*SUBCOMMANDS[subcommand], "--kv-cahce-gb", "2")
    line = assert_one_line(done, "unknown flag --kv-cahce-gb", code=2)
    if subcommand.startswith(("serve prefill", "serve decode", "up")):
        assert line.endswith("(did you mean --kv-cache-gb?)"), line


def test_serve_help_and_each_stage_help_exit_0() -> None:
    done = qwen_serve("serve", "--help")
    assert done.returncode == 0 and "tokenizer,prefill,decode,router" in done.stdout
    for stage in ("tokenizer", "prefill", "decode", "router"):
        done = qwen_serve("serve", stage, "--help")
        assert done.returncode == 0 and "QWENSERVE_" in done.stdout and not done.stderr, done.stderr


def test_an_unknown_subcommand_or_stage_is_one_line() -> None:
    assert_one_line(qwen_serve("srve"), "unknown command 'srve' (did you mean 'serve'?)", code=2)
    assert_one_line(qwen_serve("serve", "decod"), "unknown stage 'decod' (did you mean 'decode'?)", code=2)


def test_tensor_parallelism_is_refused_on_a_host_without_gpus_and_1_is_accepted(tiny_model: Path) -> None:
    for command in (["serve", "decode"], ["up"]):
        assert_one_line(qwen_serve(*command, str(tiny_model), *free_ports(command), "--tensor-parallel-size", "2"),
                        "tensor parallelism needs GPUs; this host has none", code=2)
    assert qwen_serve("serve", "decode", "--tensor-parallel-size", "1", "--help").returncode == 0


@pytest.mark.parametrize("stage", ["tokenizer", "prefill", "decode", "router", "up"])
def test_a_model_path_that_does_not_exist_or_is_no_checkpoint_is_one_line(stage: str, tmp_path: Path) -> None:
    command = ["up"] if stage == "up" else ["serve", stage]
    extra = ["--decode", "127.0.0.1:1"] if stage == "router" else []
    missing = tmp_path / "no-such-model"
    assert_one_line(qwen_serve(*command, str(missing), *extra), f"{missing}: no such file or folder",
                    "Hugging Face checkpoint folder")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "tokenizer.json").write_text("{}")
    assert_one_line(qwen_serve(*command, str(tmp_path / "empty"), *extra), "has no config.json",
                    "Hugging Face checkpoint folder")


@pytest.mark.parametrize("command", [["serve", "router", "--decode", "127.0.0.1:1"], ["up"]])
def test_a_bad_api_keys_file_is_one_line_naming_the_file(command: list[str], tiny_model: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: [oops\n")
    ports = free_ports(command)
    assert_one_line(qwen_serve(*command, str(tiny_model), *ports, "--api-keys-file", str(keys)), str(keys),
                    "not valid YAML")
    assert_one_line(qwen_serve(*command, str(tiny_model), *ports, "--api-keys-file", str(tmp_path / "none.yaml")),
                    "none.yaml: API key file not found")


@pytest.mark.parametrize(("command", "flag"), [
    (["serve", "tokenizer"], "--port"), (["serve", "decode", "{model}"], "--port"),
    (["serve", "router", "{model}", "--decode", "127.0.0.1:1", "--no-auth"], "--http-port"),
    (["up", "{model}"], "--port"), (["up", "{model}"], "--grpc-port"),
])
def test_a_port_in_use_is_one_line_before_anything_loads(command: list[str], flag: str, busy_port: int,
                                                          tiny_model: Path) -> None:
    argv = [a.replace("{model}", str(tiny_model)) for a in command]
    others = free_ports(command)  # the busy port replaces the one under test (a later flag wins)
    assert_one_line(qwen_serve(*argv, *others, flag, str(busy_port), timeout=30), f"port {busy_port} on 127.0.0.1 is in use",
                    f"choose another {flag}")


def test_up_reports_a_child_that_dies_at_once_with_its_last_line(tiny_model: Path, tmp_path: Path) -> None:
    """Engines that cannot load their weights: `up` names the child and what it said, and stops the others."""
    model = tmp_path / "no-weights"
    shutil.copytree(tiny_model, model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    done = qwen_serve("up", str(model), "--port", str(free_port()), "--grpc-port", str(free_port()), timeout=240)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1 and "ready" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("qwen-serve up: prefill-0 exited with code 1: prefill: cannot start: ") or \
        last.startswith("qwen-serve up: decode-0 exited with code 1: decode: cannot start: "), last
    assert last.endswith("; stopped the others"), last


def test_up_serves_the_model_it_is_given_with_the_names_vllm_users_type(tmp_path: Path, tiny_model: Path) -> None:
    model = tmp_path / "my-positional-model"
    shutil.copytree(tiny_model, model)
    http = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwenserve.cli", "up", str(model), "--port", str(http), "--grpc-port",
         str(free_port()), "--api-key", "sk-up-test", "--max-model-len", "256", "--max-num-seqs", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "ready" in line and f"model={model}" in line, line
        request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/models",
                                         headers={"Authorization": "Bearer sk-up-test"})
        card = json.loads(urllib.request.urlopen(request, timeout=10).read())["data"][0]
        assert card["id"] == "my-positional-model" and card["max_model_len"] == 256
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10)
        assert refused.value.code == 401
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_up_under_log_json_writes_every_line_as_json(tiny_model: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwenserve.cli", "up", str(tiny_model), "--log-json", "--prefill", "0",
         "--port", str(free_port()), "--grpc-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        first = json.loads(proc.stdout.readline() if proc.stdout else "")
        assert first["message"].startswith("qwen-serve ready: router grpc="), first
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert lines, "up wrote nothing after its ready line"
    for line in lines:
        record = json.loads(line)  # the launcher's own lines and every stage's
        assert {"level", "message", "logger"} <= record.keys(), record
