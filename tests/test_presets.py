"""Presets: `--preset latency|throughput` moves the stages' defaults together, shown by `qwen-serve up
--print-config`; a flag or variable given beside it wins."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from qwenserve.presets import PRESETS, preset_named


def _print_config(*args: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """Each child's (and up's) printed configuration line, by name."""
    run = subprocess.run([sys.executable, "-m", "qwenserve.cli", "up", *args, "--print-config"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **(env or {})})
    assert run.returncode == 0, run.stderr
    return dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)


def _value(line: str, name: str) -> str:
    found = re.search(rf"\b{name}=([^ ,}}]+)", line)
    assert found, (name, line)
    return found.group(1)


@pytest.mark.parametrize("preset", ["latency", "throughput"])
def test_print_config_shows_the_presets_settings_on_every_stage_that_has_them(preset: str) -> None:
    lines = _print_config("--preset", preset)
    values = PRESETS[preset]
    for stage in ("prefill-0", "decode-0"):
        for name in ("max_num_batched_tokens", "max_num_seqs", "admission_policy", "burst_prefill_steps"):
            assert _value(lines[stage], name) == str(values[name]), (stage, name)
        assert _value(lines[stage], "preset") == preset
    assert _value(lines["decode-0"], "stream_interval_ms") == str(values["stream_interval_ms"])
    assert _value(lines["router"], "max_streams_per_decode_worker") == str(values["max_streams_per_decode_worker"])
    assert _value(lines["router"], "preset") == preset
    assert _value(lines["up"], "prefill_nice") == str(values["prefill_nice"])


def test_a_flag_or_variable_beside_the_preset_wins_and_the_variable_names_a_preset_too() -> None:
    lines = _print_config("--preset", "throughput", "--max-num-seqs", "9", env={"QWENSERVE_STREAM_INTERVAL_MS": "5"})
    assert _value(lines["decode-0"], "max_num_seqs") == "9"
    assert _value(lines["decode-0"], "stream_interval_ms") == "5.0"
    assert _value(lines["decode-0"], "max_num_batched_tokens") == "2048"
    lines = _print_config(env={"QWENSERVE_PRESET": "latency"})
    assert _value(lines["decode-0"], "max_num_seqs") == "32" and _value(lines["up"], "prefill_nice") == "0"
    assert _value(lines["router"], "max_streams_per_decode_worker") == "32"
    plain = _print_config()
    assert _value(plain["prefill-0"], "preset") == "none" and _value(plain["up"], "prefill_nice") == "10"
    assert _value(plain["decode-0"], "max_num_seqs") == "256"


def test_an_unknown_preset_is_refused_with_the_choices() -> None:
    run = subprocess.run([sys.executable, "-m", "qwenserve.cli", "up", "--preset", "fast", "--print-config"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "latency" in run.stderr and "throughput" in run.stderr


def test_the_last_preset_given_counts_as_for_any_flag() -> None:
    assert preset_named(["--preset", "latency", "--preset=throughput"], {}) == "throughput"
    assert preset_named([], {"QWENSERVE_PRESET": "latency"}) == "latency"
    assert preset_named(["--preset", "throughput"], {"QWENSERVE_PRESET": "latency"}) == "throughput"
    assert preset_named([], {}) == "none"
