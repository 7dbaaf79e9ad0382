"""A hybrid model's handoff between engines: the KV of its full-attention layers and its linear-attention state go
into one handoff under one checksum, and the decode engine continues with transformers' greedy tokens: prompts
longer than a prefill chunk, several of different lengths decoding together, and after a preemption."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from qwenserve.engine.kv_handoff import KVImport
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.kv_layout import KVLayout, KVLayoutMismatch, LinearState
from qwenserve.kv_transfer import ExporterConfig, KVExporter, KVTransport, compute_checksum
from qwenserve.protocol import kv_layout_from_proto, kv_layout_to_proto
from tests.support.engine_checkpoints import random_prompts

HYBRIDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]
TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
# Up to 150 tokens: several prefill chunks of 32, and more than one chunk (64) of the chunked delta rule.
PROMPTS = random_prompts(4, 5, 150, seed=31)


@pytest.fixture
def exporter() -> Iterator[KVExporter]:
    config = ExporterConfig(transport=KVTransport.KV_TRANSPORT_GRPC, control_endpoint="127.0.0.1:1", use_shm=False,
                            pool_bytes=8 << 20)
    with KVExporter(config) as exporter:
        yield exporter
        assert exporter.counters().outstanding == 0


def hand_off(prefill, exporter: KVExporter, name: str, prompt: list[int]) -> tuple[int, KVImport, int]:
    """Prefill `prompt` into a published handoff, then read it back from the exporter's bytes as a decode worker
    does: (first token, the import, bytes handed off)."""
    slots = []

    def sink(layout: KVLayout, num_tokens: int) -> object:
        slots.append(exporter.reserve(name, layout, num_tokens))
        return slots[-1]

    outs = prefill.generate_sync_outputs([prompt], GREEDY, kv_export=sink)[0]
    assert outs[-1].finish_reason == "export"
    handle = slots[0].publish(lease_s=30)
    layout = kv_layout_from_proto(handle.layout)
    with exporter.pinned(name) as payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    exporter.release(name)
    assert handle.checksum == compute_checksum(data)  # one checksum over the KV and the state
    assert data.numel() == handle.length == layout.kv_nbytes(len(prompt)) + layout.state_nbytes
    kv, state = layout.split(data, len(prompt))
    return outs[0].new_token_ids[0], KVImport(kv, prefill.kv_layout(), state), handle.length


async def decode_all(decode, imports: list[tuple[list[int], int, KVImport]]) -> list[list[int]]:
    """Every import resumed at once, so their decodes share steps."""

    async def run(i: int, prompt: list[int], first: int, handed: KVImport) -> list[int]:
        tokens = [first]
        async for out in decode.generate(f"d{i}", prompt, GREEDY, resume_token_ids=[first], kv_import=handed):
            tokens += out.new_token_ids
        return tokens

    return await asyncio.gather(*(run(i, *item) for i, item in enumerate(imports)))


@pytest.mark.parametrize("name", HYBRIDS)
async def test_handoff_carries_kv_and_linear_state_and_decode_continues_exactly(name, make_engine, reference,
                                                                                 exporter):
    prefill = make_engine(name, block_size=8, max_num_batched_tokens=32)  # prompts prefilled in chunks
    decode = make_engine(name, block_size=16)  # block sizes may differ: the KV travels token-major
    imports = []
    for i, prompt in enumerate(PROMPTS):
        first, handed, nbytes = hand_off(prefill, exporter, f"{name}-{i}", prompt)
        assert handed.state is not None and nbytes > handed.layout.kv_nbytes(len(prompt))
        imports.append((prompt, first, handed))
    expected = [reference(name, prompt, TOKENS)[0] for prompt in PROMPTS]
    assert await decode_all(decode, imports) == expected
    assert decode.stats().prefix_cache_hit_tokens == 0
    for engine in (prefill, decode):
        assert engine.wait_until_idle(timeout=30)
        assert engine.states.num_free == engine.states.num_slots


async def test_imports_preempted_in_a_small_pool_are_recomputed_exactly(make_engine, reference, exporter):
    name = "qwen3_5"
    prefill = make_engine(name, block_size=8)
    # 10 blocks of 8 tokens: each request needs 3-4 of them, so the four cannot all keep decoding.
    decode = make_engine(name, num_kv_blocks=10, block_size=8, admission_watermark=0.0, max_num_batched_tokens=32)
    prompts = random_prompts(4, 14, 20, seed=4)
    sampling_tokens = 16
    imports = [(prompt, *hand_off(prefill, exporter, f"p{i}", prompt)[:2]) for i, prompt in enumerate(prompts)]

    async def run(i: int, prompt: list[int], first: int, handed: KVImport) -> list[int]:
        tokens = [first]
        params = SamplingParams(temperature=0.0, max_tokens=sampling_tokens, ignore_eos=True)
        async for out in decode.generate(f"d{i}", prompt, params, resume_token_ids=[first], kv_import=handed):
            tokens += out.new_token_ids
        return tokens

    got = await asyncio.gather(*(run(i, *item) for i, item in enumerate(imports)))
    assert got == [reference(name, prompt, sampling_tokens)[0] for prompt in prompts]
    assert decode.stats().preemptions > 0


def test_an_import_without_state_or_with_the_wrong_state_is_refused(make_engine, exporter):
    name = "qwen3_next"
    prefill, decode = make_engine(name), make_engine(name)
    prompt = PROMPTS[0]
    first, handed, _ = hand_off(prefill, exporter, "h", prompt)
    resume = {"resume_token_ids": [first]}
    with pytest.raises(KVLayoutMismatch, match="carries its linear-attention state with the KV"):
        decode.generate_sync([prompt], GREEDY, kv_import=KVImport(handed.kv, handed.layout), **resume)
    wrong = LinearState(conv=handed.state.conv, recurrent=handed.state.recurrent[:, :1])
    with pytest.raises(KVLayoutMismatch, match="recurrent state is torch.float32"):
        decode.generate_sync([prompt], GREEDY, kv_import=KVImport(handed.kv, handed.layout, wrong), **resume)
    # The state is that after the last token handed off: it cannot be rewound to compute that token again.
    with pytest.raises(KVLayoutMismatch, match="must leave at least the last token"):
        decode.generate_sync([prompt], GREEDY, kv_import=handed)


def test_a_dense_model_refuses_state_and_a_hybrid_export_needs_a_target(make_engine, exporter):
    dense, hybrid = make_engine("qwen3_gqa4"), make_engine("qwen3_5")
    prompt = PROMPTS[1]
    layout = dense.kv_layout()
    assert not layout.has_linear_state and layout.nbytes(7) == layout.kv_nbytes(7)
    kv = torch.zeros(layout.token_shape(3), dtype=layout.torch_dtype())
    state = LinearState(torch.zeros(1), torch.zeros(1))
    with pytest.raises(KVLayoutMismatch, match="model without linear-attention layers"):
        dense.generate_sync([prompt], GREEDY, kv_import=KVImport(kv, layout, state))
    hybrid_layout = hybrid.kv_layout()
    with pytest.raises(KVLayoutMismatch, match="linear_layers"):
        hybrid_layout.check_accepts(layout)
    outs = hybrid.generate_sync_outputs(
        [prompt], GREEDY, kv_export=lambda lay, n: torch.empty(lay.token_shape(n), dtype=lay.torch_dtype()))[0]
    assert outs[-1].finish_reason == "error" and "needs a KVExportTarget" in outs[-1].error


def test_layout_round_trips_its_linear_fields_through_the_wire(make_engine):
    layout = make_engine("qwen3_next").kv_layout()
    assert layout.has_linear_state
    assert kv_layout_from_proto(kv_layout_to_proto(layout)) == layout
    with pytest.raises(ValueError, match="linear_value_heads must be >= 1"):
        KVLayout("float32", 8, 1, 2, 16, "f", linear_layers=3, linear_conv_dim=4, linear_conv_width=3,
                 linear_value_heads=0, linear_key_head_dim=8, linear_value_head_dim=8)
