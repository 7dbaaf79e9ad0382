"""Request intake: a request checked against what this engine can serve, and made a Sequence.

Everything a client can get wrong is refused here, before the request reaches the compute loop, with an error
whose message says what to change (a 400 at the service edge): the shared check against the model's limits
(request_limits.py, RequestOutOfLimits), then what only this engine knows (its grammar backend, KV layout).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from qwenserve.engine.grammar import GrammarBackend
from qwenserve.engine.kv_handoff import KVExportSink, KVImport
from qwenserve.engine.outputs import RequestOutput
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.sequence import Sequence
from qwenserve.engine.structured import StructuredOutputError
from qwenserve.kv_layout import KVLayout
from qwenserve.request_limits import ModelLimits, check_request


class RequestIntake:
    """Checks requests against the model's vocabulary, max_model_len, the grammar backend and the KV layout."""

    def __init__(self, vocab_size: int, max_model_len: int, grammar: GrammarBackend, layout: KVLayout) -> None:
        self.limits = ModelLimits(vocab_size, max_model_len)
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
        compiled_grammar: Any = None,
    ) -> Sequence:
        """The request as a Sequence, or a RequestOutOfLimits / RequestError saying why it cannot run here.
        compiled_grammar: its constraint, compiled beforehand (GrammarBackend.compile); else compiled here."""
        tokens = [int(t) for t in prompt_token_ids] + [int(t) for t in resume_token_ids]
        max_tokens = check_request(prompt_token_ids, sampling, self.limits, resume_ids=resume_token_ids)
        # No KV check: max_model_len fits in the cache (checked at start), so a request within it can always run.
        if kv_import is not None:
            kv_import.check_fits(self.layout, len(tokens))
        return Sequence(
            request_id=request_id,
            prompt_len=len(prompt_token_ids),
            token_ids=tokens,
            sampling=sampling,
            max_tokens=max_tokens,
            emit=emit or (lambda out: None),
            cache_salt=cache_salt,
            kv_import=kv_import,
            kv_export=kv_export,
            grammar=self._grammar_for(sampling, resume_token_ids, compiled_grammar),
        )

    def _grammar_for(self, sampling: SamplingParams, resume_token_ids: Seq[int], compiled: Any) -> Any:
        """The request's structured-output matcher, advanced past the tokens it already has (a handoff's first
        token, a failover's resumed ones); None for free text. StructuredOutputError: a 400 for the client."""
        if sampling.structured is None:
            return None
        if compiled is None:
            compiled = self.grammar.compile_sync(sampling.structured)
        matcher = self.grammar.matcher_for(compiled, sampling.reasoning_first)
        for token in resume_token_ids:
            if not matcher.accept_token(int(token)):
                raise StructuredOutputError(f"the tokens already generated do not fit the grammar (token {token})")
        return matcher
