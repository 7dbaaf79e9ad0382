"""Request intake: a request checked against what this engine can serve, and made a Sequence.

Everything a client can get wrong is refused here, before the request reaches the compute loop, with a
RequestError subclass whose message says what to change (a 400 at the service edge).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from qwenserve.engine.errors import (
    ContextLengthExceededError,
    EmptyPromptError,
    InvalidTokenError,
    RequestError,
)
from qwenserve.engine.grammar import GrammarBackend
from qwenserve.engine.kv_handoff import KVExportSink, KVImport
from qwenserve.engine.outputs import RequestOutput
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.sequence import Sequence
from qwenserve.engine.structured import StructuredOutputError
from qwenserve.kv_layout import KVLayout


class RequestIntake:
    """Checks requests against the model's vocabulary, max_model_len, the grammar backend and the KV layout."""

    def __init__(self, vocab_size: int, max_model_len: int, grammar: GrammarBackend, layout: KVLayout) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammar = grammar
        self.layout = layout

    def sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        cache_salt: str | None = None,
        resume_token_ids: Seq[int] = (),
        kv_import: KVImport | None = None,
        kv_export: KVExportSink | None = None,
        emit: Callable[[RequestOutput], None] | None = None,
    ) -> Sequence:
        """The request as a Sequence, or a RequestError saying why it cannot run here."""
        if not prompt_token_ids:
            raise EmptyPromptError("the prompt has no tokens; send at least one token id")
        tokens = [int(t) for t in prompt_token_ids] + [int(t) for t in resume_token_ids]
        vocab = self.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidTokenError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        # The sampler indexes logits with them (min_tokens masks them): one out of range would fail every step.
        bad = next((t for t in sampling.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidTokenError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        prompt_len = len(prompt_token_ids)
        if prompt_len >= self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt has {prompt_len} tokens; max_model_len is {self.max_model_len} (room for output needed)"
            )
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds max_model_len ({self.max_model_len}); "
                "shorten the prompt or lower max_tokens"
            )
        # No KV check: max_model_len fits in the cache (checked at start), so a request within it can always run.
        if len(resume_token_ids) >= max_tokens:
            raise RequestError(f"{len(resume_token_ids)} resume tokens already reach max_tokens ({max_tokens})")
        if kv_import is not None:
            kv_import.check_fits(self.layout, len(tokens))
        return Sequence(
            request_id=request_id,
            prompt_len=prompt_len,
            token_ids=tokens,
            sampling=sampling,
            max_tokens=max_tokens,
            emit=emit or (lambda out: None),
            cache_salt=cache_salt,
            kv_import=kv_import,
            kv_export=kv_export,
            grammar=self._grammar_for(sampling, resume_token_ids),
        )

    def _grammar_for(self, sampling: SamplingParams, resume_token_ids: Seq[int]) -> Any:
        """The request's structured-output matcher, advanced past the tokens it already has (a handoff's first
        token, a failover's resumed ones); None for free text. StructuredOutputError: a 400 for the client."""
        if sampling.structured is None:
            return None
        first = sampling.reasoning_first
        if first is not None and max(first.start_id, first.end_id) >= self.vocab_size:
            raise StructuredOutputError("reasoning_first names a token outside the vocabulary")
        matcher = self.grammar.matcher_for(sampling.structured, first)
        for token in resume_token_ids:
            if not matcher.accept_token(int(token)):
                raise StructuredOutputError(f"the tokens already generated do not fit the grammar (token {token})")
        return matcher
