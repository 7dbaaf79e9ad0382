"""The built-in default model: same bytes every time, loads in transformers, real Qwen vocabulary."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch
import transformers

from qwenserve.default_model import DEFAULT_CONFIG, default_model_dir, ensure_default_model, write_checkpoint
from qwenserve.tokenizer import Tokenizer

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 256,
}


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def default_model(qwenserve_cache):
    return ensure_default_model()


def test_default_model_has_the_same_bytes_each_time_it_is_written(default_model, tmp_path):
    assert default_model == default_model_dir()
    again = write_checkpoint(tmp_path / "again", DEFAULT_CONFIG)
    assert _digests(default_model) == _digests(again)
    assert set(_digests(again)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert ensure_default_model() == default_model  # written once, found after


def test_default_model_loads_in_transformers_with_every_weight(default_model):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(default_model, output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.vocab_size == 151936 and model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == [151645, 151643]
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198]])).logits
    assert logits.shape == (1, 3, 151936) and torch.isfinite(logits).all()


def test_default_model_tokenizer_is_the_builtin_one(default_model, qwen3_tokenizer):
    loaded = Tokenizer.from_dir(default_model)
    assert loaded.special_tokens == qwen3_tokenizer.special_tokens
    assert loaded.eos_token_ids == [151645, 151643] and loaded.id_limit == 151936
    assert loaded.chat_template == qwen3_tokenizer.chat_template


@pytest.mark.parametrize(
    "extra",
    [
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
        {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
        {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    ],
    ids=lambda e: e["model_type"],
)
def test_write_checkpoint_makes_tiny_models_of_each_family(tmp_path, extra):
    folder = write_checkpoint(tmp_path / extra["model_type"], {**TINY, **extra}, seed=3, dtype="bfloat16")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.bfloat16


def test_cli_prints_the_model_folder(default_model):
    out = subprocess.run(
        [sys.executable, "-m", "qwenserve.cli", "model", "path"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == str(default_model)
