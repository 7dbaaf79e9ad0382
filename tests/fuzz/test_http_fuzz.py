"""Whatever a client POSTs to the OpenAI front, it gets a 2xx or a 4xx with an OpenAI error object, within
a bound, with exactly one terminal event; and the cluster serves and reports healthy afterwards.

A 5xx is ours to fix: every client mistake is a 4xx. An accepted request that then fails (a choice
ending with finish_reason "error") is a server fault too: nothing here injects faults.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.client import FuzzClient, Tally, assert_still_serving, fuzz_settings, request_bound
from tests.fuzz.strategies import (
    AUTH_GOOD,
    MODEL_NAME,
    POOL_TOKENS,
    authorized,
    chat_bodies,
    completion_bodies,
    encoded,
    generation_budget,
    http_headers,
    refusal_reason,
)
from tests.support.answers import Answer, http_post
from tests.support.deployment import Deployment

GOOD_HEADERS = {"Authorization": AUTH_GOOD, "Content-Type": "application/json"}
HI = [{"role": "user", "content": "hi"}]


def check(answer: Answer, sent: bytes, headers: dict[str, str], bound_s: float,
          must_refuse: str | None = None) -> None:
    """The contract for one request, with the request in every failure message."""
    what = f"\nrequest body: {sent[:600]!r}\nheaders: {headers}\nanswer: {answer.describe()}"
    assert answer.ended, f"no terminal answer{what}"
    assert answer.elapsed_s < bound_s, f"took {answer.elapsed_s:.1f}s, more than {bound_s:.0f}s{what}"
    status = answer.http_status
    assert 200 <= status < 300 or 400 <= status < 500, f"HTTP {status}{what}"
    assert not answer.problems, f"broke the one-terminal-event rule{what}"
    if not authorized(headers):
        assert status == 401, f"a request without a valid key was not refused with 401{what}"
    elif must_refuse:
        assert 400 <= status < 500, f"not refused although {must_refuse}{what}"
    if status < 300:
        assert answer.succeeded, f"an accepted request did not finish normally{what}"


def _post_and_check(client: FuzzClient, tally: Tally, path: str, kind: str, body: dict[str, Any], raw: bytes,
                    headers: dict[str, str]) -> None:
    bound = request_bound(generation_budget(body, kind))
    answer = client.post(path, raw, headers, bound)
    tally.add(answer, raw)
    check(answer, raw, headers, bound, refusal_reason(body, kind))


def test_any_completions_body_gets_a_2xx_or_4xx_with_one_terminal_event(
    client: FuzzClient, serving: Deployment
) -> None:
    tally = Tally()

    @fuzz_settings(ci_examples=80)
    @given(sent=encoded(completion_bodies), headers=http_headers)
    # The reproducers, tried first on every run.
    @example(sent=({"max_tokens": 4, "min_tokens": 2, "stop_token_ids": [2**32 - 1]},
                   b'{"prompt":"hi","max_tokens":4,"min_tokens":2,"stop_token_ids":[4294967295]}'),
             headers=GOOD_HEADERS)
    @example(sent=({"max_tokens": 4, "model": "\ud800"}, b'{"prompt":"hi","max_tokens":4,"model":"\\ud800"}'),
             headers=GOOD_HEADERS)
    @example(sent=({"max_tokens": 600}, b'{"prompt":"hi","max_tokens":600}'), headers=GOOD_HEADERS)
    @example(sent=({"max_tokens": 4, "temperature": 10**400},
                   b'{"prompt":"hi","max_tokens":4,"temperature":1' + b"0" * 400 + b"}"),
             headers=GOOD_HEADERS)
    def check_completions(sent: tuple[dict[str, Any], bytes], headers: dict[str, str]) -> None:
        _post_and_check(client, tally, "/v1/completions", "completion", *sent, headers)

    check_completions()
    tally.check_reach()
    assert_still_serving(serving)


def test_any_chat_body_gets_a_2xx_or_4xx_with_one_terminal_event(
    client: FuzzClient, serving: Deployment
) -> None:
    tally = Tally()
    tool_call = {"id": "1", "type": "function", "function": {"name": "\ud800", "arguments": "{}"}}

    @fuzz_settings(ci_examples=80)
    @given(sent=encoded(chat_bodies), headers=http_headers)
    @example(sent=({}, json.dumps({"messages": HI}).encode()), headers=GOOD_HEADERS)
    @example(sent=({"max_tokens": 4}, json.dumps({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [tool_call]}, *HI], "max_tokens": 4}).encode()),
        headers=GOOD_HEADERS)
    @example(sent=({"max_tokens": 4}, json.dumps(
        {"messages": HI, "max_tokens": 4, "chat_template_kwargs": {"x": "\udfff"}}).encode()),
        headers=GOOD_HEADERS)
    def check_chat(sent: tuple[dict[str, Any], bytes], headers: dict[str, str]) -> None:
        _post_and_check(client, tally, "/v1/chat/completions", "chat", *sent, headers)

    check_chat()
    tally.check_reach()
    assert_still_serving(serving)


def _nested(depth: int, inside: bytes = b"1") -> bytes:
    return b"[" * depth + inside + b"]" * depth


def _objects(depth: int) -> bytes:
    return b'{"a": ' * depth + b"1" + b"}" * depth


CHAT_PREFIX = b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]' % (
    MODEL_NAME.encode())
# Bytes that are barely a request: nesting past any recursion limit, broken encodings, bad numbers.
raw_bodies = st.one_of(
    st.integers(100, 200_000).map(_nested),
    st.integers(1_000, 100_000).map(lambda d: b'{"prompt": ' + _nested(d) + b', "max_tokens": 4}'),
    st.integers(1_000, 100_000).map(lambda d: CHAT_PREFIX + b', "x": ' + _objects(d) + b"}"),
    st.binary(max_size=300),
    encoded(completion_bodies).flatmap(lambda sent: st.integers(0, len(sent[1])).map(lambda n: sent[1][:n])),
    st.sampled_from([
        b"", b" ", b"null", b"[]", b"1", b'"text"', b"NaN", b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00",
        b'{"prompt": NaN}', b'{"prompt": "hi", "max_tokens": Infinity}',
        b'{"prompt": "hi", "temperature": -Infinity}',
        b'{"prompt": "hi", "prompt": ["dup"], "max_tokens": 4}',
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": "hi", "max_tokens": 1e999}',
        b'{"prompt": "\\ud800", "max_tokens": 4}', b'{"model": "\\udfff", "prompt": "hi"}',
        b'{"prompt": "hi\xed\xa0\x80", "max_tokens": 4}',
        b'{"prompt": "hi", "max_tokens": 4, "stream": true, "stream_options": {"include_usage": null}}',
        b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
    ]),
)


def test_raw_bodies_that_are_barely_json_get_a_2xx_or_4xx(
    client: FuzzClient, serving: Deployment
) -> None:
    @fuzz_settings(ci_examples=60)
    @given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    @example(raw=_nested(100_000), path="/v1/chat/completions")
    def check_raw(raw: bytes, path: str) -> None:
        bound = request_bound(POOL_TOKENS)  # a truncated body may be whole, with any max_tokens
        check(client.post(path, raw, GOOD_HEADERS, bound), raw, GOOD_HEADERS, bound)

    check_raw()
    assert_still_serving(serving)


def test_two_requests_in_flight_with_the_same_request_id_both_get_a_clean_answer(
    client: FuzzClient, serving: Deployment
) -> None:
    @fuzz_settings(ci_examples=8)
    @given(request_id=st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True), stream=st.booleans(),
           kind=st.sampled_from(["completions", "chat"]))
    @example(request_id="same-id", stream=True, kind="chat")
    def check_duplicates(request_id: str, stream: bool, kind: str) -> None:
        body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 16, "stream": stream, "ignore_eos": True}
        body.update({"messages": HI} if kind == "chat" else {"prompt": "hi"})
        raw = json.dumps(body).encode()
        headers = {**GOOD_HEADERS, "X-Request-Id": request_id}
        url = f"{serving.http_base}/v1/{'chat/completions' if kind == 'chat' else 'completions'}"
        bound = request_bound(16)

        async def both() -> list[Answer]:
            return list(await asyncio.gather(*(http_post(client.session, url, raw, headers, bound)
                                               for _ in range(2))))

        answers = client.run(both())
        for answer in answers:
            check(answer, raw, headers, bound)
        assert any(a.succeeded for a in answers), [a.describe() for a in answers]

    check_duplicates()
    assert_still_serving(serving)
