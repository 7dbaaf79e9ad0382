"""Structured output: a grammar that every sampled token must keep the answer inside.

Built on xgrammar, chosen by measurement (bench/grammar_mask_bench.py; figures in the README's benchmark
section): of the three libraries measured, its token mask costs least per row, and a schema it has not seen
compiles far sooner than with outlines-core (once per distinct schema). A
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
from dataclasses import dataclass
from typing import Any

from qwenserve.engine.errors import RequestError
from qwenserve.untrusted_input import JsonRefused, read_json

KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar larger than this is a mistake (and costly to compile)
COMPACT = {"any_whitespace": False, "separators": (",", ":")}


class StructuredOutputError(RequestError):
    """A constraint that cannot be compiled, or a model that cannot take one; a client's 400."""


class GrammarLimitExceeded(StructuredOutputError):
    """A constraint beyond one of this server's bounds (size, compile time or memory, mask cost); `limit` is the
    flag that sets it (the message ends by naming it). A client's 400, never the worker's fault."""

    def __init__(self, reason: str, limit: str) -> None:
        super().__init__(f"{reason} ({limit})")
        self.limit = limit


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one request's constraint may cost a worker (EngineConfig's --max-grammar-* and --grammar-* flags)."""

    max_chars: int = 262144
    max_choices: int = 4096
    compile_timeout_s: float = 10.0
    compile_memory_bytes: int = 1 << 30
    cache_bytes: int = 512 << 20
    compile_processes: int = 2
    mask_budget_s: float = 0.1

    def check_size(self, structured: StructuredOutput) -> None:
        """GrammarLimitExceeded for a constraint too large to be worth compiling: checked before any work."""
        if structured.kind == "choice":  # counted first: for a long list, the count is what to change
            count = len(structured.choices())
            if count > self.max_choices:
                raise GrammarLimitExceeded(f"choice lists {count} strings, more than this server's limit of "
                                           f"{self.max_choices}", "--max-grammar-choices")
        if len(structured.spec) > self.max_chars:
            raise GrammarLimitExceeded(
                f"the {structured.what} is {len(structured.spec)} characters, more than this server's limit of "
                f"{self.max_chars}", "--max-grammar-chars")


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

    def choices(self) -> list[str]:
        """A choice constraint's strings; StructuredOutputError unless they are a non-empty list of them."""
        try:
            choices = json.loads(self.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        return choices

    def ebnf(self) -> str:
        """The constraint as an EBNF grammar (choice and json_object; the others compile from their own form)."""
        if self.kind == "choice":
            return "root ::= " + " | ".join(json.dumps(c) for c in self.choices())
        return self.spec


@dataclass(frozen=True, slots=True)
class ReasoningFirst:
    """A thinking model's constrained answer: its reasoning block (opened by `start_id` as the first token, or
    already open in the prompt) is free text, and the grammar applies from the token after `end_id`."""

    start_id: int
    end_id: int
    open_in_prompt: bool = False


def check_grammar(structured: StructuredOutput) -> Any:
    """The constraint parsed into an xgrammar Grammar (no tokenizer needed), or StructuredOutputError saying
    what is wrong with it."""
    import xgrammar

    try:
        if structured.kind == "json_schema":
            # The bounded reader first: xgrammar's own parser recurses once per level of nesting.
            schema = read_json(structured.spec, "the JSON schema", max_bytes=MAX_SPEC_CHARS)
            if not isinstance(schema, dict | bool):
                raise StructuredOutputError("a JSON schema must be an object (or true / false)")
            return xgrammar.Grammar.from_json_schema(structured.spec, **COMPACT)
        if structured.kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', **COMPACT)
        if structured.kind == "regex":
            return xgrammar.Grammar.from_regex(structured.spec)
        return xgrammar.Grammar.from_ebnf(structured.ebnf())
    except JsonRefused as e:
        raise StructuredOutputError(e.message) from None
    except ValueError as e:
        raise StructuredOutputError(f"the {structured.what} is not valid JSON: {e}") from None
    except RuntimeError as e:  # xgrammar's parse errors: keep the message, drop its source location
        raise StructuredOutputError(f"the {structured.what} cannot be used: {str(e).split(': ', 1)[-1]}") from None


@functools.lru_cache(maxsize=256)
def compiled_grammar(structured: StructuredOutput) -> Any:
    """check_grammar, remembered by constraint: the same schema sent again is not parsed again."""
    return check_grammar(structured)
