"""Chat templates render exactly as transformers' apply_chat_template, for 4.x and 5.x checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from qwenserve.tokenizer import BuiltinVocab, ChatTemplateError, Tokenizer, builtin_tokenizer_json
from qwenserve.tokenizer.builtin import tokenizer_config

QWEN3_STYLE_TEMPLATE = (Path(__file__).parent / "qwen3_style_template.jinja").read_text()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = {
    "one_user_turn": [{"role": "user", "content": "Bonjour, ça va? 你好 👋"}],
    "multi_turn_with_reasoning": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding.\n"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Again."},
    ],
    "tools_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "content": "18°C", "tool_call_id": "a"},
        {"role": "tool", "content": "3°C", "tool_call_id": "b"},
        {"role": "assistant", "content": "Paris 18°C, Oslo 3°C."},
    ],
}

OPTIONS = [
    {"add_generation_prompt": False},
    {"add_generation_prompt": True},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": True, "enable_thinking": True},
]


def _write_v4_checkpoint(folder: Path, template: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(builtin_tokenizer_json(BuiltinVocab.QWEN3), folder / "tokenizer.json")
    config = {**tokenizer_config(BuiltinVocab.QWEN3), "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["default", "qwen3_style"])
def checkpoint(request, tmp_path_factory) -> tuple[Tokenizer, object]:
    template = tokenizer_config()["chat_template"] if request.param == "default" else QWEN3_STYLE_TEMPLATE
    folder = _write_v4_checkpoint(tmp_path_factory.mktemp(request.param), template)
    return Tokenizer.from_dir(folder), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_rendering_equals_transformers_apply_chat_template(checkpoint, name, options):
    ours, theirs = checkpoint
    messages = CONVERSATIONS[name]
    tools = TOOLS if name == "tools_round_trip" else None
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, **options)
    assert ours.apply_chat_template(messages, tools=tools, **options) == expected


def test_tools_can_be_offered_on_a_plain_conversation(checkpoint):
    ours, theirs = checkpoint
    messages = CONVERSATIONS["one_user_turn"]
    expected = theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    rendered = ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    assert rendered == expected and '"Weather <now> & later for a city"' in rendered


def test_default_template_puts_thinking_switch_and_roles_where_qwen3_does():
    tokenizer = Tokenizer.builtin()
    text = tokenizer.apply_chat_template(
        CONVERSATIONS["one_user_turn"], add_generation_prompt=True, enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.encode(text)
    assert ids[0] == 151644 and ids[-1] == 271 and 151667 in ids


def test_a_template_raise_exception_becomes_chat_template_error():
    with pytest.raises(ChatTemplateError, match="only allowed at the start"):
        Tokenizer.builtin().apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )


def test_transformers_5_checkpoint_with_separate_template_file_loads(tmp_path, qwen3_tokenizer):
    backend = transformers.TokenizersBackend(
        tokenizer_file=str(builtin_tokenizer_json(BuiltinVocab.QWEN3)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    backend.chat_template = QWEN3_STYLE_TEMPLATE
    backend.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend" and "chat_template" not in config
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.chat_template == QWEN3_STYLE_TEMPLATE
    assert loaded.eos_token_ids == [151645] and loaded.backend == "tiktoken"
    messages = CONVERSATIONS["multi_turn_with_reasoning"]
    assert loaded.apply_chat_template(messages) == backend.apply_chat_template(messages, tokenize=False)
    text = "Grüße, 世界! \r\n\t 12345"
    assert (
        loaded.encode(text) == qwen3_tokenizer.encode(text) == backend.encode(text, add_special_tokens=False)
    )
