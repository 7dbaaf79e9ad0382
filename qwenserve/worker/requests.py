"""Checks every worker applies to an incoming request before the engine sees it.

The router checks the same things; a stage checks again because anyone who reaches its port can call it,
and a request that passes here must never fail deep in the engine for a reason the caller could have fixed.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence

from qwenserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qwenserve.protocol import sampling_from_proto
from qwenserve.v1 import common_pb2
from qwenserve.worker.errors import BadRequest, ContextTooLong

#: Visible ASCII only: the id goes into logs, spans, metadata and handoff ids, where anything else breaks.
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")
MAX_CACHE_SALT_CHARS = 1024


def checked_request(
    prompt_ids: Sequence[int],
    sampling: common_pb2.SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    kv_capacity: int | None = None,
    generated: int = 0,
) -> tuple[list[int], SamplingParams]:
    """Validate ids and sampling; `generated` tokens already exist (resume) and count against the budget.

    `kv_capacity` is the most tokens the worker's KV cache holds: a request needing more could never
    be scheduled, so it is refused (ContextTooLong), and an unset max_tokens is capped to what fits.
    """
    ids = list(prompt_ids)
    if not ids:
        raise BadRequest("prompt_token_ids is empty", "prompt_token_ids")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary of {vocab_size}", "prompt_token_ids")
    room = max_model_len - len(ids)
    if room < 1:
        raise ContextTooLong(f"the prompt has {len(ids)} tokens; the context is {max_model_len}")
    fits = room if kv_capacity is None else min(room, kv_capacity - len(ids))
    if fits < 1:
        raise ContextTooLong(f"the prompt has {len(ids)} tokens; this server's KV cache holds {kv_capacity}")
    try:
        params = sampling_from_proto(sampling, default_max_tokens=fits)
    except InvalidSamplingParams as e:
        raise BadRequest(f"sampling.{e}", f"sampling.{e.field}") from e
    bad = next((i for i in params.stop_token_ids if i >= vocab_size), None)
    if bad is not None:
        raise BadRequest(f"sampling.stop_token_ids: token id {bad} is outside the vocabulary of {vocab_size}",
                         "sampling.stop_token_ids")
    if params.max_tokens is not None and params.max_tokens > room:
        raise ContextTooLong(
            f"max_tokens {params.max_tokens} + prompt {len(ids)} exceeds the context of {max_model_len}"
        )
    if params.max_tokens is not None and params.max_tokens > fits:
        raise ContextTooLong(
            f"max_tokens {params.max_tokens} + prompt {len(ids)} tokens is more than this server's KV cache "
            f"holds ({kv_capacity} tokens); lower max_tokens to at most {fits}"
        )
    if generated and params.max_tokens is not None and generated >= params.max_tokens:
        raise BadRequest(f"{generated} tokens were already generated; max_tokens is {params.max_tokens}")
    return ids, params


def checked_request_id(request_id: str, prefix: str) -> str:
    """The caller's id when it is 1-256 visible ASCII characters; a new `<prefix>-...` id when none is given."""
    if not request_id:
        return f"{prefix}-{uuid.uuid4().hex[:12]}"
    if not REQUEST_ID.fullmatch(request_id):
        raise BadRequest(
            f"request_id must be 1 to 256 visible ASCII characters (no spaces or control characters); got "
            f"{len(request_id)} characters starting {request_id[:32]!r}"
        )
    return request_id


def checked_cache_salt(salt: str) -> str | None:
    """The prefix-cache salt, or None for none; bounded so that a salt cannot be a memory sink."""
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"cache_salt has {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
    return salt or None
