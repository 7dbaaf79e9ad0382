"""Structured output: a grammar that every sampled token must keep the answer inside.

Built on xgrammar, chosen by measurement (bench/grammar_mask_bench.py, on this 2-core CPU with the Qwen
vocabulary): its token mask costs about 6 us a row at batch 32 (llguidance 65, outlines-core 6) and
about 35 us a row inside the engine on random-weight answers (llguidance about 600); a schema it has
not seen compiles in about 45 ms (llguidance 1 ms, outlines-core 7.5 s), once per distinct schema. A
request names its constraint as a `StructuredOutput` (a JSON schema, any JSON object, a regex, a
choice of strings, or an EBNF grammar in xgrammar's dialect, as vLLM's guided_grammar); the engine
keeps one matcher per request, masks the request's logits row before sampling (constrained and free
requests share a step), and feeds the matcher every token the request gets. A finished grammar allows
only the end-of-sequence tokens.

JSON is constrained to compact whitespace: a model that may emit whitespace forever between two
tokens could spend its whole budget there and never close the object.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwenserve import cpu_kernels
from qwenserve.engine.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar larger than this is a mistake (and costly to compile)
COMPACT = {"any_whitespace": False, "separators": (",", ":")}
# Bytes to bits, least significant first: how the mask packs 32 tokens into each int32 (the PyTorch path).
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

    @property
    def what(self) -> str:
        return {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
                "ebnf": "grammar"}[self.kind]

    def ebnf(self) -> str:
        """The constraint as an EBNF grammar (choice and json_object; the others compile from their own form)."""
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
            return "root ::= " + " | ".join(json.dumps(c) for c in choices)
        return self.spec


def check_grammar(structured: StructuredOutput) -> Any:
    """The constraint parsed into an xgrammar Grammar (no tokenizer needed), or StructuredOutputError saying
    what is wrong with it."""
    import xgrammar

    try:
        if structured.kind == "json_schema":
            schema = json.loads(structured.spec)
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError("a JSON schema must be an object (or true / false)")
            return xgrammar.Grammar.from_json_schema(structured.spec, **COMPACT)
        if structured.kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', **COMPACT)
        if structured.kind == "regex":
            return xgrammar.Grammar.from_regex(structured.spec)
        return xgrammar.Grammar.from_ebnf(structured.ebnf())
    except ValueError as e:
        raise StructuredOutputError(f"the {structured.what} is not valid JSON: {e}") from None
    except RuntimeError as e:  # xgrammar's parse errors: keep the message, drop its source location
        raise StructuredOutputError(f"the {structured.what} cannot be used: {str(e).split(': ', 1)[-1]}") from None


@functools.lru_cache(maxsize=256)
def compiled_grammar(structured: StructuredOutput) -> Any:
    """check_grammar, remembered by constraint: the same schema sent again is not parsed again."""
    return check_grammar(structured)


class GrammarBackend:
    """One model's grammar machinery: its vocabulary as xgrammar sees it, and compiled constraints."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._compiled: dict[StructuredOutput, Any] = {}

    def _grammar_compiler(self) -> Any:
        with self._lock:  # built once, on the first constrained request (a second or two)
            if self._compiler is None:
                import transformers
                import xgrammar

                if not self._tokenizer_json.is_file():
                    raise StructuredOutputError(f"structured output needs the model's tokenizer.json "
                                                f"({self._tokenizer_json} is missing)")
                hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(self._tokenizer_json))
                info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self._vocab_size,
                                                               stop_token_ids=self._eos)
                self._compiler = xgrammar.GrammarCompiler(info)
            return self._compiler

    def matcher(self, structured: StructuredOutput) -> Any:
        """A fresh matcher for one request; StructuredOutputError when the constraint cannot be compiled."""
        import xgrammar

        compiler = self._grammar_compiler()
        compiled = self._compiled.get(structured)
        if compiled is None:
            try:
                compiled = compiler.compile_grammar(compiled_grammar(structured))
            except RuntimeError as e:
                raise StructuredOutputError(f"the {structured.what} cannot be compiled: {e}") from None
            if len(self._compiled) >= 256:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[structured] = compiled
        return xgrammar.GrammarMatcher(compiled)

    def mask_rows(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
        """Set to -inf, in place, every token the matcher of each of `rows` does not allow next."""
        words = (self._vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        for j, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, j)
        index = torch.tensor(rows, dtype=torch.int64)
        if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1 and \
                cpu_kernels.available():
            cpu_kernels.apply_token_bitmask(logits, index, bitmask)
            return
        allowed = _BITS[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, : logits.shape[1]]
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))
