"""Progress on first use: named steps with durations in pipes and logs, a bar redrawn in place on a terminal."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from qwenserve import progress
from qwenserve.telemetry.logs import setup_logging

REPO = Path(__file__).resolve().parents[1]

# Loads the default model's weights with a bar drawn from the first moment (a real load is quicker than the
# half second a step runs quietly).
LOAD_WEIGHTS = """
import sys
import torch
from qwenserve import progress
progress.QUIET_FOR_S = 0.0
progress.REDRAW_EVERY_S = 0.005
from qwenserve.engine.weights import load_checkpoint
from qwenserve.models import ModelConfig, model_class
cfg = ModelConfig.from_folder(sys.argv[1])
load_checkpoint(model_class(cfg)(cfg, torch.float32, 256), sys.argv[1])
"""


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWENSERVE_")}
    return {**env, "QWENSERVE_CACHE": str(cache), "QWENSERVE_CPU_KERNEL": "0", **extra}


@pytest.fixture(scope="module")
def first_use(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`qwen-serve model init` into an empty cache, its stderr a pipe: what a newcomer's first start does."""
    cache = tmp_path_factory.mktemp("fresh-cache")
    done = subprocess.run([sys.executable, "-m", "qwenserve.cli", "model", "init"], env=_env(cache), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return cache, done


def test_first_use_in_a_pipe_prints_each_step_with_its_duration_and_no_bar(first_use):
    _, done = first_use
    lines = done.stderr.splitlines()
    assert "\r" not in done.stderr and "\x1b" not in done.stderr
    assert any(re.fullmatch(r"converting the qwen3 vocabulary .*: done in \d+\.\d s \(151643 tokens\)", line)
               for line in lines), done.stderr
    assert any(re.fullmatch(r"writing the default model qwen3-tiny-random-v1 .*: done in \d+\.\d s "
                            r"\(46 tensors, 171\.3 MB\)", line) for line in lines), done.stderr
    # Both steps take seconds, so each also said when it began; nothing but the steps is on stderr.
    assert "converting the qwen3 vocabulary to tokenizer.json (once per machine) ..." in lines
    assert all(line.startswith(("converting the qwen3 vocabulary", "writing the default model")) for line in lines)


def test_a_second_start_finds_everything_written_and_says_nothing(first_use):
    cache, _ = first_use
    again = subprocess.run([sys.executable, "-m", "qwenserve.cli", "model", "init"], env=_env(cache), cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stderr == ""


def test_steps_before_logging_is_set_up_are_json_lines_when_json_logs_are_asked_for(first_use, tmp_path):
    cache, _ = first_use
    done = subprocess.run([sys.executable, "-m", "qwenserve.cli", "model", "init", "--dir", str(tmp_path / "m")],
                          env=_env(cache, QWENSERVE_LOG_FORMAT="json"), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]
    assert re.fullmatch(rf"writing the default model into {re.escape(str(tmp_path / 'm'))}: done in \d+\.\d s "
                        r"\(46 tensors, 171\.3 MB\)", records[-1]["message"]), records
    assert {r["logger"] for r in records} == {"qwenserve.progress"}


def test_weight_loading_on_a_terminal_is_one_line_redrawn_in_place(first_use):
    cache, done = first_use
    model = done.stdout.strip()
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 300, 0, 0))  # wide: the bar is not cut
    child = subprocess.Popen([sys.executable, "-c", LOAD_WEIGHTS, model], stdin=subprocess.DEVNULL,
                             stdout=follower, stderr=follower, env=_env(cache, TERM="xterm"), cwd=REPO)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert child.wait(timeout=120) == 0, output.decode(errors="replace")
    text = output.decode()
    frames = re.findall(r"\r\x1b\[K(loading weights from [^\r\n]*)", text)
    assert frames, text
    assert re.fullmatch(rf"loading weights from {re.escape(model)} \[[=> ]+\] \d+/46 tensors [\d.]+/[\d.]+ MB \d+ s",
                        frames[0]), frames[0]
    # The bar is erased and replaced by one end line.
    assert re.search(rf"\r\x1b\[Kloading weights from {re.escape(model)}: done in \d+\.\d s "
                     r"\(46 tensors, 171\.3 MB\)\r?\n", text), text


def test_children_of_up_print_named_lines_even_when_they_share_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("QWENSERVE_PROGRESS", raising=False)
    monkeypatch.delenv("QWENSERVE_LOG_FORMAT", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert progress.mode(Terminal()) == "bar"
    for key, value in progress.child_env("prefill-0", dict(os.environ)).items():
        monkeypatch.setenv(key, value)
    assert progress.mode(Terminal()) == "lines"
    assert os.environ["QWENSERVE_PROGRESS_NAME"] == "prefill-0"
    assert progress.child_env("decode-0", {"QWENSERVE_PROGRESS": "off"})["QWENSERVE_PROGRESS"] == "off"


def test_progress_lines_are_json_under_json_logging(monkeypatch):
    monkeypatch.delenv("QWENSERVE_PROGRESS_NAME", raising=False)
    monkeypatch.delenv("QWENSERVE_PROGRESS", raising=False)
    stream = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = setup_logging(json=True, level="INFO", stream=stream)
    try:
        with progress.step("packing things", total=3, unit="things") as step:
            step.advance(3)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    records = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is JSON
    messages = [r["message"] for r in records if r["logger"] == "qwenserve.progress"]
    assert len(messages) == 1 and re.fullmatch(r"packing things: done in \d+\.\d s \(3 things\)", messages[0])
