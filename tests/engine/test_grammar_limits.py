"""Structured output cannot hurt other requests: a constraint past a size limit is refused before any work, one
past its compile deadline or memory budget is stopped in its compile process, an empty language is refused at
compile time, compiled grammars are kept within a byte budget, and a grammar whose masks cost too much ends its
own request while the others in its steps go on. Each refusal names the flag that sets the limit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwenserve.default_model import TINY_CONFIG
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.grammar import GrammarBackend
from qwenserve.engine.outputs import RequestOutput
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.structured import (
    GrammarLimitExceeded,
    GrammarLimits,
    StructuredOutput,
    StructuredOutputError,
)
from tests.support.checkpoints import tiny_checkpoint


def _choices(count: int) -> StructuredOutput:
    """`count` distinct strings of 42 characters (little shared, so each costs the compiler its share)."""
    return StructuredOutput("choice", json.dumps([f"w{i:05d}" * 7 for i in range(count)]))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("models") / "qwen3-grammar-limits", seed=37,
                           max_position_embeddings=512)


def _backend(model: Path, limits: GrammarLimits) -> GrammarBackend:
    return GrammarBackend(model / "tokenizer.json", TINY_CONFIG["vocab_size"], [151645], None, limits)


@pytest.fixture(scope="module")
def backend(model: Path) -> Iterator[GrammarBackend]:
    """Default bounds, but a cache of 1 MiB and a memory budget of 8 MiB (a 2,000-choice list needs 15)."""
    backend = _backend(model, GrammarLimits(cache_bytes=1 << 20, compile_memory_bytes=8 << 20))
    yield backend
    backend.close()


def test_a_constraint_past_the_size_limits_is_refused_before_any_compile(backend: GrammarBackend) -> None:
    enum = StructuredOutput("json_schema", json.dumps({"enum": [f"value-{i}" for i in range(50_000)]}))
    started = time.monotonic()
    with pytest.raises(GrammarLimitExceeded, match="--max-grammar-choices"):
        backend.compile_sync(_choices(20_000))
    with pytest.raises(GrammarLimitExceeded, match="--max-grammar-chars"):
        backend.compile_sync(enum)
    with pytest.raises(GrammarLimitExceeded, match="--max-grammar-chars"):
        backend.compile_sync(StructuredOutput("regex", "|".join(f"word{i}" for i in range(90_000))))
    assert time.monotonic() - started < 1.0  # nothing was parsed or compiled, no process was started


def test_an_empty_language_is_refused_at_compile_time(backend: GrammarBackend) -> None:
    with pytest.raises(StructuredOutputError, match="matches nothing"):
        backend.compile_sync(StructuredOutput("regex", r"[^\s\S]"))
    assert backend.compile_sync(StructuredOutput("regex", r"[ab]{2}")) is not None


def test_a_compile_past_its_memory_budget_is_stopped_and_the_next_one_is_served(backend: GrammarBackend) -> None:
    with pytest.raises(GrammarLimitExceeded, match="--grammar-compile-memory-mb"):
        backend.compile_sync(_choices(2000))
    assert backend.compile_sync(StructuredOutput("regex", r"[0-9]{3}")) is not None


def test_compiled_grammars_are_kept_within_the_cache_byte_bound(backend: GrammarBackend) -> None:
    kept = []
    for n in range(8):
        backend.compile_sync(_choices(40 + n))  # about 400 KB each, compiled
        kept.append(backend.cached_bytes())
    assert max(kept) <= 1 << 20
    assert kept[-1] > 0
    first = _choices(40)
    started = time.monotonic()
    assert backend.compile_sync(first) is not None  # dropped long ago: compiled again
    assert time.monotonic() - started < 15


def test_a_compile_past_its_deadline_is_stopped_and_the_next_one_is_served(model: Path) -> None:
    backend = _backend(model, GrammarLimits(compile_timeout_s=0.3))
    try:
        assert backend.compile_sync(StructuredOutput("regex", "[a-z]")) is not None  # the process is up
        started = time.monotonic()
        with pytest.raises(GrammarLimitExceeded, match="--grammar-compile-timeout-s"):
            backend.compile_sync(_choices(3000))
        assert time.monotonic() - started < 5
        assert backend.compile_sync(StructuredOutput("regex", "[a-z]{2}")) is not None  # a new process
    finally:
        backend.close()


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine.from_pretrained(model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1))
    yield engine
    engine.shutdown()


async def _collect(engine: LLMEngine, request_id: str, sampling: SamplingParams,
                   times: list[float] | None = None) -> list[RequestOutput]:
    outputs = []
    async for out in engine.generate(request_id, [1, 2, 3, 4], sampling):
        outputs.append(out)
        if times is not None:
            times.append(time.monotonic())
    return outputs


def test_a_victim_streams_on_while_a_hostile_grammar_compiles_or_is_refused(engine: LLMEngine) -> None:
    victim = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)

    async def alone() -> list[float]:
        times: list[float] = [time.monotonic()]
        await _collect(engine, "victim-alone", victim, times)
        return times

    async def run() -> tuple[list[float], list[object]]:
        times: list[float] = [time.monotonic()]
        victim_task = asyncio.create_task(_collect(engine, "victim", victim, times))
        await asyncio.sleep(0.2)
        hostile = [asyncio.wait_for(_collect(engine, f"hostile-{i}", SamplingParams(max_tokens=4, structured=s)), 30)
                   for i, s in enumerate((_choices(1000), _choices(20_000), StructuredOutput("regex", r"[^\s\S]")))]
        answers = await asyncio.gather(*hostile, return_exceptions=True)
        await victim_task
        return times, answers

    def worst_gap(times: list[float]) -> float:
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    # The same stream alone first: what this machine's load (other tests on its two cores) already costs it.
    # The hostile grammars may add under 3 s to its worst gap between tokens, the bound on an idle machine.
    baseline = worst_gap(asyncio.run(alone()))
    times, answers = asyncio.run(run())
    assert len(times) == 151
    assert worst_gap(times) < 3.0 + 3 * baseline, (worst_gap(times), baseline)
    served, too_many, empty = answers
    assert isinstance(served, list) and served[-1].finish_reason in ("stop", "length"), served
    assert isinstance(too_many, GrammarLimitExceeded) and "--max-grammar-choices" in str(too_many)
    assert isinstance(empty, StructuredOutputError) and "matches nothing" in str(empty)


def test_a_grammar_whose_masks_cost_too_much_ends_its_request_and_not_the_others(model: Path) -> None:
    engine = LLMEngine.from_pretrained(model, EngineConfig(kv_cache_memory_gb=0.05, num_threads=1,
                                                           grammar_mask_budget_ms=0.0001))
    try:
        free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutput("regex", r"[a-z ]+"))
        outputs = engine.generate_sync_outputs([[1, 2, 3], [1, 2, 3]], [free, constrained])
    finally:
        engine.shutdown()
    assert outputs[0][-1].finish_reason == "length" and len([t for o in outputs[0] for t in o.new_token_ids]) == 12
    last = outputs[1][-1]
    assert last.finish_reason == "error" and last.request_fault, last
    assert "--grammar-mask-budget-ms" in (last.error or "")


# Run in a process of its own, as a worker's grammar backend: its resident memory is then the backend's alone.
_DISTINCT_LARGE_ENUMS = """
import json, re, sys
from concurrent.futures import wait
from pathlib import Path
from qwenserve.engine.grammar import GrammarBackend
from qwenserve.engine.structured import GrammarLimits, StructuredOutput

def rss_mib():
    return int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

backend = GrammarBackend(Path(sys.argv[1]) / "tokenizer.json", int(sys.argv[2]), [151645], None,
                         GrammarLimits(compile_timeout_s=120))
backend.compile_sync(StructuredOutput("regex", "[a-z]"))  # the vocabulary's tables, built once and kept
before = rss_mib()
schemas = [json.dumps({"enum": [f"s{k}-{i:05d}-abcdefgh" for i in range(6000)]}) for k in range(4)]
wait([backend.compiled(StructuredOutput("json_schema", s)) for s in schemas])
print(json.dumps({"grown_mib": rss_mib() - before, "cached_mib": backend.cached_bytes() / 2**20}))
"""


def test_a_workers_memory_stays_within_the_cache_after_distinct_large_schemas(model: Path) -> None:
    # Enums of 6,000 strings (~126 KB, ~28 MiB compiled each): before, glibc kept the heap each one's JSON was parsed
    # in, and the backend was ~650 MiB larger after four, for good, whatever its cache held.
    done = subprocess.run([sys.executable, "-c", _DISTINCT_LARGE_ENUMS, str(model), str(TINY_CONFIG["vocab_size"])],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    memory = json.loads(done.stdout.strip().splitlines()[-1])
    assert memory["cached_mib"] > 50, memory  # they were compiled, and are kept
    assert memory["grown_mib"] < memory["cached_mib"] + 100, memory
