"""OpenAI request bodies (chat and legacy completions) to GenerateRequests, checked field by field.

Pure functions: a JSON body in, a `ParsedRequest` out, or an `InvalidRequest` whose `field` is
the OpenAI parameter at fault (it becomes the error's `param`). Types and shapes are checked
here; value ranges of sampling settings are checked once, by `Router.prepare()`.

Unknown parameters are ignored (as vLLM does), so clients that send newer OpenAI fields keep
working; known parameters this server cannot honour (logit_bias, beam search, prompt logprobs, ...) are
refused with a 400 rather than silently dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from qwenserve.router.errors import BodyTooLarge, InvalidRequest
from qwenserve.router.openai_fields import (
    UINT32_MAX,
    checked_json,
    checked_text,
    first_max_tokens,
    is_token_id,
    optional,
    optional_number,
    read_json_field,
    stop_strings,
    type_name,
)
from qwenserve.untrusted_input import echo
from qwenserve.v1 import common_pb2, router_pb2

MAX_N = 16  # answers per request (n)
MAX_PROMPTS = 64  # prompts in one legacy completions request
MAX_CHOICES = 64  # prompts x n
MAX_COMPLETION_LOGPROBS = 5  # the legacy API's limit on `logprobs`
# OpenAI's "developer" role is the newer name of "system"; the chat templates know only "system".
ROLE_ALIASES = {"developer": "system"}
CHAT_ROLES = ("system", "user", "assistant", "tool")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# vLLM's and OpenAI's spellings of what this server does not do yet: a 400 naming them, never ignored.
NOT_SUPPORTED = {
    "use_beam_search": "beam search", "logit_bias": "logit_bias",
    "prediction": "predicted outputs", "audio": "audio output",
}
# vLLM's spellings of a constraint, each to the wire's StructuredOutput field (structured_outputs' keys too).
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "ebnf"}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
                      "json_object": "json_object"}
GRAMMAR_BACKENDS = ("auto", "xgrammar")

Kind = Literal["chat", "completion"]


@dataclass(slots=True)
class ParsedRequest:
    """What one OpenAI request asks for: the prompts and how to answer and stream them."""

    kind: Kind
    model: str | None
    # One GenerateRequest per prompt (chat: always one); each is run `n` times.
    prompts: list[router_pb2.GenerateRequest]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    # qwen-serve extension (as vLLM): running usage in every streamed chunk.
    continuous_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    user: str | None = None
    parallel_tool_calls: bool = True  # false: only an answer's first tool call is returned
    echo: bool = False  # legacy completions: each answer's text starts with its prompt
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt tokens' logprobs, this many alternatives
    echo_logprobs: bool = False  # legacy completions with echo and logprobs: the prompt's tokens lead `logprobs`

def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    """`POST /v1/chat/completions` body to a ParsedRequest."""
    _reject_wrapped(body, "messages")
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array of message objects", "messages")
    req = router_pb2.GenerateRequest()
    chat = req.chat
    for i, message in enumerate(messages):
        _chat_message(chat.messages.add(), message, f"messages[{i}]")
    chat.add_generation_prompt = optional(body, "add_generation_prompt", bool, True)
    kwargs = optional(body, "chat_template_kwargs", dict, None)
    if kwargs is not None:
        thinking = kwargs.get("enable_thinking")
        if thinking is not None:
            if not isinstance(thinking, bool):
                raise InvalidRequest("chat_template_kwargs.enable_thinking must be a boolean",
                                     "chat_template_kwargs.enable_thinking")
            chat.enable_thinking = thinking
        chat.chat_template_kwargs_json = checked_json(kwargs, "chat_template_kwargs")
    if body.get("functions") or body.get("function_call"):
        raise InvalidRequest("functions and function_call are the deprecated spelling; send tools and tool_choice",
                             "functions" if body.get("functions") else "function_call")
    tools = _tools(body.get("tools"))
    chat.tools_json.extend(checked_json(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    chat.tool_choice, chat.tool_choice_name = _tool_choice(body.get("tool_choice"), tools)
    parallel = optional(body, "parallel_tool_calls", bool, True)

    max_tokens = first_max_tokens(body, ("max_completion_tokens", "max_tokens"), default=None)
    logprobs = optional(body, "logprobs", bool, False)
    top_logprobs = optional(body, "top_logprobs", int, None)
    if top_logprobs is not None and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= 20:
        raise InvalidRequest("top_logprobs must be in [0, 20]", "top_logprobs")
    parsed = _common(body, "chat", req, max_tokens, logprobs, top_logprobs or 0)
    parsed.parallel_tool_calls = parallel
    return parsed


def parse_tokenize(body: dict[str, Any]) -> tuple[str | None, router_pb2.GenerateRequest, bool]:
    """`POST /tokenize` as vLLM takes it: a prompt string, or chat messages (with the chat fields); returns
    the model named, the input as a GenerateRequest and whether token strings were asked for."""
    if "messages" in body:
        parsed = parse_chat({**body, "max_tokens": None, "stream": False})
        req = parsed.prompts[0]
    elif isinstance(body.get("prompt"), str):
        req = router_pb2.GenerateRequest(prompt=checked_text(body["prompt"], "prompt"))
    else:
        raise InvalidRequest("send prompt (a string) or messages", "prompt")
    model = optional(body, "model", str, None)
    return model, req, optional(body, "return_token_strs", bool, False)


def parse_detokenize(body: dict[str, Any], max_ids: int) -> list[int]:
    """`POST /detokenize`: the token ids, at most `max_ids` of them (the model's context length: text the model
    could have seen or written; more would hold the router's event loop for seconds)."""
    tokens = body.get("tokens")
    if isinstance(tokens, list) and len(tokens) > max_ids:  # before any id is looked at
        raise BodyTooLarge(f"tokens holds {len(tokens)} ids, more than the limit of {max_ids} (the model's "
                           "context length); detokenize them in parts", "tokens")
    if not isinstance(tokens, list) or not all(is_token_id(t) and 0 <= t <= UINT32_MAX for t in tokens):
        raise InvalidRequest("tokens must be an array of token ids", "tokens")
    return tokens


def _tools(tools: Any) -> list[dict[str, Any]]:
    """The `tools` array, each a function tool with a valid name (parameters, if any, a JSON schema object)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be an array of tool objects", "tools")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise InvalidRequest(f"{where}.function.name must be 1 to 64 letters, digits, _ or -", f"{where}.function.name")
        if name in seen:
            raise InvalidRequest(f"{where}: two tools are named {name!r}", f"{where}.function.name")
        seen.add(name)
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object",
                                 f"{where}.function.parameters")
    return tools


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, str]:
    """(tool_choice, function name) as the router takes them: "auto" by default when there are tools."""
    if choice is None:
        return ("auto" if tools else "none"), ""
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise InvalidRequest(f"tool_choice {echo(choice)} needs tools", "tool_choice")
        return choice, ""
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequest(f"tool_choice names {echo(name)}, which is not one of the tools", "tool_choice")
    return "function", name


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    """`POST /v1/completions` body to a ParsedRequest (one GenerateRequest per prompt)."""
    _reject_wrapped(body, "prompt")
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequest("prompt is required", "prompt")
    inputs = _prompts(body["prompt"])
    echo = optional(body, "echo", bool, False)
    if body.get("suffix"):
        raise InvalidRequest("suffix (fill-in-the-middle) is not supported by this server", "suffix")
    # Legacy default of the completions API: 16 tokens.
    max_tokens = first_max_tokens(body, ("max_tokens",), default=16)
    top = optional(body, "logprobs", int, None)
    if top is not None and not 0 <= top <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
    parsed = _common(body, "completion", inputs[0], max_tokens, top is not None, top or 0)
    for extra in inputs[1:]:
        extra.MergeFrom(_without_input(parsed.prompts[0]))
        parsed.prompts.append(extra)
    if len(parsed.prompts) * parsed.n > MAX_CHOICES:
        raise InvalidRequest(f"prompts x n must be at most {MAX_CHOICES}", "n")
    best_of = optional(body, "best_of", int, None)
    if best_of is not None and best_of != parsed.n:
        raise InvalidRequest("best_of other than n is not supported by this server", "best_of")
    parsed.echo = echo
    if echo and parsed.logprobs:
        # OpenAI's legacy API: the echoed prompt's tokens lead the logprobs (the first one without a value).
        parsed.echo_logprobs = True
        for req in parsed.prompts:
            req.sampling.prompt_logprobs = max(req.sampling.prompt_logprobs, parsed.top_logprobs)
    return parsed


def _without_input(req: router_pb2.GenerateRequest) -> router_pb2.GenerateRequest:
    """The request's settings without its prompt, to share them across a batch of prompts."""
    out = router_pb2.GenerateRequest()
    out.CopyFrom(req)
    out.ClearField("input")
    return out


def _common(
    body: dict[str, Any],
    kind: Kind,
    req: router_pb2.GenerateRequest,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
) -> ParsedRequest:
    """The parameters chat and completions share: sampling, stop, n, streaming, extensions."""
    model = optional(body, "model", str, None)
    if model is not None:
        req.model = model = checked_text(model, "model")
    s = req.sampling
    for name in ("temperature", "top_p", "repetition_penalty"):
        value = optional_number(body, name)
        if value is not None:
            setattr(s, name, value)
    for name in ("min_p", "presence_penalty", "frequency_penalty"):
        value = optional_number(body, name)
        if value is not None:
            setattr(s, name, value)
    top_k = optional(body, "top_k", int, None)
    if top_k is not None:
        if top_k < -1 or top_k > UINT32_MAX // 2:
            raise InvalidRequest("top_k must be -1 or 0 (disabled) or a positive count", "top_k")
        s.top_k = max(0, top_k)  # vLLM spells "disabled" as -1
    if max_tokens is not None:
        s.max_tokens = max_tokens
    min_tokens = optional(body, "min_tokens", int, None)
    if min_tokens is not None:
        if not 0 <= min_tokens <= UINT32_MAX:
            raise InvalidRequest("min_tokens must be >= 0", "min_tokens")
        s.min_tokens = min_tokens
    s.ignore_eos = optional(body, "ignore_eos", bool, False)
    seed = optional(body, "seed", int, None)
    if seed is not None:
        if not -(2**63) <= seed < 2**64:
            raise InvalidRequest("seed must fit in 64 bits", "seed")
        s.seed = seed % 2**64  # negative seeds (valid in OpenAI's int64) map onto the same space
    stop_ids = optional(body, "stop_token_ids", list, None)
    if stop_ids is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in stop_ids):
            raise InvalidRequest("stop_token_ids must be an array of token ids", "stop_token_ids")
        s.stop_token_ids.extend(stop_ids)
    s.logprobs = logprobs
    s.top_logprobs = top_logprobs
    req.stop.extend(stop_strings(body.get("stop")))
    skip = optional(body, "skip_special_tokens", bool, None)
    if skip is not None:
        req.skip_special_tokens = skip
    salt = optional(body, "cache_salt", str, None)
    if salt:
        req.cache_salt = checked_text(salt, "cache_salt")
    prompt_logprobs = optional(body, "prompt_logprobs", int, None)
    if prompt_logprobs is not None:
        if not 0 <= prompt_logprobs <= 20:
            raise InvalidRequest("prompt_logprobs must be in [0, 20] (alternatives per prompt token)",
                                 "prompt_logprobs")
        s.prompt_logprobs = prompt_logprobs
    for name, what in NOT_SUPPORTED.items():
        if body.get(name) not in (None, False, {}, []):
            raise InvalidRequest(f"{name}: {what} is not supported by this server yet", name)
    structured = _structured(body)
    if structured is not None:
        s.structured.CopyFrom(structured)

    n = optional(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}]", "n")
    stream = optional(body, "stream", bool, False)
    options = optional(body, "stream_options", dict, None)
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        include_usage = optional(options, "include_usage", bool, False, "stream_options.")
        continuous = optional(options, "continuous_usage_stats", bool, False, "stream_options.")
    user = optional(body, "user", str, None)
    return ParsedRequest(
        kind=kind,
        model=model,
        prompts=[req],
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        user=user,
    )


def _structured(body: dict[str, Any]) -> common_pb2.StructuredOutput | None:
    """The request's constraint, from whichever spelling it uses (at most one): OpenAI's response_format,
    vLLM's guided_* fields or its structured_outputs object. The grammar itself is checked by the router."""
    found: list[tuple[str, str, Any]] = []  # (parameter, wire field, value)
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            found.append(("response_format", "json_object", True))
        elif kind == "json_schema":
            inner = response_format.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object",
                                     "response_format.json_schema.schema")
            found.append(("response_format", "json_schema", schema))
        elif kind != "text":
            raise InvalidRequest('response_format.type must be "text", "json_object" or "json_schema"',
                                 "response_format.type")
    for name, field in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, field, body[name]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequest("structured_outputs must be an object", "structured_outputs")
        for key, value in outputs.items():
            if key in STRUCTURED_OUTPUTS and value not in (None, False):
                found.append((f"structured_outputs.{key}", STRUCTURED_OUTPUTS[key], value))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise InvalidRequest(f"guided_decoding_backend must be one of {', '.join(GRAMMAR_BACKENDS)} (this server's "
                             "grammars are xgrammar's)", "guided_decoding_backend")
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequest(f"one constraint per request: {', '.join(name for name, _, _ in found)} were given",
                             found[1][0])
    name, field, value = found[0]
    if field == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if field == "json_schema":
        if isinstance(value, str):
            value = read_json_field(value, name)
        if not isinstance(value, dict | bool):
            raise InvalidRequest(f"{name} must be a JSON schema object", name)
        return common_pb2.StructuredOutput(json_schema=checked_json(value, name))
    if field == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{name} must be a non-empty array of strings", name)
        return common_pb2.StructuredOutput(choice=common_pb2.StringList(values=[checked_text(c, name) for c in value]))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{name} must be a non-empty string", name)
    return common_pb2.StructuredOutput(**{field: checked_text(value, name)})


def _reject_wrapped(body: dict[str, Any], required: str) -> None:
    """A body wrapped in {"data": {...}} is a common client bug; say so instead of "x is required"."""
    inner = body.get("data")
    if required not in body and isinstance(inner, dict) and required in inner:
        raise InvalidRequest(
            'the request is wrapped in {"data": ...}; send the request object itself as the body', "data"
        )


def _chat_message(out: common_pb2.ChatMessage, message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise InvalidRequest(f"{where} must be an object with role and content, got {type_name(message)}", where)
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequest(f"{where}.role is required and must be a string", f"{where}.role")
    role = ROLE_ALIASES.get(role, role)
    if role not in CHAT_ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(CHAT_ROLES)} or developer, got {echo(role)}",
                             f"{where}.role")
    out.role = role
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if content is None:
        if role != "assistant" or not tool_calls:
            raise InvalidRequest(f"{where}.content is required", f"{where}.content")
    else:
        out.content = _content(content, f"{where}.content")
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise InvalidRequest(f"{where}.{key} must be a string", f"{where}.{key}")
            setattr(out, key, checked_text(value, f"{where}.{key}"))
    if tool_calls is not None:
        if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
            raise InvalidRequest(f"{where}.tool_calls must be an array of objects", f"{where}.tool_calls")
        out.tool_calls_json.extend(checked_json(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(tool_calls))


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or an array of text parts (joined with newlines)."""
    if isinstance(content, str):
        return checked_text(content, where)
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or an array of content parts", where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type_name(part)
            raise InvalidRequest(f"{where}[{i}]: only text content parts are supported, got {echo(kind)}",
                                 f"{where}[{i}]")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}[{i}].text must be a string", f"{where}[{i}].text")
        texts.append(checked_text(text, f"{where}[{i}].text"))
    return "\n".join(texts)


def _prompts(prompt: Any) -> list[router_pb2.GenerateRequest]:
    """The legacy API's prompt: a string, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [router_pb2.GenerateRequest(prompt=checked_text(prompt, "prompt"))]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("prompt must be a string, an array of strings, an array of token ids "
                             "or an array of token-id arrays", "prompt")
    if all(is_token_id(t) for t in prompt):
        return [_token_prompt(prompt, "prompt")]
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    out = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(router_pb2.GenerateRequest(prompt=checked_text(item, f"prompt[{i}]")))
        elif isinstance(item, list) and item and all(is_token_id(t) for t in item):
            out.append(_token_prompt(item, f"prompt[{i}]"))
        else:
            raise InvalidRequest(f"prompt[{i}] must be a string or a non-empty array of token ids", f"prompt[{i}]")
    return out

def _token_prompt(ids: list[int], where: str) -> router_pb2.GenerateRequest:
    if not all(0 <= t <= UINT32_MAX for t in ids):
        raise InvalidRequest(f"{where}: token ids must be non-negative", where)
    return router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=ids))
