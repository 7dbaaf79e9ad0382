"""Incremental detokenization equals a full decode, and never emits half a character."""

from __future__ import annotations

import random

from tokenizers import Tokenizer as HFTokenizer

from qwenserve.tokenizer import BuiltinVocab, IncrementalDetokenizer, builtin_tokenizer_json


def _stream(tokenizer, ids, rng, skip=False):
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4)
        deltas.append(detokenizer.push(ids[i : i + step]))
        i += step
    deltas.append(detokenizer.flush())
    return deltas


def test_random_id_streams_equal_full_decode(qwen3_tokenizer):
    rng = random.Random(7)
    reference = HFTokenizer.from_file(str(builtin_tokenizer_json(BuiltinVocab.QWEN3)))
    for _ in range(300):
        ids = [rng.randrange(qwen3_tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (False, True):
            joined = "".join(_stream(qwen3_tokenizer, ids, rng, skip))
            assert joined == qwen3_tokenizer.decode(ids, skip_special_tokens=skip)
            assert joined == reference.decode(ids, skip_special_tokens=skip)


def test_characters_split_across_tokens_are_held_back_whole(qwen3_tokenizer, corpus):
    rng = random.Random(11)
    byte_tokens = list(range(256))  # single-byte tokens split every multi-byte character
    for text in corpus[:100]:
        data = text.encode("utf-8")
        byte_to_id = {qwen3_tokenizer.token_bytes(i)[0]: i for i in byte_tokens}
        ids = [byte_to_id[b] for b in data]
        deltas = _stream(qwen3_tokenizer, ids, rng)
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)


def test_a_stream_ending_inside_a_character_flushes_a_replacement_character(qwen3_tokenizer):
    first_byte_of_ni = next(i for i in range(256) if qwen3_tokenizer.token_bytes(i) == "你".encode()[:1])
    detokenizer = IncrementalDetokenizer(qwen3_tokenizer)
    assert detokenizer.push([first_byte_of_ni]) == ""
    assert detokenizer.pending
    assert detokenizer.flush() == "\ufffd"


def test_padding_ids_beyond_the_tokenizer_decode_to_nothing(qwen3_tokenizer):
    assert qwen3_tokenizer.id_limit == 151_936
    detokenizer = IncrementalDetokenizer(qwen3_tokenizer)
    assert detokenizer.push([151_900, 9707]) == "Hello"
