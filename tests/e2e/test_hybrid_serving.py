"""A hybrid linear-attention model (Qwen3.5 text: Gated DeltaNet layers and gated full attention) through
`qwen-serve up` with the real vocabulary: its greedy tokens through the router equal transformers', served
colocated (no prefill worker) and disaggregated (the handoff carrying the full-attention KV and the linear-attention
state from the prefill worker to the decode worker), where a repeated prompt resumes from the prefill worker's
prefix cache and its kept state, and where a decode pool too small for the batch preempts handed-off sequences,
which recompute their state from their tokens."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch

from qwenserve.kv_layout import KVLayout
from qwenserve.tokenizer import builtin
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.clusters import make_cluster
from tests.support.metrics import scrape, total

PROMPTS = [[9707, 11, 1879, 0] * 5, [785, 6722, 315, 9625, 374, 12095, 13] * 12, [40, 1079]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3.5 (text) checkpoint written by transformers, with the real Qwen3 tokenizer files."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    folder = tmp_path_factory.mktemp("models") / "qwen3_5-e2e"
    vocab = builtin.BuiltinVocab.QWEN3
    config = Qwen3_5TextConfig(
        vocab_size=vocab.value.model_vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
        max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=151645,
    )
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # large enough that greedy tokens vary from step to step
    model.save_pretrained(folder)
    shutil.copyfile(builtin.builtin_tokenizer_json(vocab), folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(builtin.tokenizer_config(vocab)))
    return folder


def _reference(folder: Path, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                 dtype=torch.long), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


async def _one(stub: router_pb2_grpc.RouterStub, prompt: list[int],
               new_tokens: int = NEW_TOKENS) -> tuple[list[int], int]:
    """The greedy tokens, and the prompt tokens served from the prefix cache."""
    request = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=prompt))
    request.sampling.max_tokens = new_tokens
    request.sampling.ignore_eos = True
    request.sampling.temperature = 0.0
    tokens: list[int] = []
    cached = 0
    async for msg in stub.Generate(request, timeout=120):
        assert not msg.error.code, msg.error
        tokens += msg.token_ids
        cached = max(cached, msg.usage.cached_prompt_tokens)
    return tokens, cached


async def _served(address: str, again: list[int] | None = None,
                  new_tokens: int = NEW_TOKENS) -> tuple[list[list[int]], int]:
    """PROMPTS batched together; then, if given, `again` alone: (their tokens in order, `again`'s cached tokens)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        served = [tokens for tokens, _ in await asyncio.gather(*(_one(stub, p, new_tokens) for p in PROMPTS))]
        if again is None:
            return served, 0
        tokens, cached = await _one(stub, again)
        return [*served, tokens], cached


def test_a_hybrid_model_served_colocated_through_the_router_equals_transformers(hybrid_model: Path,
                                                                                 tmp_path: Path) -> None:
    # A 32-token step budget: the 84-token prompt is prefilled in three chunks, the state carried between them.
    env = {"QWENSERVE_MAX_NUM_BATCHED_TOKENS": "32", "QWENSERVE_DTYPE": "float32"}
    with make_cluster(hybrid_model, tmp_path, prefill=0, decode=1, env=env) as cluster:
        served, _ = asyncio.run(_served(f"{cluster.host}:{cluster.router_port}"))
    assert served == _reference(hybrid_model)


def test_a_hybrid_model_disaggregated_hands_off_its_state_and_equals_transformers(hybrid_model: Path,
                                                                                    tmp_path: Path) -> None:
    # The prefill worker computes the 84-token prompt in three chunks and hands the KV and state to decode; it
    # keeps the state every 32 tokens, so the same prompt again resumes at 64 from its prefix cache.
    env = {"QWENSERVE_MAX_NUM_BATCHED_TOKENS": "32", "QWENSERVE_DTYPE": "float32",
           "QWENSERVE_STATE_SNAPSHOT_TOKENS": "32"}
    with make_cluster(hybrid_model, tmp_path, prefill=1, decode=1, env=env) as cluster:
        served, cached = asyncio.run(_served(f"{cluster.host}:{cluster.router_port}", again=PROMPTS[1]))
        handed = total(scrape(cluster.child("decode-0").metrics_port), "qwenserve_handoff_bytes_total")
        failed = total(scrape(cluster.child("decode-0").metrics_port), "qwenserve_handoff_failures_total")
    want = _reference(hybrid_model)
    assert served == [*want, want[1]]
    assert cached == 64
    # Every prompt came through a handoff of its KV (2 full-attention layers) and its state (2 linear layers).
    layout = KVLayout("float32", 16, num_layers=2, num_kv_heads=2, head_dim=16, model_fingerprint="", linear_layers=2,
                      linear_conv_dim=2 * 2 * 16 + 4 * 8, linear_conv_width=3, linear_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=8)
    assert failed == 0
    assert handed == sum(layout.nbytes(len(p)) for p in [*PROMPTS, PROMPTS[1]])


def test_handed_off_hybrid_sequences_preempted_on_a_small_decode_pool_recompute_exactly(hybrid_model: Path,
                                                                                         tmp_path: Path) -> None:
    # 40 new tokens each: 60, 124 and 42 tokens at the end, 15 blocks of 16 together, 8 for the longest alone. The
    # workers get 9 blocks (4 state slots of 6,400 bytes first, no snapshots), so decode must preempt one of the
    # handed-off sequences; it comes back by recomputing its prompt and tokens, its state rebuilt from zero.
    new_tokens = 40
    state_bytes, block_bytes = 4 * 6400, 2 * 2 * 16 * 2 * 16 * 4
    env = {"QWENSERVE_DTYPE": "float32", "QWENSERVE_MAX_NUM_SEQS": "4", "QWENSERVE_STATE_SNAPSHOT_TOKENS": "0",
           "QWENSERVE_KV_CACHE_GB": f"{(state_bytes + 9 * block_bytes + 64) / 2**30:.10f}"}
    want = _reference(hybrid_model, new_tokens)
    with make_cluster(hybrid_model, tmp_path, prefill=1, decode=1, env=env) as cluster:
        # The three overlap in decode only if their handoffs arrive close together; on a machine busy with other
        # tests one may finish first, and then nothing needs preempting: the batch is sent again (every answer
        # is checked), at most three times.
        for _ in range(3):
            served, _ = asyncio.run(_served(f"{cluster.host}:{cluster.router_port}", new_tokens=new_tokens))
            assert served == want
            metrics = scrape(cluster.child("decode-0").metrics_port)
            if total(metrics, "qwenserve_engine_preemptions_total") > 0:
                break
        preempted = total(metrics, "qwenserve_engine_preemptions_total")
        failed = total(metrics, "qwenserve_handoff_failures_total")
    assert preempted > 0, "the decode pool was large enough for the whole batch: nothing was preempted"
    assert failed == 0


