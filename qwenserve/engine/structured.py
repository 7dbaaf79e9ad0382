"""Structured output: a grammar that every sampled token must keep the answer inside.

Built on llguidance, chosen by measurement (bench/grammar_mask_bench.py): on this CPU its per-row mask
costs less than xgrammar's, and its wheel brings no dependencies (xgrammar's brings triton and
transformers). A request names its constraint as a `StructuredOutput` (a JSON schema, any JSON object,
a regex, a choice of strings, or a Lark grammar); the engine keeps one matcher per request, masks the
request's logits row before sampling (constrained and free requests share a step), and feeds the
matcher every token the request gets. A finished grammar allows only the end-of-sequence tokens.

JSON is constrained to compact whitespace: a model that may emit whitespace forever between two
tokens could spend its whole budget there and never close the object.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwenserve.engine.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar larger than this is a mistake (and costly to compile)
# Bytes to bits, least significant first: how llguidance packs 32 tokens into each int32 of a mask.
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


class StructuredOutputError(RequestError):
    """A constraint that cannot be compiled, or a model that cannot take one; a client's 400."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One request's constraint: `kind` (one of KINDS) and its text (a JSON list of strings for choice)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"the {self.kind} is longer than {MAX_SPEC_CHARS} characters")

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint (not yet checked against a tokenizer)."""
        import llguidance

        compact = {"whitespace_flexible": False}
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError("a JSON schema must be an object (or true / false)")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
            except ValueError as e:
                raise StructuredOutputError(f"the JSON schema cannot be used: {e}") from None
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise StructuredOutputError("choice must be a non-empty list of strings")
            return llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices))
        return llguidance.LLMatcher.grammar_from_lark(self.spec)


def check_grammar(structured: StructuredOutput) -> str:
    """The grammar text, or StructuredOutputError saying what is wrong with it (no tokenizer needed)."""
    import llguidance

    grammar = structured.grammar()
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise StructuredOutputError(f"the {structured.kind.replace('_', ' ')} cannot be used: {problem}")
    return grammar


class GrammarBackend:
    """One model's grammar machinery: its vocabulary as llguidance sees it, and compiled constraints."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _llg_tokenizer(self) -> Any:
        with self._lock:  # built once, on the first constrained request (about a second)
            if self._tokenizer is None:
                import llguidance

                if not self._tokenizer_json.is_file():
                    raise StructuredOutputError(f"structured output needs the model's tokenizer.json "
                                                f"({self._tokenizer_json} is missing)")
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json.read_text(), n_vocab=self._vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer

    def matcher(self, structured: StructuredOutput) -> Any:
        """A fresh matcher for one request; StructuredOutputError when the constraint cannot be compiled."""
        import llguidance

        tokenizer = self._llg_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, compiled_grammar(structured), log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"the {structured.kind.replace('_', ' ')} cannot be used: "
                                        f"{matcher.get_error()}")
        return matcher

    def mask_rows(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Set to -inf, in place, every token the matcher of each of `rows` does not allow next."""
        words = (self._vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        for j, matcher in enumerate(matchers):
            view = bitmask[j]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), words * 4)
        allowed = _BITS[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, : logits.shape[1]]
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


@functools.lru_cache(maxsize=256)
def compiled_grammar(structured: StructuredOutput) -> str:
    """check_grammar, remembered by constraint: the same schema sent again is not converted again."""
    return check_grammar(structured)
