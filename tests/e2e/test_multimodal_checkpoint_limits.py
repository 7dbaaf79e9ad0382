"""A Qwen3.5 checkpoint in the multimodal layout Qwen ships (Qwen3_5ForConditionalGeneration: the language
model's max_position_embeddings only in text_config) served by `qwen-serve up`: every stage reads the same limit,
so /v1/models shows the context the engine serves, not a default the router guessed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenserve.tokenizer import builtin
from tests.support.ports import free_port

# More than the 4096 a router once assumed for a config without the key at its top level.
POSITIONS = 6144
ENV = {**os.environ, "QWENSERVE_KV_CACHE_GB": "0.05", "QWENSERVE_THREADS": "1", "QWENSERVE_KV_POOL_MIB": "16",
       "QWENSERVE_PROGRESS": "off"}


@pytest.fixture(scope="module")
def multimodal_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3.5 written by transformers, rewritten in the multimodal layout: config.json with the text
    model under text_config (and a vision_config), its weights under model.language_model."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    text_folder = tmp_path_factory.mktemp("models") / "qwen3_5-text"
    vocab = builtin.BuiltinVocab.QWEN3
    config = Qwen3_5TextConfig(
        vocab_size=vocab.value.model_vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
        max_position_embeddings=POSITIONS, tie_word_embeddings=True, eos_token_id=151645,
    )
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(text_folder)
    folder = tmp_path_factory.mktemp("models") / "qwen3_5-multimodal"
    folder.mkdir(exist_ok=True)
    text = json.loads((text_folder / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1},
               "tie_word_embeddings": True, "eos_token_id": 151645}
    assert "max_position_embeddings" not in wrapped
    (folder / "config.json").write_text(json.dumps(wrapped))
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(text_folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors")
    shutil.copyfile(builtin.builtin_tokenizer_json(vocab), folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(builtin.tokenizer_config(vocab)))
    return folder


def test_up_serves_a_multimodal_qwen3_5_checkpoint_with_the_context_of_its_text_config(
    multimodal_qwen3_5: Path,
) -> None:
    http = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwenserve.cli", "up", str(multimodal_qwen3_5), "--prefill", "0", "--port", str(http),
         "--grpc-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "ready" in line, line
        card = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10).read())["data"][0]
        assert card["max_model_len"] == POSITIONS, card
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
