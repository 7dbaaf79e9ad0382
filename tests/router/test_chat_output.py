"""Reasoning and tool calls split out of a chat answer's text, however the stream cuts it."""

from __future__ import annotations

import json
import random

import pytest

from qwenserve.router.chat_output import ChatOutput, ChatShape, forced_prefix
from qwenserve.router.reasoning import ReasoningSplitter, thinking_closed_in_prompt, thinking_open_in_prompt
from qwenserve.router.tool_calls import ToolCallParser, parse_call

THINK_START_ID, THINK_END_ID = 151667, 151668


def _cuts(text: str, seed: int) -> list[list[str]]:
    """The text whole, a character at a time, and cut at random places."""
    rng = random.Random(seed)
    random_cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *random_cuts], [*random_cuts, len(text)], strict=True)]
    return [[text], list(text), pieces]


def _split(text: str, open_in_prompt: bool = False, seed: int = 0) -> set[tuple[str, str]]:
    results = set()
    for pieces in _cuts(text, seed):
        splitter = ReasoningSplitter(open_in_prompt)
        reasoning, content = "", ""
        for piece in pieces:
            r, c = splitter.push(piece)
            reasoning, content = reasoning + r, content + c
        r, c = splitter.flush()
        results.add((reasoning + r, content + c))
    return results


@pytest.mark.parametrize(("text", "open_in_prompt", "expected"), [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, ("Let me see.", "Paris.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Paris.", False, ("", "Paris.")),
    ("\n\nParis, <think> is only text here", False, ("", "\n\nParis, <think> is only text here")),
    ("Let me see.\n</think>\n\nParis.", True, ("Let me see.", "Paris.")),  # the template opened the block
    ("<think>\nstill thinking when max_tokens", False, ("still thinking when max_tokens", "")),
    ("<think></think>Paris.", False, ("", "Paris.")),
    ("<thin", False, ("", "<thin")),  # an answer that only looks like a tag's start
    ("<think>a < b </thinker> c</think>d", False, ("a < b </thinker> c", "d")),
])
def test_the_split_does_not_depend_on_where_the_stream_is_cut(text: str, open_in_prompt: bool,
                                                              expected: tuple[str, str]) -> None:
    assert _split(text, open_in_prompt) == {expected}


def test_a_prompt_opens_thinking_when_its_last_think_tag_is_an_opening_one() -> None:
    assert thinking_open_in_prompt([1, THINK_START_ID, 198], THINK_START_ID, THINK_END_ID)
    assert not thinking_open_in_prompt([THINK_START_ID, 271, THINK_END_ID, 271], THINK_START_ID, THINK_END_ID)
    assert not thinking_open_in_prompt([1, 2, 3], THINK_START_ID, THINK_END_ID)


def _parse(text: str, prefix: str = "", seed: int = 0) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    results = set()
    for pieces in _cuts(text, seed):
        parser = ToolCallParser(prefix)
        content, calls = "", []
        for piece in pieces:
            c, made = parser.push(piece)
            content, calls = content + c, calls + made
        c, made = parser.flush()
        content, calls = content + c, calls + made
        assert [c.index for c in calls] == list(range(len(calls)))
        results.add((content, tuple((c.name, c.arguments_json) for c in calls)))
    return results


CALL = '{"name": "get_weather", "arguments": {"city": "巴黎"}}'


@pytest.mark.parametrize(("text", "content", "calls"), [
    (f"<tool_call>\n{CALL}\n</tool_call>", "", [("get_weather", {"city": "巴黎"})]),
    (f"Checking.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": "{}"}\n</tool_call>', "Checking.\n\n",
     [("get_weather", {"city": "巴黎"}), ("get_time", {})]),
    (f"<tool_call>\n{CALL}", "", [("get_weather", {"city": "巴黎"})]),  # the answer ended before the tag
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci", "<tool_call>\n{\"name\": \"get_weather\", "
     "\"arguments\": {\"ci", []),  # cut off by max_tokens: text, not a call
    ("<tool_call>not json</tool_call> rest", "<tool_call>not json</tool_call> rest", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("a < b <tool and <tool_cal", "a < b <tool and <tool_cal", []),
])
def test_tool_calls_parse_the_same_however_the_stream_is_cut(text: str, content: str,
                                                             calls: list[tuple[str, dict]]) -> None:
    (result,) = _parse(text)
    assert result[0] == content
    assert [(name, json.loads(arguments)) for name, arguments in result[1]] == calls


def test_a_forced_start_is_a_call_already_open() -> None:
    prefix = forced_prefix("function", "get_weather")
    ((content, calls),) = _parse('{"city": "Paris"}}\n</tool_call>', prefix=prefix)
    assert content == "" and [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]
    assert forced_prefix("required", "") == "<tool_call>" and forced_prefix("auto", "") == ""


def test_parse_call_wants_a_name_and_an_object_of_arguments() -> None:
    assert parse_call('{"name": "f", "parameters": {"x": 1}}') == ("f", '{"x": 1}')
    assert parse_call('{"name": "f"}') == ("f", "{}")
    for bad in ('{"name": "", "arguments": {}}', '{"name": "f", "arguments": [1]}', "[]", '{"name": 3}',
                '{"name": "f", "arguments": "not json"}'):
        assert parse_call(bad) is None, bad


def test_chat_output_counts_thinking_tokens_up_to_the_closing_tag() -> None:
    output = ChatOutput(ChatShape(reasoning=True, think_end_id=THINK_END_ID, tools=True))
    pieces = [("<think>", [THINK_START_ID]), ("\nhm", [10, 11]), ("</think>", [THINK_END_ID]), ("\n\nok", [12]),
              (f"<tool_call>{CALL}</tool_call>", [13, 14])]
    reasoning, content, calls = "", "", []
    for text, ids in pieces:
        r, c, made = output.push(text, ids)
        reasoning, content, calls = reasoning + r, content + c, calls + made
    r, c, made = output.flush()
    assert (reasoning + r, content + c) == ("hm", "ok") and len(calls + made) == 1
    assert output.reasoning_tokens == 4 and output.called

    plain = ChatOutput(ChatShape(reasoning=True, think_end_id=THINK_END_ID))
    plain.push("Paris", [5])
    assert plain.reasoning_tokens == 0 and not plain.called


def test_a_prompt_that_ends_in_a_closed_thinking_block_has_turned_thinking_off() -> None:
    text = {7: "\n\n", 8: "Hi", 9: " "}.get

    def text_of(ids: list[int]) -> str:
        return "".join(text(i, "?") for i in ids)

    end = 2
    assert thinking_closed_in_prompt([5, 1, end, 7], end, text_of)  # "<think>\n\n</think>\n\n"
    assert thinking_closed_in_prompt([5, 1, end], end, text_of)
    assert not thinking_closed_in_prompt([5, 1, end, 7, 8, 9], end, text_of)  # a past turn's block, then text
    assert not thinking_closed_in_prompt([5, 1, 7], end, text_of)
    assert not thinking_closed_in_prompt([end] + [9] * 9, end, text_of)
