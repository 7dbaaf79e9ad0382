"""Tokenization for qwen-serve: built-in Qwen vocabularies, checkpoint tokenizers, chat templates,
incremental detokenization and input hygiene."""

from qwenserve.tokenizer.builtin import BuiltinVocab, builtin_tokenizer_json
from qwenserve.tokenizer.detokenizer import IncrementalDetokenizer
from qwenserve.tokenizer.errors import ChatTemplateError, InvalidInput, TokenizerError
from qwenserve.tokenizer.hygiene import InputLimits, clean_messages, clean_text, decode_utf8
from qwenserve.tokenizer.tokenizer import Tokenizer

__all__ = [
    "BuiltinVocab",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "InputLimits",
    "InvalidInput",
    "Tokenizer",
    "TokenizerError",
    "builtin_tokenizer_json",
    "clean_messages",
    "clean_text",
    "decode_utf8",
]
