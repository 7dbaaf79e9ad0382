"""Conversions between wire messages (qwenserve.v1) and library types, in one place."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from qwenserve.engine.outputs import TokenLogprob
from qwenserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qwenserve.engine.structured import (
    ReasoningFirst,
    StructuredOutput,
    StructuredOutputError,
    compiled_grammar,
)
from qwenserve.kv_layout import KVLayout
from qwenserve.untrusted_input import JsonRefused, check_nesting
from qwenserve.v1 import common_pb2

FINISH_REASONS: dict[str, int] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
    "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS,
    "content_filter": common_pb2.FINISH_REASON_CONTENT_FILTER,
}
FINISH_REASON_NAMES: dict[int, str] = {v: k for k, v in FINISH_REASONS.items()}

# Float settings above this size are mistakes (and +-inf / NaN would poison the logits); HTTP refuses the same.
MAX_SAMPLING_MAGNITUDE = 1e6
FLOAT_SAMPLING_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty")
# A constraint up to this size is parsed where it enters (a malformed one is a 400 naming `structured` at once, in
# milliseconds); a larger one only where it is compiled, in a worker's compile process (engine/grammar_compile.py),
# since parsing it here would hold up this event loop (seconds for a 1 MB regex).
EDGE_PARSE_MAX_CHARS = 16384


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int | None) -> SamplingParams:
    """Fill unset fields with defaults; raises InvalidSamplingParams naming the bad field.

    Every front (gRPC and HTTP, through `Router.prepare`) goes through here, so the ranges are checked once.
    """
    for name in FLOAT_SAMPLING_FIELDS:
        value = getattr(msg, name)
        if not math.isfinite(value) or abs(value) > MAX_SAMPLING_MAGNITUDE:
            raise InvalidSamplingParams(name, "must be a finite number of reasonable size")
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        min_tokens=msg.min_tokens,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        structured=structured_from_proto(msg.structured) if msg.HasField("structured") else None,
        reasoning_first=reasoning_first_from_proto(msg.structured) if msg.HasField("structured") else None,
    )


def reasoning_first_from_proto(msg: common_pb2.StructuredOutput) -> ReasoningFirst | None:
    if not msg.HasField("reasoning_first"):
        return None
    first = msg.reasoning_first
    return ReasoningFirst(first.start_id, first.end_id, first.open_in_prompt)


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    """The wire's constraint, its grammar checked when it is small (EDGE_PARSE_MAX_CHARS; parsed once per distinct
    constraint); raises InvalidSamplingParams naming `structured` when it cannot be used."""
    kind = msg.WhichOneof("kind")
    try:
        if kind is None:
            raise StructuredOutputError("set one of json_schema, json_object, regex, choice or ebnf")
        if kind == "choice":
            structured = StructuredOutput(kind, json.dumps(list(msg.choice.values)))
        else:
            structured = StructuredOutput(kind, "" if kind == "json_object" else getattr(msg, kind))
        if len(structured.spec) <= EDGE_PARSE_MAX_CHARS:
            compiled_grammar(structured)
        elif kind == "json_schema":  # counted, not parsed: a schema nested too deeply is refused before any stream
            check_nesting(structured.spec, "the JSON schema")
    except JsonRefused as e:
        raise InvalidSamplingParams("structured", e.message) from None
    except StructuredOutputError as e:
        raise InvalidSamplingParams("structured", str(e)) from None
    return structured


def finish_reason_to_proto(reason: str | None) -> int:
    """Engine finish reasons ("stop", "length", "abort", "error") to the wire enum."""
    return FINISH_REASONS.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def logprobs_to_proto(token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    """The engine's per-token logprobs as wire messages (empty when they were not asked for)."""
    result = []
    for token_id, entry in zip(token_ids, logprobs or [], strict=False):
        msg = common_pb2.TokenLogprob(token_id=token_id, logprob=entry.logprob, rank=entry.rank)
        for alt_id, alt_lp in entry.top:
            msg.top.add(token_id=alt_id, logprob=alt_lp)
        result.append(msg)
    return result


def prompt_logprobs_to_proto(entries: Sequence[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    """The prompt's logprobs (each entry names its own token) as wire messages."""
    entries = entries or []
    return logprobs_to_proto([e.token_id for e in entries], entries)


def kv_layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    """The layout a handle carries on the wire."""
    return common_pb2.KVLayout(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)
                                  if not f.metadata.get("local")})


def kv_layout_from_proto(message: common_pb2.KVLayout) -> KVLayout:
    """The layout a handle carries; ValueError when it describes no usable layout."""
    return KVLayout(**{f.name: getattr(message, f.name) for f in dataclasses.fields(KVLayout)
                       if not f.metadata.get("local")})
