"""Tokenization for qwen-serve: built-in Qwen vocabularies, checkpoint tokenizers, chat templates,
incremental detokenization and input hygiene."""

from qwenserve.cache import cache_root
from qwenserve.tokenizer.builtin import BuiltinVocab, builtin_tokenizer_json
from qwenserve.tokenizer.detokenizer import IncrementalDetokenizer
from qwenserve.tokenizer.errors import ChatTemplateError, CheckpointError, InvalidInput, TokenizerError
from qwenserve.tokenizer.hygiene import InputLimits, clean_messages, clean_text, decode_utf8
from qwenserve.tokenizer.tokenizer import AddedToken, Tokenizer

__all__ = [
    "AddedToken",
    "BuiltinVocab",
    "ChatTemplateError",
    "CheckpointError",
    "IncrementalDetokenizer",
    "InputLimits",
    "InvalidInput",
    "Tokenizer",
    "TokenizerError",
    "builtin_tokenizer_json",
    "cache_root",
    "clean_messages",
    "clean_text",
    "decode_utf8",
]
