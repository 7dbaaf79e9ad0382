"""Checks every worker applies to an incoming request before the engine sees it."""

from __future__ import annotations

from collections.abc import Sequence

from qwenserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qwenserve.protocol import sampling_from_proto
from qwenserve.v1 import common_pb2
from qwenserve.worker.errors import BadRequest


def checked_request(
    prompt_ids: Sequence[int],
    sampling: common_pb2.SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    generated: int = 0,
) -> tuple[list[int], SamplingParams]:
    """Validate ids and sampling; `generated` tokens already exist (resume) and count against the budget."""
    ids = list(prompt_ids)
    if not ids:
        raise BadRequest("prompt_token_ids is empty")
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary of {vocab_size}")
    room = max_model_len - len(ids)
    if room < 1:
        raise BadRequest(f"the prompt has {len(ids)} tokens; the context is {max_model_len}")
    try:
        params = sampling_from_proto(sampling, default_max_tokens=room)
    except InvalidSamplingParams as e:
        raise BadRequest(f"sampling.{e}") from e
    if params.max_tokens is not None and params.max_tokens > room:
        raise BadRequest(f"max_tokens {params.max_tokens} + prompt {len(ids)} exceeds the context of {max_model_len}")
    if generated and params.max_tokens is not None and generated >= params.max_tokens:
        raise BadRequest(f"{generated} tokens were already generated; max_tokens is {params.max_tokens}")
    return ids, params
