"""Weighted billing end to end: what `qwen-serve usage show --prices` bills a tenant equals the price list applied
to the usage the server reported in its answers (the real router, Redis meter and CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import openai

from qwenserve.launcher import LocalCluster

PROMPT = [{"role": "user", "content": "Name three colours. " + "The sea is wide and the sky is grey. " * 8}]


def test_usage_show_bills_the_reported_usage_at_the_models_prices(base_url: str, cluster: LocalCluster,
                                                                   redis_url: str, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="sk-billed", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reported = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0}
    for max_tokens in (5, 9, 9):  # the repeated prompt hits the prefix cache: cached tokens get their own price
        usage = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=max_tokens,
                                               temperature=0, extra_body={"ignore_eos": True}).usage
        reported["prompt_tokens"] += usage.prompt_tokens
        reported["cached_prompt_tokens"] += usage.prompt_tokens_details.cached_tokens
        reported["completion_tokens"] += usage.completion_tokens
        reported["reasoning_tokens"] += usage.completion_tokens_details.reasoning_tokens
    assert reported["cached_prompt_tokens"] > 0
    prices = tmp_path / "prices.yaml"
    prices.write_text(json.dumps({"default": {"prompt": 9},
                                  "models": {model: {"prompt": 1.5, "cached_prompt": 0.25, "completion": 6}}}))
    want = ((reported["prompt_tokens"] - reported["cached_prompt_tokens"]) * 1.5
            + reported["cached_prompt_tokens"] * 0.25 + reported["completion_tokens"] * 6)
    command = [sys.executable, "-m", "qwenserve.cli", "usage", "show", "--redis-url", redis_url, "--tenant", "billed",
               "--prices", str(prices), "--json"]
    deadline = time.monotonic() + 10  # the meter records as each answer settles, right after it is sent
    while True:
        shown = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)["billed"]
        if shown["requests"] == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {k: shown[k] for k in reported} == reported
    assert shown["billed_units"] == want
