"""kv_export from one engine and kv_import into another give the tokens of an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from qwenserve.engine.kv_handoff import KVImport
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.kv_layout import KVLayout, KVLayoutMismatch
from qwenserve.kv_transfer import ExporterConfig, KVExporter, KVTransport, compute_checksum
from tests.support.engine_checkpoints import random_prompts


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
])
def test_export_then_import_into_a_second_engine_continues_identically(make_engine, sampling):
    prefill = make_engine("qwen3_untied", block_size=8)
    decode = make_engine("qwen3_untied", block_size=16)  # block sizes may differ: KV travels token-major
    prompts = random_prompts(2, 19, 37, seed=21)
    uninterrupted = decode.generate_sync(prompts, sampling)
    buffers: dict[int, torch.Tensor] = {}

    def sink(layout: KVLayout, num_tokens: int) -> torch.Tensor:
        buffers[num_tokens] = torch.empty(layout.token_shape(num_tokens), dtype=layout.torch_dtype())
        return buffers[num_tokens]

    for prompt, expected in zip(prompts, uninterrupted, strict=True):
        outs = prefill.generate_sync_outputs([prompt], sampling, kv_export=sink)[0]
        assert outs[-1].finish_reason == "export"
        first = [t for o in outs for t in o.new_token_ids]
        assert first == expected[:1]
        handed = KVImport(buffers[len(prompt)], prefill.kv_layout())
        rest = decode.generate_sync([prompt], sampling, resume_token_ids=first, kv_import=handed)[0]
        assert first + rest == expected
    assert prefill.stats().kv_blocks_used == 0


def test_a_handoff_slot_takes_the_cache_directly_and_is_hashed_as_it_lands(make_engine):
    engine = make_engine("qwen3_untied", block_size=8)
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = random_prompts(1, 45, 45, seed=3)[0]  # blocks of 8: the gather crosses six of them
    copied: list[torch.Tensor] = []

    def tensor_sink(layout: KVLayout, num_tokens: int) -> torch.Tensor:
        copied.append(torch.empty(layout.token_shape(num_tokens), dtype=layout.torch_dtype()))
        return copied[-1]

    config = ExporterConfig(transport=KVTransport.KV_TRANSPORT_GRPC, control_endpoint="127.0.0.1:1", use_shm=False,
                            pool_bytes=1 << 20)
    with KVExporter(config) as exporter:
        slots = []

        def slot_sink(layout: KVLayout, num_tokens: int) -> object:
            slots.append(exporter.reserve("h1", layout, num_tokens))
            return slots[-1]

        engine.generate_sync_outputs([prompt], sampling, kv_export=tensor_sink)
        outs = engine.generate_sync_outputs([prompt], sampling, kv_export=slot_sink)[0]
        assert outs[-1].finish_reason == "export"
        assert torch.equal(slots[0].tensor, copied[0])
        handle = slots[0].publish(lease_s=5)
        assert handle.checksum == compute_checksum(copied[0].contiguous().view(-1).view(torch.uint8))
        exporter.release("h1")
    assert engine.stats().kv_blocks_used == 0


def test_import_with_a_different_model_is_refused(make_engine):
    engine = make_engine("qwen3_gqa4")
    other = make_engine("qwen2_bias")
    prompt = [1, 2, 3, 4]
    layout = other.kv_layout()
    kv = torch.zeros(layout.token_shape(4))
    with pytest.raises(KVLayoutMismatch, match="model_fingerprint"):
        engine.generate_sync([prompt], SamplingParams(max_tokens=2), kv_import=KVImport(kv, layout))
    wrong_shape = torch.zeros(engine.kv_layout().token_shape(4))[:, :, :, :, :8]
    with pytest.raises(KVLayoutMismatch, match="shape"):
        engine.generate_sync([prompt], SamplingParams(max_tokens=2), kv_import=KVImport(wrong_shape, engine.kv_layout()))


def test_fingerprint_is_stable_for_the_same_checkpoint(make_engine):
    assert make_engine("qwen3_gqa4").kv_layout() == make_engine("qwen3_gqa4", block_size=8).kv_layout()
