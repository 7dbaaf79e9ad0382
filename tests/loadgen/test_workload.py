"""Mixes, arrivals and prompts: the shares, rates, bursts and lengths the seeds describe."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from qwenserve.loadgen import arrivals
from qwenserve.loadgen.prompts import PromptFactory
from qwenserve.loadgen.workload import (
    RequestSpec,
    WorkloadError,
    builtin_mix,
    fit_to_context,
    load_mix,
    load_trace,
)
from qwenserve.tokenizer import Tokenizer


def test_chat_mix_has_the_seeds_request_shares_and_lengths() -> None:
    specs = arrivals.open_loop(builtin_mix("chat"), 50.0, random.Random(1), num_requests=20_000)
    shares = Counter(s.group for s in specs)
    assert shares["short"] / len(specs) == pytest.approx(0.65, abs=0.02)
    assert shares["long"] / len(specs) == pytest.approx(0.25, abs=0.02)
    assert shares["burst"] / len(specs) == pytest.approx(0.10, abs=0.02)
    for s in specs:
        if s.group == "long":
            assert 1500 <= s.prompt_len <= 3000 and 300 <= s.output_len <= 500
        else:
            assert 50 <= s.prompt_len <= 100 and 100 <= s.output_len <= 200


def test_open_loop_request_rate_matches_the_asked_rate_bursts_included() -> None:
    specs = arrivals.open_loop(builtin_mix("chat"), 4.0, random.Random(2), duration_s=2000.0)
    assert len(specs) / 2000.0 == pytest.approx(4.0, rel=0.05)
    times = [s.arrival_s for s in specs]
    assert times == sorted(times) and all(0 <= t < 2000.0 for t in times)


def test_bursts_bring_ten_requests_within_100_ms() -> None:
    specs = arrivals.open_loop(builtin_mix("chat"), 1.0, random.Random(4), num_requests=3000)
    burst = [s.arrival_s for s in specs if s.group == "burst"]
    assert len(burst) >= 100
    # Group the burst requests by proximity: each group is 10 requests spread over at most 100 ms.
    groups: list[list[float]] = [[burst[0]]]
    for t in burst[1:]:
        (groups[-1].append(t) if t - groups[-1][0] <= 0.1 else groups.append([t]))
    full = [g for g in groups[:-1] if len(g) == 10]
    assert len(full) >= 0.9 * (len(groups) - 1)
    assert all(max(g) - min(g) <= 0.1 for g in full)


def test_burst_mix_adds_periodic_spikes() -> None:
    specs = arrivals.open_loop(builtin_mix("burst"), 0.5, random.Random(5), duration_s=100.0)
    spikes = [s for s in specs if s.group == "spike"]
    assert len(spikes) == 4 * 20  # spikes at 20, 40, 60, 80 s
    assert all(any(k * 20 <= s.arrival_s <= k * 20 + 1.0 for k in (1, 2, 3, 4)) for s in spikes)


def test_long_tail_prompts_are_capped_by_the_context() -> None:
    specs = arrivals.closed_loop(builtin_mix("long-tail"), 4000, random.Random(6), max_model_len=4096)
    assert all(s.prompt_len + s.output_len <= 4096 for s in specs)
    tail = [s for s in specs if s.group == "tail"]
    assert len(tail) / len(specs) == pytest.approx(0.05, abs=0.015)
    assert sum(s.prompt_len <= 1000 for s in specs) / len(specs) == pytest.approx(0.95, abs=0.015)
    assert fit_to_context(30_000, 200, 4096) == (3896, 200)
    assert fit_to_context(10, 9000, 4096) == (1, 4095)
    assert fit_to_context(10, 20, 4096) == (10, 20)


def test_scaling_shrinks_lengths_not_shares() -> None:
    mix = builtin_mix("chat").scaled(0.1)
    specs = arrivals.closed_loop(mix, 500, random.Random(7))
    long = [s for s in specs if s.group == "long"]
    assert long and all(150 <= s.prompt_len <= 300 and 30 <= s.output_len <= 50 for s in long)


def test_custom_mix_from_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(
        "name: mine\ncomponents:\n"
        "  - {name: a, weight: 3, prompt: [10, 20], output: 5}\n"
        "  - {name: b, weight: 1, prompt: {kind: normal, mean: 100, sd: 10, min: 50, max: 150}, output: [1, 2]}\n")
    mix = load_mix(tmp_path / "m.yaml")
    specs = arrivals.closed_loop(mix, 4000, random.Random(8))
    assert Counter(s.group for s in specs)["a"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert all(10 <= s.prompt_len <= 20 and s.output_len == 5 for s in specs if s.group == "a")
    (tmp_path / "m.json").write_text(json.dumps({"components": [{"prompt": 7, "output": 3}]}))
    assert arrivals.closed_loop(load_mix(tmp_path / "m.json"), 1, random.Random(0))[0].prompt_len == 7
    (tmp_path / "bad.json").write_text(json.dumps({"components": [{"prompt": 7}]}))
    with pytest.raises(WorkloadError, match="output is required"):
        load_mix(tmp_path / "bad.json")


def test_trace_replay_keeps_recorded_times_and_lengths(tmp_path: Path) -> None:
    rows = [{"timestamp": 5000, "input_length": 30, "output_length": 4},
            {"arrival_s": 2.5, "prompt_len": 10, "output_len": 2},
            {"timestamp": 2000, "prompt_len": 20, "output_len": 3}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = load_trace(path)
    assert [(s.arrival_s, s.prompt_len, s.output_len) for s in specs] == [(0.0, 20, 3), (0.5, 10, 2), (3.0, 30, 4)]
    faster = arrivals.scale_trace(specs, 2.0, time_factor=0.5)
    assert [(s.arrival_s, s.prompt_len) for s in faster] == [(0.0, 40), (0.25, 20), (1.5, 60)]


def test_rates_parse_as_lists_and_ranges() -> None:
    assert arrivals.parse_rates("1,2,4") == [1.0, 2.0, 4.0]
    assert arrivals.parse_rates("0.5:2:0.5") == [0.5, 1.0, 1.5, 2.0]
    with pytest.raises(ValueError):
        arrivals.parse_rates("0,1")


def test_prompts_are_text_of_the_exact_token_length(tokenizer: Tokenizer) -> None:
    factory = PromptFactory(tokenizer, seed=9)
    for n in (1, 2, 5, 31, 64, 100, 777, 3000):
        p = factory.text_of_length(n)
        assert len(tokenizer.encode(p.text)) == n == len(p.token_ids)
    texts = {factory.text_of_length(50).text for _ in range(5)}
    assert len(texts) == 5  # different requests, different text


def test_shared_prefix_prompts_share_ninety_percent_as_tokens(tokenizer: Tokenizer) -> None:
    factory = PromptFactory(tokenizer, seed=10)
    specs = arrivals.closed_loop(builtin_mix("shared-prefix"), 4, random.Random(0))
    prompts = [factory.for_spec(s) for s in specs]
    assert all(len(p.token_ids) == s.prompt_len == 1000 for p, s in zip(prompts, specs, strict=True))
    assert all(len(tokenizer.encode(p.text)) == 1000 for p in prompts)
    first = prompts[0].token_ids
    for p in prompts[1:]:
        common = next(i for i, (a, b) in enumerate(zip(first, p.token_ids, strict=True)) if a != b)
        assert common >= 899  # the system prompt (900 tokens incl. its newline) is identical
        assert p.text[:100] == prompts[0].text[:100]
    distinct = RequestSpec(0, 1000, 10, "x", prefix_len=900, prefix_id=1)
    assert factory.for_spec(distinct).token_ids[:50] != first[:50]
