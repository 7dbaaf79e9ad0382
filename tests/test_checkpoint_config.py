"""One reader of a checkpoint's config.json for every stage: a multimodal checkpoint's language model keys are in
text_config (Qwen3.5 as Qwen ships it), a text-only one's at the top level."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qwenserve.checkpoint_config import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    checkpoint_limits,
    language_model_config,
    read_config_json,
)
from qwenserve.models.config import ModelConfig


def _folder(tmp_path: Path, config: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_text_only_checkpoint_has_its_limits_at_the_top_level(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"model_type": "qwen3", "max_position_embeddings": 40960, "vocab_size": 151936})
    limits = checkpoint_limits(folder)
    assert (limits.max_position_embeddings, limits.vocab_size) == (40960, 151936)


def test_a_multimodal_checkpoint_has_its_limits_only_in_text_config(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": False,
        "text_config": {"model_type": "qwen3_5_text", "max_position_embeddings": 262144, "vocab_size": 248320,
                        "tie_word_embeddings": True},
        "vision_config": {"depth": 1},
    })
    limits = checkpoint_limits(folder)
    assert (limits.max_position_embeddings, limits.vocab_size) == (262144, 248320)
    text = language_model_config(read_config_json(folder))
    # The top level speaks for the whole model: its type and tied embeddings win over text_config's.
    assert text["model_type"] == "qwen3_5" and text["tie_word_embeddings"] is False and "vision_config" not in text


def test_a_config_without_positions_gets_the_engines_default_and_no_vocabulary(tmp_path: Path) -> None:
    limits = checkpoint_limits(_folder(tmp_path, {"model_type": "qwen3"}))
    assert (limits.max_position_embeddings, limits.vocab_size) == (DEFAULT_MAX_POSITION_EMBEDDINGS, None)


def test_the_engine_reads_the_same_positions_as_every_other_stage(tmp_path: Path) -> None:
    """models/config.py reads through the same reader: the engine's max_position_embeddings is the router's."""
    text = {"model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 6144,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 2}
    folder = _folder(tmp_path, {"model_type": "qwen3_5", "text_config": text})
    engine = ModelConfig.from_folder(folder)
    assert engine.max_position_embeddings == checkpoint_limits(folder).max_position_embeddings == 6144
    assert engine.weight_prefix == "model.language_model."


def test_a_folder_without_a_config_or_with_no_object_in_it_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        read_config_json(tmp_path)
    with pytest.raises(ValueError, match="not a JSON object"):
        read_config_json(_folder(tmp_path, [1, 2]))


def test_the_reader_imports_neither_torch_nor_grpc() -> None:
    code = ("import sys, qwenserve.checkpoint_config; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
