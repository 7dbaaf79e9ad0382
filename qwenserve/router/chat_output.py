"""A chat answer's text shaped as the OpenAI chat API returns it: reasoning, content and tool calls.

The router decides per request (`ChatShape`, from the request and its prompt); `ChatOutput` then takes
the answer's text deltas and token ids as they stream and hands back each delta's three parts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qwenserve.router.errors import InvalidRequest
from qwenserve.router.reasoning import ReasoningSplitter, thinking_open_in_prompt
from qwenserve.router.tool_calls import TOOL_START, ToolCallParser
from qwenserve.untrusted_input import JsonRefused, echo, read_json
from qwenserve.v1 import common_pb2, router_pb2

TOOL_CHOICES = ("auto", "none", "required", "function")


@dataclass(frozen=True, slots=True)
class ChatShape:
    """How one chat answer is split."""

    reasoning: bool = False  # split <think> blocks out of the content
    open_in_prompt: bool = False  # the prompt ends inside a thinking block
    think_end_id: int = -1  # the </think> token: the reasoning tokens end with it
    tools: bool = False  # parse <tool_call> blocks
    prefix: str = ""  # the answer's forced start (not part of the output)


def forced_prefix(tool_choice: str, name: str) -> str:
    """The start of the answer that makes the model call a tool (required) or this tool (function)."""
    if tool_choice == "required":
        return TOOL_START
    if tool_choice == "function":
        return f'{TOOL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
    return ""


def tool_choice_of(req: router_pb2.GenerateRequest, tool_call_parser: str) -> tuple[str, str]:
    """(tool_choice, the answer's forced start) of a chat request that offers tools; ("none", "") otherwise.

    Raises InvalidRequest for an unknown choice, tools on a server that parses none, a tool that is not a JSON
    object, or a named tool that is not offered.
    """
    if req.WhichOneof("input") != "chat" or not req.chat.tools_json:
        return "none", ""
    choice = req.chat.tool_choice or "auto"
    if choice not in TOOL_CHOICES:
        raise InvalidRequest(f"chat.tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {echo(choice)}",
                             "chat.tool_choice")
    if choice == "none":
        return choice, ""
    if tool_call_parser == "none":
        raise InvalidRequest("tools are turned off on this server (--tool-call-parser none)", "chat.tools_json")
    names = set()
    for i, raw in enumerate(req.chat.tools_json):
        function = json_object(raw, f"chat.tools_json[{i}]").get("function")
        names.add(function.get("name") if isinstance(function, dict) else None)
    if choice == "function" and req.chat.tool_choice_name not in names:
        raise InvalidRequest(f"chat.tool_choice_name {echo(req.chat.tool_choice_name)} is not one of the tools",
                             "chat.tool_choice_name")
    return choice, forced_prefix(choice, req.chat.tool_choice_name)


def check_chat_json(chat: common_pb2.ChatInput) -> None:
    """Every JSON field of a chat (tools, template variables, earlier tool calls) read as an HTTP body's JSON is:
    bounded in size and nesting, valid Unicode, an object. Raises InvalidRequest naming the field, before the
    tokenizer (which parses them again) is called."""
    for i, raw in enumerate(chat.tools_json):
        json_object(raw, f"chat.tools_json[{i}]")
    if chat.chat_template_kwargs_json:
        json_object(chat.chat_template_kwargs_json, "chat.chat_template_kwargs_json")
    for i, message in enumerate(chat.messages):
        for j, raw in enumerate(message.tool_calls_json):
            json_object(raw, f"chat.messages[{i}].tool_calls_json[{j}]")


def json_object(raw: str, field: str) -> dict[str, Any]:
    """`raw` read by the bounded JSON reader, which must find an object there; InvalidRequest naming `field`."""
    try:
        value = read_json(raw, field)
    except JsonRefused as e:
        raise InvalidRequest(e.message, e.field) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{field} must be a JSON object", field)
    return value


def chat_shape_of(req: router_pb2.GenerateRequest, prompt_ids: list[int], tools: tuple[str, str],
                  think: tuple[int, int] | None) -> ChatShape:
    """How a chat request's answer is split: `tools` from `tool_choice_of`, `think` the <think> and </think>
    ids when reasoning is split out (None: it is not)."""
    choice, prefix = tools
    return ChatShape(
        reasoning=think is not None and not prefix,
        open_in_prompt=think is not None and thinking_open_in_prompt(prompt_ids, *think),
        think_end_id=think[1] if think is not None else -1,
        tools=choice != "none",
        prefix=prefix + req.chat.assistant_prefix,
    )


class ChatOutput:
    """Text deltas in; (reasoning, content, completed tool calls) deltas out."""

    def __init__(self, shape: ChatShape) -> None:
        self._splitter = ReasoningSplitter(shape.open_in_prompt) if shape.reasoning else None
        self._tools = ToolCallParser(shape.prefix) if shape.tools else None
        self._think_end_id = shape.think_end_id
        self._thinking_tokens = 0
        self._think_closed = self._splitter is None

    def push(self, text: str, token_ids: Sequence[int]) -> tuple[str, str, list[common_pb2.ToolCall]]:
        self._count(token_ids)
        reasoning, content = self._splitter.push(text) if self._splitter is not None else ("", text)
        return self._with_calls(reasoning, content, final=False)

    def flush(self) -> tuple[str, str, list[common_pb2.ToolCall]]:
        """What is held back, once the answer has ended."""
        reasoning, content = self._splitter.flush() if self._splitter is not None else ("", "")
        return self._with_calls(reasoning, content, final=True)

    @property
    def reasoning_tokens(self) -> int:
        """Completion tokens spent thinking, up to and including the one that closed the block."""
        return self._thinking_tokens if self._splitter is not None and self._splitter.opened else 0

    @property
    def called(self) -> bool:
        """Whether the answer made at least one tool call."""
        return self._tools is not None and self._tools.count > 0

    def _count(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            if self._think_closed:
                return
            self._thinking_tokens += 1
            self._think_closed = token == self._think_end_id

    def _with_calls(self, reasoning: str, content: str, final: bool) -> tuple[str, str, list[common_pb2.ToolCall]]:
        if self._tools is None:
            return reasoning, content, []
        content, calls = self._tools.push(content)
        if final:
            rest, more = self._tools.flush()
            content, calls = content + rest, calls + more
        return reasoning, content, calls
