"""Checks every worker applies to an incoming request before the engine sees it.

The router checks a request against the model's limits where it enters (request_limits.py); a stage checks
again, with the same function and its own limits (its max_model_len, its KV cache), because anyone who reaches
its port can call it, and a request that passes here must never fail deep in the engine for a reason the caller
could have fixed.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Sequence
from typing import Any

from qwenserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qwenserve.protocol import sampling_from_proto
from qwenserve.request_limits import ModelLimits, RequestOutOfLimits, check_cache_salt, check_request
from qwenserve.v1 import common_pb2
from qwenserve.worker.errors import BadRequest

#: Visible ASCII only: the id goes into logs, spans, metadata and handoff ids, where anything else breaks.
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


def checked_request(
    prompt_ids: Sequence[int],
    sampling: common_pb2.SamplingParams,
    limits: ModelLimits,
    resume_ids: Sequence[int] = (),
) -> tuple[list[int], SamplingParams]:
    """The prompt and the engine's sampling settings, max_tokens filled with what fits this worker (its context
    and KV cache) when the caller set none. Raises BadRequest for a sampling setting out of range and the shared
    check's RequestOutOfLimits (request_limits.py) for what does not fit the model; `resume_ids` were already
    generated and count against max_tokens."""
    ids = list(prompt_ids)
    try:
        params = sampling_from_proto(sampling, default_max_tokens=None)
        budget = check_request(ids, params, limits, resume_ids=resume_ids)
        return ids, dataclasses.replace(params, max_tokens=budget)  # min_tokens is checked against the budget
    except InvalidSamplingParams as e:
        raise BadRequest(f"sampling.{e}", f"sampling.{e.field}") from e


def engine_limits(engine: Any) -> ModelLimits:
    """The limits a request must fit on this worker: its engine's vocabulary, max_model_len and KV cache."""
    return ModelLimits(engine.model_config.vocab_size, engine.max_model_len,
                       engine.pool.num_blocks * engine.pool.block_size)


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
    try:
        return check_cache_salt(salt)
    except RequestOutOfLimits as e:
        raise BadRequest(e.message) from None
