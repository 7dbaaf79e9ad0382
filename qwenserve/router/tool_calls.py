"""Tool calls out of a Qwen chat answer's content, as the text streams in.

Qwen's chat templates ask for each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
(the Hermes format). Text outside the tags is content; a block whose JSON is not a call (malformed,
no name, arguments not an object) goes back into the content as the model wrote it, never an error.
A block the answer ends inside (no closing tag) is a call if its JSON is complete, else text.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from qwenserve.router.reasoning import partial_tag
from qwenserve.v1 import common_pb2

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def parse_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's JSON, or None when it is not a tool call."""
    try:
        value: Any = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class ToolCallParser:
    """Content pieces in; (content, completed calls) out."""

    def __init__(self, prefix: str = "") -> None:
        self._inside = False
        self._held = ""
        self._block: list[str] = []
        self.count = 0
        if prefix:  # the answer's forced start (tool_choice required or named): a call already open
            self.push(prefix)

    def push(self, text: str) -> tuple[str, list[common_pb2.ToolCall]]:
        content: list[str] = []
        calls: list[common_pb2.ToolCall] = []
        text, self._held = self._held + text, ""
        while text:
            if not self._inside:
                start = text.find(TOOL_START)
                if start < 0:
                    keep = partial_tag(text, TOOL_START)
                    content.append(text[: len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                content.append(text[:start])
                self._inside, self._block, text = True, [], text[start + len(TOOL_START):]
                continue
            end = text.find(TOOL_END)
            if end < 0:
                keep = partial_tag(text, TOOL_END)
                self._block.append(text[: len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            self._block.append(text[:end])
            self._inside, text = False, text[end + len(TOOL_END):]
            self._close(content, calls, closed=True)
        return "".join(content), calls

    def flush(self) -> tuple[str, list[common_pb2.ToolCall]]:
        """What is held back once the answer has ended: an unclosed block becomes a call or text."""
        content: list[str] = []
        calls: list[common_pb2.ToolCall] = []
        if self._inside:
            self._block.append(self._held)
            self._inside = False
            self._close(content, calls, closed=False)
        else:
            content.append(self._held)
        self._held = ""
        return "".join(content), calls

    def _close(self, content: list[str], calls: list[common_pb2.ToolCall], closed: bool) -> None:
        block = "".join(self._block)
        parsed = parse_call(block.strip())
        if parsed is None:
            content.append(TOOL_START + block + (TOOL_END if closed else ""))
            return
        name, arguments = parsed
        calls.append(common_pb2.ToolCall(index=self.count, id=f"call_{uuid.uuid4().hex[:24]}", name=name,
                                         arguments_json=arguments))
        self.count += 1
