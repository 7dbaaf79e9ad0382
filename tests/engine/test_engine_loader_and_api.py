"""Checkpoint loading errors, request validation, abort, and sharded checkpoints."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenserve.engine.config import EngineConfig
from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.errors import CheckpointError
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.request_limits import ContextLengthExceeded, EmptyPrompt, TokenOutsideVocabulary
from tests.support.engine_checkpoints import SPECS, random_prompts, write_checkpoint

TINY = EngineConfig(num_kv_blocks=32, block_size=8, num_threads=2, dtype="float32")  # compared with fp32 transformers


def edited_copy(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")


@pytest.mark.parametrize(
    ("edit", "tensor", "words"),
    [
        (lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"), "model.layers.1.self_attn.k_norm.weight", "missing"),
        (lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}), "model.layers.9.mlp.up_proj.weight", "unexpected"),
        (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}), "model.layers.0.self_attn.k_proj.weight", "shape"),
    ],
    ids=["missing", "extra", "misshaped"],
)
def test_checkpoint_errors_name_the_tensor(checkpoint, tmp_path, edit, tensor, words):
    folder = tmp_path / "broken"
    edited_copy(checkpoint("qwen3_gqa4"), folder, edit)
    with pytest.raises(CheckpointError, match=words) as info:
        LLMEngine.from_pretrained(folder, TINY)
    assert info.value.tensor == tensor and tensor in str(info.value)


def test_sharded_checkpoint_with_index_loads(tmp_path, checkpoint, reference):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(checkpoint("qwen3_moe")).save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    engine = LLMEngine.from_pretrained(folder, TINY)
    try:
        prompt = random_prompts(1, 12, 12, seed=31)[0]
        got = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert got == [reference("qwen3_moe", prompt, 6)[0]]
    finally:
        engine.shutdown()


def test_invalid_requests_raise_typed_errors(make_engine):
    engine = make_engine("qwen3_gqa4", num_kv_blocks=25, block_size=8, max_model_len=200)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(EmptyPrompt):
        engine.generate_sync([[]], greedy)
    with pytest.raises(TokenOutsideVocabulary, match="1024"):
        engine.generate_sync([[1, 1024]], greedy)
    with pytest.raises(ContextLengthExceeded, match="max_model_len"):
        engine.generate_sync([[1] * 150], SamplingParams(max_tokens=60))


async def test_cancelled_consumer_aborts_and_frees_blocks(make_engine):
    engine = make_engine("qwen3_untied")
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def consume_two() -> None:
        n = 0
        async for _ in engine.generate("cancel-me", [5, 6, 7, 8], long):
            n += 1
            if n == 2:
                break

    await consume_two()
    seen = []

    async def watch() -> None:
        async for out in engine.generate("abort-me", [9, 10, 11], long):
            seen.append(out)
            if len(seen) == 2:
                engine.abort("abort-me")

    await asyncio.wait_for(watch(), timeout=30)
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert engine.wait_until_idle(timeout=10)
    assert engine.stats().kv_blocks_used == 0 and engine.stats().running == 0


def test_eos_from_generation_config_stops(tmp_path, make_engine):
    folder = write_checkpoint(tmp_path / "eos", SPECS["qwen2_bias"], seed=0)
    engine = LLMEngine.from_pretrained(folder, TINY)
    try:
        prompt = [3, 4, 5, 6]
        free_run = engine.generate_sync([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    finally:
        engine.shutdown()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [free_run[2]]}))
    engine = LLMEngine.from_pretrained(folder, TINY)
    try:
        outs = engine.generate_sync_outputs([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
        assert engine.eos_token_ids == [free_run[2]]
        assert [t for o in outs for t in o.new_token_ids] == free_run[: free_run.index(free_run[2]) + 1]
        assert outs[-1].finish_reason == "stop"
    finally:
        engine.shutdown()


async def test_shutdown_ends_every_stream_with_abort(checkpoint):
    engine = LLMEngine.from_pretrained(checkpoint("qwen3_gqa4"), TINY)
    stream = engine.generate("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    first = await stream.__anext__()
    assert not first.finished
    await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
    last = [out async for out in stream][-1]
    assert last.finished and last.finish_reason == "abort"
    assert engine.stats().kv_blocks_used == 0
