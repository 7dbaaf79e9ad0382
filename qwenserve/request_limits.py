"""The one check of a request against a model's limits: its token ids within the vocabulary, prompt and output
within max_model_len (and a worker's KV cache, where one says how much it holds).

The router checks every request here where it enters (gRPC Generate and the OpenAI HTTP front), against the
smallest limits its engine workers report. A worker checks again with the same function, against its own
limits, because anyone who reaches its port can call it; the engine's intake does too, so that the engine used
as a library never meets an id its sampler cannot index. Each edge maps `RequestOutOfLimits` once, by its
`code`, to a gRPC status or an HTTP status. Imports neither torch nor grpc: the router's process has neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qwenserve.engine.sampling_params import SamplingParams

#: The longest prefix-cache salt a request may carry: the salt is hashed into every block's key, and an unbounded
#: one is a memory sink on every stage that holds it.
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request must fit: the vocabulary, the context (prompt and output together) and, on a worker,
    the most tokens its KV cache holds (None: the context always fits, as the engine makes sure at start)."""

    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int | None = None


class RequestOutOfLimits(ValueError):
    """A request the model cannot serve as sent; `message` says what to change, `field` names the part at fault
    (wire names: "prompt_token_ids", "sampling.max_tokens", ...), `code` is the stable error code."""

    code = "invalid_request"

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class EmptyPrompt(RequestOutOfLimits):
    """The prompt has no tokens."""


class TokenOutsideVocabulary(RequestOutOfLimits):
    """A prompt, resume, stop or reasoning token id is not one of the model's."""


class ContextLengthExceeded(RequestOutOfLimits):
    """Prompt and output budget do not fit in max_model_len (or the worker's KV cache)."""

    code = "context_length_exceeded"


class NothingLeftToGenerate(RequestOutOfLimits):
    """The tokens a resumed request already generated reach its max_tokens."""


def check_request(
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    limits: ModelLimits,
    *,
    resume_ids: Sequence[int] = (),
    prompt_field: str = "prompt_token_ids",
) -> int:
    """The request's output budget (its max_tokens, or when it set none what is left of the context and the KV
    cache), or RequestOutOfLimits saying why it cannot run. `resume_ids`: tokens already generated (a resumed or
    handed-off request), which count against max_tokens; `prompt_field`: what the caller's request calls the
    prompt, for the error's field."""
    vocab = limits.vocab_size
    if not prompt_ids:
        raise EmptyPrompt("the prompt is empty; send at least one token", prompt_field)
    _check_vocabulary(prompt_ids, vocab, "token id", prompt_field)
    _check_vocabulary(resume_ids, vocab, "resume token id", "resume_token_ids")
    # The sampler indexes logits with them (min_tokens masks them): one out of range would fail every step.
    _check_vocabulary(sampling.stop_token_ids, vocab, "stop_token_ids: token id", "sampling.stop_token_ids")
    first = sampling.reasoning_first
    if first is not None and not (0 <= first.start_id < vocab and 0 <= first.end_id < vocab):
        raise TokenOutsideVocabulary(f"reasoning_first names a token outside the vocabulary of {vocab}",
                                     "sampling.structured.reasoning_first")
    prompt, limit, kv = len(prompt_ids), limits.max_model_len, limits.kv_capacity_tokens
    room = limit - prompt
    if room < 1:
        raise ContextLengthExceeded(
            f"the prompt has {prompt} tokens; this server's max_model_len is {limit} tokens, prompt and output "
            f"together, so a prompt may have at most {limit - 1}", prompt_field)
    fits = room if kv is None else min(room, kv - prompt)
    if fits < 1:
        raise ContextLengthExceeded(
            f"the prompt has {prompt} tokens; this server's KV cache holds {kv} tokens, prompt and output "
            f"together; shorten the prompt", prompt_field)
    max_tokens = sampling.max_tokens
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthExceeded(
            f"max_tokens {max_tokens} + prompt {prompt} tokens exceeds the context of {limit} tokens (this "
            f"server's max_model_len); lower max_tokens to at most {room}", "sampling.max_tokens")
    if max_tokens is not None and max_tokens > fits:
        raise ContextLengthExceeded(
            f"max_tokens {max_tokens} + prompt {prompt} tokens is more than this server's KV cache holds ({kv} "
            f"tokens); lower max_tokens to at most {fits}", "sampling.max_tokens")
    budget = fits if max_tokens is None else max_tokens
    if resume_ids and len(resume_ids) >= budget:
        raise NothingLeftToGenerate(
            f"{len(resume_ids)} tokens were already generated; max_tokens is {budget}", "resume_token_ids")
    return budget


def check_cache_salt(salt: str) -> str | None:
    """The prefix-cache salt, or None for none; RequestOutOfLimits when it is longer than MAX_CACHE_SALT_CHARS."""
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise RequestOutOfLimits(f"cache_salt has {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS}",
                                 "cache_salt")
    return salt or None


def _check_vocabulary(ids: Sequence[int], vocab_size: int, what: str, field: str) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise TokenOutsideVocabulary(
            f"{what} {bad} is outside the vocabulary of {vocab_size} (ids 0 to {vocab_size - 1})", field)
