"""Hypothesis strategies for what a hostile or careless client sends: OpenAI HTTP bodies and headers,
raw bytes that are barely JSON, and gRPC GenerateRequests with their metadata.

Bodies are mostly valid with a few fields (0 to 3) given hostile values, so that examples reach the
engine as well as the validators. `refusal_reason()` says when the issue's contract requires a 4xx /
client-error code whatever else the request holds.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import strategies as st

from qwenserve.default_model import TINY_CONFIG
from qwenserve.v1 import common_pb2, router_pb2

MODEL_NAME = "qwen3-fuzz"
API_KEY = "sk-fuzz"
CONTEXT = 1024
# Every token id at or above this is outside the model, whatever the tokenizer says.
VOCAB = int(TINY_CONFIG["vocab_size"])
# The engines' KV pool, in tokens: smaller than the context, so a max_tokens can need more KV than the pool
# holds (tests/fuzz/conftest.py starts the cluster with this pool and checks it).
POOL_TOKENS = 512
# Valid requests generate a few tokens: examples stay fast.
SMALL_MAX_TOKENS = 24

OMIT = object()  # a field the body leaves out


EDGE_INTS = [0, -1, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
             10**30]
EDGE_FLOATS = [math.inf, -math.inf, math.nan, 1e308, -1e308, 5e-324, -0.0, 1e6 + 1, 0.1]
NASTY_STRINGS = [
    "", " ", "\x00", "\n", "\r\n", "\t", "\x1b[31m", "\u2028", "\ufeff", "\u202e", "\ud800", "a\udfffb",
    "\U0001f600", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "{{ 7*7 }}", "{% raw %}",
    "\\", '"', "null", "NaN", "x" * 5000,
]

# Text a client could type: any code point, lone surrogates and control characters included.
weird_text = st.one_of(
    st.text(st.characters(categories=["Cs", "Cc", "Cf", "Zl", "Zp", "Co"]), max_size=8),
    st.text(max_size=20),
    st.sampled_from(NASTY_STRINGS),
)
plain_text = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FFF, exclude_categories=["Cs"]),
                     min_size=1, max_size=40)
scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70),
    st.sampled_from(EDGE_FLOATS), st.floats(), weird_text, st.just(10**400),
)
# Any JSON-ish value, hostile scalars at the leaves.
hostile = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(weird_text, inner, max_size=3),
    max_leaves=6,
)


def in_vocab_ids(max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_size)


# Token ids a careless client sends: past the tokenizer's vocabulary, past the model's, past uint32.
out_of_vocab_ids = st.lists(
    st.one_of(st.integers(0, VOCAB - 1), st.integers(151_643, VOCAB + 10),
              st.sampled_from([VOCAB, 2**32 - 1, 2**32, -1])),
    min_size=1, max_size=4,
).filter(lambda ids: any(i >= VOCAB or i < 0 for i in ids))


# -- HTTP bodies ---------------------------------------------------------------------------------

max_tokens_values = st.one_of(
    st.integers(1, SMALL_MAX_TOKENS),
    st.sampled_from([0, -1, POOL_TOKENS, POOL_TOKENS + 1, CONTEXT - 1, CONTEXT, CONTEXT + 1, 2**32, 10**9,
                     2.0, 1.5, "16", True]),
    st.integers(POOL_TOKENS + 1, 4 * CONTEXT),
)

COMMON_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL_NAME),
    "prompt_logprobs": st.integers(0, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "stop": st.one_of(plain_text, st.lists(plain_text, max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "user": plain_text,
    "skip_special_tokens": st.booleans(),
    "cache_salt": plain_text,
}
# Hostile values that target a field's own checks, besides the generic `hostile` values.
TARGETED: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(weird_text, st.sampled_from(["gpt-4o", f"{MODEL_NAME} ", MODEL_NAME.upper()])),
    "max_tokens": max_tokens_values,
    "max_completion_tokens": max_tokens_values,
    "prompt_logprobs": st.sampled_from([-1, 21, 2**32, "2"]),
    "n": st.sampled_from([0, -1, 17, 10**6, 2**64]),
    "stream_options": st.one_of(hostile,
                                st.sampled_from([{"include_usage": "yes"}, {"continuous_usage_stats": 1}])),
    "stop": st.one_of(st.just([""]), st.lists(plain_text, min_size=17, max_size=20),
                      st.lists(weird_text, max_size=3)),
    "stop_token_ids": out_of_vocab_ids,
    "min_tokens": st.sampled_from([-1, 2**32, 10**6, SMALL_MAX_TOKENS + 1]),
    "logit_bias": st.dictionaries(st.one_of(st.integers(0, VOCAB + 5).map(str), weird_text),
                                  st.one_of(st.floats(-100, 100), hostile), min_size=1, max_size=3),
    "echo": st.just(True),
    "suffix": plain_text,
    "best_of": st.integers(0, 5),
    "prompt": st.one_of(out_of_vocab_ids, st.sampled_from([[], "", [[]]]), st.lists(weird_text, max_size=3),
                        st.integers(200, 1500).map(lambda n: "word " * n)),
}


# Known parameters this server refuses (never sent valid: they only appear with hostile values).
UNSUPPORTED = {"logit_bias", "echo", "suffix", "best_of"}


@st.composite
def _body(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], required: frozenset[str]
          ) -> dict[str, Any]:
    """A JSON object over `fields`: each valid or left out (the `required` ones never), except 0-3 of them
    that get hostile values; plus now and then fields nobody knows."""
    names = sorted(set(fields) | UNSUPPORTED)
    hostile_names = draw(st.sets(st.sampled_from(names), max_size=3))
    body = {}
    for name in names:
        if name in hostile_names:
            value = draw(st.one_of(TARGETED.get(name, hostile), hostile))
        elif name in required:
            value = draw(fields[name])
        elif name in fields:
            value = draw(st.one_of(st.just(OMIT), fields[name]))
        else:
            continue
        if value is not OMIT:
            body[name] = value
    if "stream_options" in body and not {"stream_options", "stream"} & hostile_names:
        body["stream"] = True  # valid stream options come with streaming
    unknown = st.one_of(*[st.just({})] * 3, st.dictionaries(weird_text, hostile, min_size=1, max_size=2))
    for key, value in draw(unknown).items():
        body.setdefault(key, value)
    return body


completion_bodies = _body({
    **COMMON_FIELDS,
    "prompt": st.one_of(
        plain_text, in_vocab_ids(16), st.lists(plain_text, min_size=1, max_size=3),
        st.lists(in_vocab_ids(8), min_size=1, max_size=3),
    ),
    "max_tokens": st.integers(1, SMALL_MAX_TOKENS),
    "logprobs": st.integers(0, 5),
}, required=frozenset({"prompt"}))

def _tool_call(text: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "id": plain_text,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": text, "arguments": st.one_of(text, st.just('{"a": 1}'))}),
    })


tool_call = _tool_call(weird_text)
content = st.one_of(plain_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain_text}),
                                         min_size=1, max_size=2))


def _turn(role: str, **optional: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"role": st.just(role), "content": content}, optional=optional)


# A conversation the chat template accepts: an optional system (or developer) message, turns, a user last.
conversation = st.tuples(
    st.one_of(st.just([]), st.lists(_turn("system", name=plain_text) | _turn("developer"), max_size=1)),
    st.lists(st.tuples(_turn("user", name=plain_text),
                       _turn("assistant", tool_calls=st.lists(_tool_call(plain_text), max_size=1),
                             reasoning_content=plain_text)), max_size=2),
    _turn("user"),
).map(lambda parts: [*parts[0], *(m for pair in parts[1] for m in pair), parts[2]])
hostile_message = st.one_of(
    hostile,
    st.fixed_dictionaries({"role": weird_text, "content": plain_text}),
    _turn("tool", tool_call_id=weird_text),
    _turn("system"),  # after the first message: the template refuses it
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(hostile, weird_text)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                           "tool_calls": st.lists(st.one_of(tool_call, hostile), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("user"),
                           "content": st.just([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])}),
)
tool = st.fixed_dictionaries({
    "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": weird_text,
                                       "parameters": st.one_of(hostile, st.just({"type": "object"}))}),
})
TARGETED.update({
    "messages": st.one_of(st.just([]), st.lists(hostile_message, min_size=1, max_size=3),
                          st.lists(conversation, min_size=2, max_size=3).map(lambda cs: sum(cs, [])),
                          conversation.map(lambda c: c * 30)),
    "tools": st.lists(st.one_of(tool, hostile), min_size=1, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "required", "none"]),
                             st.just({"type": "function", "function": {"name": "f"}})),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "xml"},
                                        {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}]),
    "chat_template_kwargs": st.one_of(st.just({"enable_thinking": "yes"}),
                                      st.dictionaries(weird_text, hostile)),
    "top_logprobs": st.sampled_from([-1, 21, 2**32, 3]),
    "logprobs": st.one_of(st.sampled_from([-1, 6, 2**32, "yes"]), hostile),
})

chat_bodies = _body({
    **COMMON_FIELDS,
    "messages": conversation,
    # Always set (the default, "as much as fits", is hundreds of tokens: the tests try it once, explicitly).
    "max_tokens": st.integers(1, SMALL_MAX_TOKENS),
    "max_completion_tokens": st.integers(1, SMALL_MAX_TOKENS),
    "logprobs": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
    "response_format": st.just({"type": "text"}),
    "tool_choice": st.just("none"),
    "tools": st.just([]),
}, required=frozenset({"messages", "max_tokens"}))


@st.composite
def encoded(draw: st.DrawFn, bodies: st.SearchStrategy[dict[str, Any]]) -> tuple[dict[str, Any], bytes]:
    """A body and its bytes: ASCII-escaped JSON, or raw UTF-8 (where a lone surrogate becomes invalid
    UTF-8); NaN and infinities as Python's json writes them."""
    body = draw(bodies)
    ascii_only = draw(st.sampled_from([True, True, True, False]))
    return body, json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


# Headers: mostly a good key; now and then none, a wrong one, odd request ids and content types.
AUTH_GOOD = f"Bearer {API_KEY}"
http_headers = st.fixed_dictionaries(
    {"Authorization": st.sampled_from([AUTH_GOOD] * 20
                                      + [OMIT, "Bearer sk-wrong", "Basic c2s6Zm9v", "Bearer ", API_KEY])},
    optional={
        "X-Request-Id": st.one_of(st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=64),
                                  st.sampled_from(["a" * 129, "x" * 4000, "../../etc", "id with spaces"])),
        "Content-Type": st.sampled_from(["application/json", "text/plain", "", "application/x-ndjson",
                                         "application/json; charset=latin-1"]),
    },
).map(lambda h: {k: v for k, v in h.items() if v is not OMIT})


def authorized(headers: dict[str, str]) -> bool:
    return headers.get("Authorization") == AUTH_GOOD


def _ids_outside_vocab(value: Any) -> bool:
    ids = value if isinstance(value, list) else []
    flat = [t for item in ids for t in (item if isinstance(item, list) else [item])]
    return bool(flat) and all(type(t) is int for t in flat) and any(t >= VOCAB for t in flat)


def refusal_reason(body: dict[str, Any], kind: str) -> str | None:
    """Why the issue's contract refuses this body with a 4xx whatever its other fields hold, or None."""
    if "model" in body and body["model"] is not None and body["model"] != MODEL_NAME:
        return "a model this server does not serve"
    if _ids_outside_vocab(body.get("stop_token_ids")):
        return "stop_token_ids outside the vocabulary"
    if kind == "completion" and _ids_outside_vocab(body.get("prompt")):
        return "prompt token ids outside the vocabulary"
    effective = _max_tokens(body, kind)
    if type(effective) is int and effective >= POOL_TOKENS:
        return "max_tokens needs more KV blocks than the pool holds"
    return None


def _max_tokens(body: dict[str, Any], kind: str) -> Any:
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    return next((body[n] for n in names if body.get(n) is not None), None)


def generation_budget(body: dict[str, Any], kind: str) -> int:
    """How many tokens each answer to this body may generate, at most."""
    effective = _max_tokens(body, kind)
    if type(effective) is int and effective > 0:
        return min(effective, POOL_TOKENS)
    return 16 if kind == "completion" else POOL_TOKENS  # the APIs' defaults: 16, and "as much as fits"


# -- gRPC requests -------------------------------------------------------------------------------

# Protobuf strings cannot hold lone surrogates; everything else goes.
grpc_text = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=30),
    st.sampled_from([s for s in NASTY_STRINGS if "\ud800" not in s and "\udfff" not in s]),
)
# Floats as a float32 field holds them, NaN and infinities included.
floats32 = st.one_of(st.floats(width=32), st.sampled_from([math.inf, -math.inf, math.nan, 3.4e38, -0.0]))
request_ids = st.one_of(
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
    grpc_text,
    st.sampled_from(["id\nwith newline", "ünïcödé", "tab\there", "\x7f", "x" * 100_000, "a:b", " lead"]),
)


@st.composite
def chat_inputs(draw: st.DrawFn) -> common_pb2.ChatInput:
    chat = common_pb2.ChatInput(add_generation_prompt=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):
        chat.messages.add(
            role=draw(st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), grpc_text)),
            content=draw(grpc_text), name=draw(st.one_of(st.just(""), grpc_text)),
            tool_calls_json=draw(st.lists(st.one_of(grpc_text, st.just('{"type": "function"}')), max_size=2)),
        )
    tool_json = st.one_of(grpc_text, st.just('{"type": "function", "function": {}}'))
    chat.tools_json.extend(draw(st.lists(tool_json, max_size=2)))
    kwargs_json = st.one_of(st.sampled_from(["", '{"enable_thinking": "x"}']), grpc_text)
    chat.chat_template_kwargs_json = draw(kwargs_json)
    if draw(st.booleans()):
        chat.enable_thinking = draw(st.booleans())
    return chat


@st.composite
def _prompt_input(draw: st.DrawFn, hostile_input: bool) -> tuple[str, Any]:
    """Which oneof member carries the prompt, and its value."""
    if not hostile_input:
        hi = common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="user", content="hi")],
                                  add_generation_prompt=True)
        return draw(st.one_of(st.tuples(st.just("prompt"), plain_text),
                              st.tuples(st.just("ids"), in_vocab_ids(16)), st.just(("chat", hi))))
    return draw(st.one_of(
        st.tuples(st.just("none"), st.none()),
        st.tuples(st.just("prompt"), st.one_of(grpc_text, st.integers(200, 1500).map(lambda n: "word " * n))),
        st.tuples(st.just("chat"), chat_inputs()),
        st.tuples(st.just("ids"), st.one_of(st.just([]), out_of_vocab_ids.filter(lambda ids: max(ids) < 2**32
                                                                                   and min(ids) >= 0))),
    ))


# Each field of a GenerateRequest: a valid value, and what a careless client might put there instead.
GRPC_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "request_id": (st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True)),
                   request_ids),
    "model": (st.sampled_from(["", MODEL_NAME]), grpc_text),
    "temperature": (st.one_of(st.just(OMIT), st.floats(0, 2)), floats32),
    "top_p": (st.one_of(st.just(OMIT), st.floats(0.01, 1)), floats32),
    "min_p": (st.floats(0, 1), floats32),
    "repetition_penalty": (st.one_of(st.just(OMIT), st.floats(0.5, 2)), floats32),
    "presence_penalty": (st.floats(-2, 2), floats32),
    "frequency_penalty": (st.floats(-2, 2), floats32),
    "top_k": (st.integers(0, 50), st.integers(-(2**31), 2**31 - 1)),
    # Always set (the default, "as much as fits", is hundreds of tokens: the tests try it once, explicitly).
    "max_tokens": (st.integers(1, SMALL_MAX_TOKENS),
                   st.sampled_from([0, POOL_TOKENS - 8, POOL_TOKENS, CONTEXT, 2**32 - 1])),
    "min_tokens": (st.integers(0, 4), st.sampled_from([2**32 - 1, 1000, SMALL_MAX_TOKENS + 1])),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(st.integers(0, 2**32 - 1),
                                                                                  min_size=1, max_size=3)),
    "top_logprobs": (st.integers(0, 5), st.sampled_from([21, 2**32 - 1])),
    "prompt_logprobs": (st.one_of(st.just(OMIT), st.integers(0, 3)), st.sampled_from([21, 2**32 - 1])),
    "seed": (st.one_of(st.just(OMIT), st.integers(0, 2**64 - 1)), st.sampled_from([0, 2**64 - 1])),
    "stop": (st.lists(plain_text, max_size=3), st.one_of(st.lists(grpc_text, min_size=1, max_size=3),
                                                         st.lists(plain_text, min_size=17, max_size=18))),
    "deadline_unix_ms": (st.just(0), st.sampled_from([-1, 1, 2**63 - 1, -(2**63)])),
    "cache_salt": (st.one_of(st.just(""), plain_text), st.one_of(grpc_text, st.just("s" * 100_000))),
}
SAMPLING_FIELDS = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")


@st.composite
def generate_requests(draw: st.DrawFn) -> router_pb2.GenerateRequest:
    """A GenerateRequest with valid fields, except 0-3 of them (the prompt included) that get hostile
    values."""
    hostile_names = draw(st.sets(st.sampled_from(sorted(GRPC_FIELDS) + ["input"]), max_size=3))
    req = router_pb2.GenerateRequest()
    which, value = draw(_prompt_input("input" in hostile_names))
    if which == "prompt":
        req.prompt = value
    elif which == "chat":
        req.chat.CopyFrom(value)
    elif which == "ids":
        req.prompt_token_ids.ids.extend(value)
    for name, (valid, bad) in GRPC_FIELDS.items():
        value = draw(bad if name in hostile_names else valid)
        if value is OMIT:
            continue
        target = req.sampling if name in SAMPLING_FIELDS else req
        if isinstance(value, list):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    for name in ("ignore_eos", "logprobs"):
        setattr(req.sampling, name, draw(st.booleans()))
    if draw(st.booleans()):
        req.skip_special_tokens = draw(st.booleans())
    req.echo_prompt_token_ids = draw(st.booleans())
    return req


def grpc_refusal_reason(req: router_pb2.GenerateRequest) -> str | None:
    """Why the issue's contract refuses this request with a client-error code, or None."""
    s = req.sampling
    for name in SAMPLING_FLOATS:
        if not math.isfinite(getattr(s, name)):
            return f"sampling.{name} is not finite"
    if req.model and req.model != MODEL_NAME:
        return "a model this server does not serve"
    if any(t >= VOCAB for t in s.stop_token_ids):
        return "stop_token_ids outside the vocabulary"
    if s.HasField("prompt_logprobs") and s.prompt_logprobs > 20:
        return "prompt_logprobs above 20"
    if req.WhichOneof("input") == "prompt_token_ids" and any(t >= VOCAB for t in req.prompt_token_ids.ids):
        return "prompt token ids outside the vocabulary"
    if s.HasField("max_tokens") and s.max_tokens >= POOL_TOKENS:
        return "max_tokens needs more KV blocks than the pool holds"
    return None


# Mostly a good key, in either header; now and then none or a wrong one.
def grpc_generation_budget(req: router_pb2.GenerateRequest) -> int:
    """How many tokens this request may generate, at most."""
    return min(req.sampling.max_tokens, POOL_TOKENS) if req.sampling.HasField("max_tokens") else POOL_TOKENS


grpc_metadata = st.sampled_from(
    [(("authorization", AUTH_GOOD),)] * 15 + [(("x-api-key", API_KEY),)] * 5
    + [(), (("authorization", "Bearer sk-wrong"),), (("authorization", "Bearer "),), (("x-api-key", "nope"),),
       (("authorization", API_KEY),)]
)


def grpc_authorized(metadata: tuple[tuple[str, str], ...]) -> bool:
    return ("authorization", AUTH_GOOD) in metadata or ("x-api-key", API_KEY) in metadata
