"""A model of realistic size through the disaggregated path: Qwen3-0.6B's shape with random weights.

Tiny models hide what only size shows: a 1,280-token prompt's KV (~294 MB in fp32, ~147 MB in bf16) does not fit
the handoff pool these clusters are given, so the handoff takes the overflow path that once failed every prompt
over ~1,180 tokens (~258 MiB of fp32 KV at this shape). Each test compares the tokens the cluster streams with an
in-process engine's.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import grpc
import pytest

from qwenserve.default_model import QWEN3_0_6B_CONFIG, write_checkpoint
from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.launcher import LocalCluster
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.clusters import make_cluster

# A minute, not seconds: a 0.6B-shaped prefill of 1,280 tokens, in a reference engine and in the cluster. (8k took
# 5.5 of CI's 30 minutes on a 2-core AVX2 machine, 4k then three, 2k one and a half; 1,280 tokens are past the
# ~1,180 where the old failure began, and their ~294 MB of fp32 KV overflow the 64 MiB pool four times over,
# which is the path these tests are for.)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# Smaller than any handoff below: every one of them overflows the pool.
POOL_MIB = 64
PROMPT_TOKENS = 1280
OUTPUT_TOKENS = 6
# Both cores per engine: these tests run alone (tests/conftest.py's EXCLUSIVE_TESTS), where one thread took 71 and
# 69 s, two 51 and 56. (Beside the suite's other workers two threads' barriers had waited on each other's
# scheduling, and the fp32 test took 241-625 s.)
THREADS = 2


def _prompt(n: int, salt: int) -> list[int]:
    return [(7919 * i + 104_729 * salt) % 150_000 for i in range(n)]


def _reference(model: Path, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """The tokens of an engine in a process of its own: the engine keeps the memory it frees (host_memory.py), so
    in this one its ~7 GB would stay beside the cluster's two 0.6B-shaped workers for the rest of the session."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_generate_in_process, model, dtype, prompts).result(timeout=1200)


def _generate_in_process(model: Path, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine.from_pretrained(
        model, EngineConfig(dtype=dtype, kv_cache_memory_gb=2.5, num_threads=THREADS, enable_prefix_caching=False)
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        return engine.generate_sync(prompts, params)
    finally:
        engine.shutdown()


async def _generate(cluster: LocalCluster, prompt: list[int]) -> tuple[list[int], router_pb2.GenerateResponse]:
    req = router_pb2.GenerateRequest()
    req.prompt_token_ids.ids.extend(prompt)
    req.sampling.temperature = 0.0
    req.sampling.max_tokens = OUTPUT_TOKENS
    req.sampling.ignore_eos = True
    tokens: list[int] = []
    last = router_pb2.GenerateResponse()
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(f"{cluster.host}:{cluster.router_port}", options=options) as channel:
        async for msg in router_pb2_grpc.RouterStub(channel).Generate(req, timeout=900):
            tokens.extend(msg.token_ids)
            last = msg
    return tokens, last


def _cluster(model: Path, tmp: Path, dtype: str, **kwargs: object) -> LocalCluster:
    env = {
        "QWENSERVE_KV_CACHE_GB": "2.2" if dtype == "float32" else "1.2",
        "QWENSERVE_THREADS": str(THREADS),
        "QWENSERVE_KV_POOL_MIB": str(POOL_MIB),
        "QWENSERVE_DTYPE": dtype,
    }
    return make_cluster(model, tmp, prefill=1, decode=1, env=env, **kwargs)


def _write_apart(folder: Path, dtype: str) -> Path:
    """The 0.6B-shaped checkpoint, written by a process of its own: its weights (GBs) and the buffers that
    serialise them would otherwise stay in this test process for the rest of the session, beside whatever
    another xdist worker runs meanwhile."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(write_checkpoint, folder, QWEN3_0_6B_CONFIG, seed=5, dtype=dtype).result(timeout=900)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One bf16 checkpoint for both tests (as Qwen ships them): served with --dtype float32 its weights are widened
    and its KV, prefill and handoff are fp32; half the bytes of an fp32 checkpoint to draw and write."""
    yield _write_apart(tmp_path_factory.mktemp("q06") / "qwen3-0.6b-bf16", "bfloat16")


def _handoff_bytes(port: int) -> float:
    """Bytes of KV handed off through this stage, summed over transports."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^qwenserve_handoff_bytes_total\{[^}]*\} (\S+)$", text, re.M))


def _assert_served_by_handoff(cluster: LocalCluster, tokens: list[int], last: router_pb2.GenerateResponse,
                              want: list[int]) -> None:
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, last
    assert not last.HasField("error"), last.error
    assert tokens == want
    # The prompt was computed once, by prefill: decode imported its KV instead of recomputing it.
    assert _handoff_bytes(cluster.child("decode-0").metrics_port) > 0


def test_fp32_prompt_past_the_old_limit_hands_off_through_a_pool_smaller_than_its_kv(model: Path,
                                                                                      tmp_path: Path) -> None:
    prompts = [_prompt(PROMPT_TOKENS, 1)]
    expected = _reference(model, "float32", prompts)
    with _cluster(model, tmp_path, "float32") as cluster:
        for prompt, want in zip(prompts, expected, strict=True):
            tokens, last = asyncio.run(_generate(cluster, prompt))
            _assert_served_by_handoff(cluster, tokens, last, want)


def _fast_bf16() -> bool:
    """AMX runs bf16 products several times faster than fp32; without it (AVX2) torch's bf16 is ~6x slower."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _fast_bf16(), reason="no AMX on this CPU: bf16 products run ~6x slower than fp32 here "
                    "(a 768-token bf16 prefill took minutes), so this machine serves fp32; the fp32 test covers the "
                    "handoff's overflow path, the bf16 layout is covered by tests/kv_transfer")
def test_bf16_prompt_larger_than_the_pool_hands_off_exactly(model: Path, tmp_path: Path) -> None:
    prompts = [_prompt(PROMPT_TOKENS, 3)]  # ~147 MB of bf16 KV: overflows the pool
    expected = _reference(model, "bfloat16", prompts)
    with _cluster(model, tmp_path, "bfloat16") as cluster:
        tokens, last = asyncio.run(_generate(cluster, prompts[0]))
        _assert_served_by_handoff(cluster, tokens, last, expected[0])


def _awq_copy(src: Path, dst: Path) -> Path:
    """`src` with its decoder linears in AWQ 4-bit (groups of 128, as Qwen's AWQ checkpoints), in a process of its
    own (the quantizer holds the model's weights, and their reference dequantization, in fp32)."""
    from tests.support.quantized_checkpoints import quantize_checkpoint

    quantize_checkpoint(src, dst, "awq", group_size=128)
    return dst


def _samples(port: int, name: str) -> dict[str, float]:
    """A metric's samples on a stage's page, by their label text."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def test_a_16_bit_prefill_hands_a_2000_token_prompt_to_a_w4a16_decode_on_the_models_awq_copy(
        model: Path, tmp_path: Path) -> None:
    """Issue 30's per-stage precision at size: prefill on the bf16 checkpoint, decode on its AWQ copy (the codes kept,
    W4A16), both at --dtype auto (their KV is bf16 wherever the kernels load). The prompt's ~230 MB of KV is computed
    once, by prefill, and continued by decode; nothing is refused."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        awq = pool.submit(_awq_copy, model, tmp_path / "qwen3-0.6b-awq").result(timeout=900)
    with _cluster(model, tmp_path, "auto", decode_model=awq) as cluster:
        tokens, last = asyncio.run(_generate(cluster, _prompt(2000, 5)))
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and not last.HasField("error"), last
        assert len(tokens) == OUTPUT_TOKENS
        port = cluster.child("decode-0").metrics_port
        assert _handoff_bytes(port) > 0
        assert sum(_samples(port, "qwenserve_handoff_failures_total").values()) == 0
        precisions = _samples(port, "qwenserve_handoff_precision_total")
        assert sum(precisions.values()) == 1 and 'importer_weights="w4a16"' in next(iter(precisions)), precisions
