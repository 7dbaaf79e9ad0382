"""A hybrid linear-attention model (Qwen3.5 text: Gated DeltaNet layers and gated full attention) through
`qwen-serve up` with the real vocabulary: served colocated (no prefill worker), its greedy tokens through the router
equal transformers'; with a prefill worker (whose handoff cannot carry the linear-attention state yet) `qwen-serve up`
refuses to start, saying how to serve it."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from qwenserve.tokenizer import builtin
from qwenserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.conftest import make_cluster

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


def _reference(folder: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                 dtype=torch.long), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


async def _served(address: str) -> list[list[int]]:
    async def one(stub: router_pb2_grpc.RouterStub, prompt: list[int]) -> list[int]:
        request = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=prompt))
        request.sampling.max_tokens = NEW_TOKENS
        request.sampling.ignore_eos = True
        request.sampling.temperature = 0.0
        tokens: list[int] = []
        async for msg in stub.Generate(request, timeout=120):
            assert not msg.error.code, msg.error
            tokens += msg.token_ids
        return tokens

    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return list(await asyncio.gather(*(one(stub, p) for p in PROMPTS)))  # batched together


def test_a_hybrid_model_served_colocated_through_the_router_equals_transformers(hybrid_model: Path,
                                                                                 tmp_path: Path) -> None:
    # A 32-token step budget: the 84-token prompt is prefilled in three chunks, the state carried between them.
    env = {"QWENSERVE_MAX_NUM_BATCHED_TOKENS": "32", "QWENSERVE_DTYPE": "float32"}
    with make_cluster(hybrid_model, tmp_path, prefill=0, decode=1, env=env) as cluster:
        served = asyncio.run(_served(f"{cluster.host}:{cluster.router_port}"))
    assert served == _reference(hybrid_model)


def test_up_with_a_prefill_worker_refuses_a_hybrid_model_and_says_how_to_serve_it(hybrid_model: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "qwenserve.cli", "up", str(hybrid_model), "--prefill", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "hybrid linear-attention" in run.stderr and "--prefill 0" in run.stderr
