"""Usage metering per tenant, in-process and in Redis, and the `qwen-serve usage show` CLI."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import REGISTRY

from qwenserve.ratelimit.redis_client import connect
from qwenserve.tenancy import InProcessUsageMeter, RedisUsageMeter, Tenant, UsageMeter, UsageRecord
from qwenserve.tenancy.cli import main as usage_cli
from tests.support.ports import free_port


@pytest.fixture(params=["memory", "redis"])
async def meter(request: pytest.FixtureRequest):
    if request.param == "memory":
        made: UsageMeter = InProcessUsageMeter()
    else:
        # Sixty records connect at once: on a machine busy with other tests 0.25 s (the request path's) is too short.
        made = RedisUsageMeter(connect(request.getfixturevalue("redis_url"), timeout_s=5.0))
    yield made
    await made.close()


async def test_concurrent_records_add_up_per_tenant(meter: UsageMeter) -> None:
    before = (
        REGISTRY.get_sample_value("qwenserve_tenant_tokens_total", {"tenant": "acme", "kind": "completion"})
        or 0
    )
    acme = Tenant("acme")
    await asyncio.gather(
        *(
            meter.record(acme, UsageRecord(prompt_tokens=100, cached_prompt_tokens=64, completion_tokens=i))
            for i in range(50)
        ),
        *(meter.record("globex", UsageRecord(prompt_tokens=7, completion_tokens=3)) for _ in range(10)),
    )
    assert await meter.read(acme) == {
        "requests": 50,
        "prompt_tokens": 5000,
        "cached_prompt_tokens": 3200,
        "completion_tokens": sum(range(50)),
        "reasoning_tokens": 0,
    }
    assert await meter.read(None) == {
        "acme": await meter.read("acme"),
        "globex": {"requests": 10, "prompt_tokens": 70, "cached_prompt_tokens": 0, "completion_tokens": 30,
                   "reasoning_tokens": 0},
    }
    assert await meter.read("nobody") == dict.fromkeys(
        ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "reasoning_tokens"), 0
    )
    after = REGISTRY.get_sample_value(
        "qwenserve_tenant_tokens_total", {"tenant": "acme", "kind": "completion"}
    )
    assert after == before + sum(range(50))


def test_usage_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError):
        UsageRecord(prompt_tokens=-1)
    with pytest.raises(ValueError):
        UsageRecord(prompt_tokens=10, cached_prompt_tokens=11)
    with pytest.raises(ValueError):
        UsageRecord(completion_tokens=3, reasoning_tokens=4)


async def test_usage_is_kept_per_model_beside_the_totals(meter: UsageMeter) -> None:
    tenant = f"split-{type(meter).__name__}"
    await meter.record(tenant, UsageRecord(prompt_tokens=10, cached_prompt_tokens=4, completion_tokens=6,
                                     reasoning_tokens=2, model="qwen3:8b"))
    await meter.record(tenant, UsageRecord(prompt_tokens=3, completion_tokens=1, model="qwen3-backup"))
    await meter.record(tenant, UsageRecord(prompt_tokens=1, completion_tokens=1))
    by_model = await meter.read_by_model(tenant)
    assert by_model == {
        "qwen3:8b": {"requests": 1, "prompt_tokens": 10, "cached_prompt_tokens": 4, "completion_tokens": 6,
                     "reasoning_tokens": 2},
        "qwen3-backup": {"requests": 1, "prompt_tokens": 3, "cached_prompt_tokens": 0, "completion_tokens": 1,
                         "reasoning_tokens": 0},
        "": {"requests": 1, "prompt_tokens": 1, "cached_prompt_tokens": 0, "completion_tokens": 1,
             "reasoning_tokens": 0},
    }
    totals = await meter.read(tenant)
    assert all(totals[f] == sum(m[f] for m in by_model.values()) for f in totals)


async def test_cli_shows_what_the_routers_recorded(redis_url: str, capsys: pytest.CaptureFixture) -> None:
    meter = RedisUsageMeter(connect(redis_url))
    await meter.record("acme", UsageRecord(prompt_tokens=1200, cached_prompt_tokens=1024, completion_tokens=345))
    await meter.record("zeta", UsageRecord(prompt_tokens=1, completion_tokens=2))
    await meter.close()
    # The CLI runs its own event loop, as it does from the shell.
    code = await asyncio.to_thread(usage_cli, ["show", "--redis-url", redis_url])
    table = capsys.readouterr().out.splitlines()
    assert code == 0
    assert table[0].split() == [
        "tenant",
        "requests",
        "prompt_tokens",
        "cached_prompt_tokens",
        "completion_tokens",
        "reasoning_tokens",
    ]
    assert table[1].split() == ["acme", "1", "1200", "1024", "345", "0"]
    assert table[2].split() == ["zeta", "1", "1", "0", "2", "0"]
    code = await asyncio.to_thread(
        usage_cli, ["show", "--redis-url", redis_url, "--tenant", "zeta", "--json"]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out) == {
        "zeta": {"requests": 1, "prompt_tokens": 1, "cached_prompt_tokens": 0, "completion_tokens": 2,
                 "reasoning_tokens": 0}
    }


def test_cli_without_redis_says_where_usage_lives(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    monkeypatch.delenv("QWENSERVE_REDIS_URL", raising=False)
    assert usage_cli(["show"]) == 2
    assert "--redis-url" in capsys.readouterr().err


def test_cli_reports_an_unreachable_redis(capsys: pytest.CaptureFixture) -> None:
    assert usage_cli(["show", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--timeout", "0.2"]) == 1
    assert "could not read usage" in capsys.readouterr().err


async def test_cli_bills_each_models_usage_at_its_prices(redis_url: str, tmp_path, capsys) -> None:
    meter = RedisUsageMeter(connect(redis_url), key_prefix="billing-test")
    await meter.record("acme", UsageRecord(prompt_tokens=100, cached_prompt_tokens=60, completion_tokens=50,
                                     reasoning_tokens=20, model="big"))
    await meter.record("acme", UsageRecord(prompt_tokens=10, completion_tokens=5, model="small"))
    await meter.close()
    prices = tmp_path / "prices.yaml"
    prices.write_text("default: {prompt: 1, completion: 2}\n"
                      "models:\n  big: {prompt: 3, cached_prompt: 0.5, completion: 6, reasoning: 4}\n")
    args = ["show", "--redis-url", redis_url, "--key-prefix", "billing-test", "--prices", str(prices), "--json"]
    assert await asyncio.to_thread(usage_cli, args) == 0
    shown = json.loads(capsys.readouterr().out)["acme"]
    # big: 40 uncached x 3 + 60 cached x 0.5 + 30 answer x 6 + 20 thinking x 4; small at the default: 10 + 5 x 2
    assert shown["billed_units"] == 40 * 3 + 60 * 0.5 + 30 * 6 + 20 * 4 + (10 * 1 + 5 * 2)
    assert await asyncio.to_thread(usage_cli, [*args[:-1], "--by-model"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["acme/small"][-1] == "20.0000" and rows["acme/big"][1:3] == ["1", "100"]
    prices.write_text("default: {prompt: -1}\n")
    assert await asyncio.to_thread(usage_cli, args) == 2
    assert "default.prompt" in capsys.readouterr().err
