"""A short bounded run against a real cluster (the session's traced cluster of the tiny model, as `qwen-serve up`
runs it): the report's token counts are the server's own usage, over gRPC and over the OpenAI HTTP front."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from qwenserve.launcher import LocalCluster
from qwenserve.loadgen.cli import BenchConfig, bench
from qwenserve.loadgen.stats import Slo


def _config(target: str, tokenizer: Path, **kw: object) -> BenchConfig:
    base = {"target": target, "mix": "chat", "scale": 0.1, "progress": False, "seed": 3, "tokenizer": tokenizer,
            "request_timeout_s": 60.0, "slo": Slo(ttft_ms=5000, itl_ms=1000)}
    return BenchConfig(**{**base, **kw})  # type: ignore[arg-type]


async def test_grpc_run_token_counts_equal_the_servers_usage(traced_cluster: LocalCluster, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    target = f"grpc://127.0.0.1:{traced_cluster.router_port}"
    t0 = time.monotonic()
    [run] = await asyncio.wait_for(bench(_config(target, tiny_model, rates=[4.0], num_requests=10,
                                                 out_dir=tmp_path)), 90)
    assert time.monotonic() - t0 < 90
    s, recs = run.summary, run.result.records
    assert s.requests == s.successes == 10, s.errors
    for r in recs:
        # Counted from the streamed token ids vs the server's terminal usage vs what was asked.
        assert r.output_tokens == r.usage_completion_tokens == r.max_tokens
        assert r.usage_prompt_tokens == r.prompt_tokens_sent  # raw text prompts: exactly the requested length
        assert r.finish_reason == "length"
        assert r.ttft is not None and r.ttft > 0 and len(r.itls) == r.output_tokens - 1
    assert s.output_tokens == s.usage_completion_tokens == sum(r.max_tokens for r in recs)
    assert s.input_tokens == sum(r.usage_prompt_tokens for r in recs)
    assert (tmp_path / "report.json").exists() and (tmp_path / "latency_cdf.png").exists()


async def test_http_run_token_counts_equal_the_servers_usage(traced_cluster: LocalCluster,
                                                             tiny_model: Path) -> None:
    target = f"http://127.0.0.1:{traced_cluster.http_port}"
    [run] = await asyncio.wait_for(bench(_config(target, tiny_model, concurrencies=[2], num_requests=6)), 90)
    s = run.summary
    assert s.requests == s.successes == 6, s.errors
    for r in run.result.records:
        assert r.output_tokens == r.usage_completion_tokens == r.max_tokens
        assert r.usage_prompt_tokens == r.prompt_tokens_sent
    assert s.output_tokens == s.usage_completion_tokens
