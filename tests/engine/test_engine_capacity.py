"""max_model_len against the KV cache: one request of max_model_len always fits, or the engine does not start."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from qwenserve.engine.config import EngineConfig, KVCapacity, resolve_max_model_len
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.errors import MaxModelLenError
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.request_limits import ContextLengthExceeded

# 8 blocks of 8 tokens: 64 tokens, a KiB a block.
SMALL_KV = KVCapacity(num_blocks=8, block_size=8, bytes_per_block=1024)


def test_a_derived_limit_is_the_models_positions_capped_then_lowered_to_the_kv_cache() -> None:
    roomy = KVCapacity(num_blocks=4096, block_size=16, bytes_per_block=1024)
    assert resolve_max_model_len(None, 512, roomy) == 512
    assert resolve_max_model_len(None, 40960, roomy) == 32768
    assert resolve_max_model_len(None, 512, SMALL_KV) == 64


def test_an_explicit_limit_is_kept_when_it_fits_and_refused_naming_both_numbers_and_the_fix() -> None:
    assert resolve_max_model_len(64, 512, SMALL_KV) == 64
    with pytest.raises(MaxModelLenError) as too_big:
        resolve_max_model_len(200, 512, SMALL_KV)
    message = str(too_big.value)
    assert "200" in message and "64 tokens" in message and "--kv-cache-gb" in message and "--max-model-len" in message
    assert "\n" not in message
    with pytest.raises(MaxModelLenError, match="600 is more than the model's 512 positions"):
        resolve_max_model_len(600, 512, KVCapacity(num_blocks=4096, block_size=16, bytes_per_block=1024))
    with pytest.raises(MaxModelLenError, match="no room"):
        resolve_max_model_len(1, 512, SMALL_KV)


def test_the_suggested_kv_cache_size_holds_the_requested_length() -> None:
    kv = KVCapacity(num_blocks=100, block_size=16, bytes_per_block=3 * 2**20)
    gib = kv.gib_for(4000)
    assert int(gib * 2**30 // kv.bytes_per_block) * kv.block_size >= 4000


def test_an_engine_whose_kv_cache_is_smaller_than_the_model_lowers_max_model_len_with_a_warning(
    make_engine: Callable[..., LLMEngine], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="qwenserve.engine"):
        engine = make_engine("qwen3_gqa4", num_kv_blocks=8, block_size=8)  # the model has 512 positions
    assert engine.max_model_len == 64
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "lowered from 512 to 64" in warnings[0], warnings
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    assert len(engine.generate_sync([[3] * 63], greedy)[0]) == 1
    with pytest.raises(ContextLengthExceeded, match="max_model_len is 64"):
        engine.generate_sync([[3] * 64], greedy)
    # Without max_tokens a request gets the rest of the context, which the cache always holds.
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    outs = engine.generate_sync_outputs([[3] * 40], unbounded)[0]
    assert outs[-1].finish_reason == "length" and outs[-1].usage.completion_tokens == 24


def test_an_engine_that_fits_its_model_says_nothing(
    make_engine: Callable[..., LLMEngine], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="qwenserve.engine"):
        engine = make_engine("qwen3_gqa4", num_kv_blocks=64, block_size=8)
    assert engine.max_model_len == 512
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_explicit_max_model_len_the_kv_cache_cannot_hold_stops_the_engine_before_loading_weights(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    # config.json alone: had the weights been loaded first, this would be a CheckpointError.
    (tmp_path / "config.json").write_bytes((checkpoint("qwen3_gqa4") / "config.json").read_bytes())
    config = EngineConfig(num_kv_blocks=8, block_size=8, max_model_len=200, num_threads=1)
    with pytest.raises(MaxModelLenError, match="max_model_len 200 does not fit in the KV cache, which holds 64"):
        LLMEngine.from_pretrained(tmp_path, config)
