"""The tokenizer service over the wire, against a real server process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from qwenserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc


def start_server(*args: str) -> tuple[subprocess.Popen, int]:
    """Run `python -m qwenserve_services.tokenizer.server --port 0` and read the bound port it prints."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwenserve_services.tokenizer.server", "--port", "0", "--grace-s", "1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    line = proc.stdout.readline()  # the server prints exactly one line once bound
    match = re.search(r"listening on 127\.0\.0\.1:(\d+)$", line.strip())
    if match is None:
        proc.kill()
        pytest.fail(f"server did not start: {line!r} {proc.stderr.read()}")
    return proc, int(match.group(1))


def wait_serving(channel: grpc.Channel, timeout_s: float = 30) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        status = stub.Check(health_pb2.HealthCheckRequest(service="qwenserve.v1.Tokenizer")).status
        if status == health_pb2.HealthCheckResponse.SERVING or time.monotonic() > deadline:
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def channel(qwenserve_cache):
    proc, port = start_server()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        wait_serving(ch)
        yield ch
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def stub(channel):
    return tokenizer_pb2_grpc.TokenizerStub(channel)


def test_health_reports_serving_for_the_service_and_the_server(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "qwenserve.v1.Tokenizer"):
        assert (
            stub.Check(health_pb2.HealthCheckRequest(service=service)).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_reflection_lists_the_tokenizer_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"qwenserve.v1.Tokenizer", "grpc.health.v1.Health"} <= names


def test_tokenize_text_bytes_and_chat(stub, qwen3_tokenizer):
    text = "Hello\u200b, 世界 👨‍👩‍👧"
    reply = stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text))
    assert list(reply.ids) == qwen3_tokenizer.encode("Hello, 世界 👨‍👩‍👧") and reply.count == len(reply.ids)
    assert stub.Tokenize(tokenizer_pb2.TokenizeRequest(text_bytes=text.encode())).ids == reply.ids
    chat = common_pb2.ChatInput(
        messages=[
            common_pb2.ChatMessage(role="system", content="Be brief."),
            common_pb2.ChatMessage(role="user", content="hi"),
        ],
        add_generation_prompt=True,
        enable_thinking=False,
    )
    reply = stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat))
    assert reply.rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert list(reply.ids) == qwen3_tokenizer.encode(reply.rendered)


def test_tools_and_tool_calls_reach_the_template(stub):
    chat = common_pb2.ChatInput(
        messages=[
            common_pb2.ChatMessage(role="user", content="weather?"),
            common_pb2.ChatMessage(
                role="assistant", tool_calls_json=['{"function": {"name": "w", "arguments": {"c": 1}}}']
            ),
            common_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="x"),
        ],
        tools_json=['{"type": "function", "function": {"name": "w"}}'],
    )
    rendered = stub.Tokenize(tokenizer_pb2.TokenizeRequest(chat=chat)).rendered
    assert '<tools>\n{"type": "function", "function": {"name": "w"}}\n</tools>' in rendered
    assert '<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>' in rendered
    assert "<tool_response>\nsunny\n</tool_response>" in rendered


def test_truncation_keeps_the_requested_side(stub):
    text = "one two three four five six"
    full = list(stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text)).ids)
    right = stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, max_length=2))
    left = stub.Tokenize(
        tokenizer_pb2.TokenizeRequest(
            text=text, max_length=2, truncation_side=tokenizer_pb2.TRUNCATION_SIDE_LEFT
        )
    )
    assert list(right.ids) == full[:2] and list(left.ids) == full[-2:]
    assert right.truncated and right.count == len(full) == 6


def test_batch_and_count_answer_in_order(stub, qwen3_tokenizer, corpus):
    texts = corpus[:64]
    batch = stub.TokenizeBatch(
        tokenizer_pb2.TokenizeBatchRequest(requests=[tokenizer_pb2.TokenizeRequest(text=t) for t in texts])
    )
    assert [list(r.ids) for r in batch.responses] == qwen3_tokenizer.encode_batch(texts)
    counts = stub.CountTokens(tokenizer_pb2.CountTokensRequest(texts=texts))
    assert list(counts.counts) == [len(r.ids) for r in batch.responses] and counts.total == sum(counts.counts)


def test_detokenize_stream_never_splits_a_character(stub, qwen3_tokenizer):
    byte_ids = {qwen3_tokenizer.token_bytes(i)[0]: i for i in range(256)}
    text = "a你👍🏽b"
    requests = [tokenizer_pb2.DetokenizeRequest(ids=[byte_ids[b]]) for b in text.encode()]
    deltas = [r.text for r in stub.Detokenize(iter(requests))]
    assert "".join(deltas) == text and "\ufffd" not in "".join(deltas)
    assert deltas[1:3] == ["", ""] and deltas[3] == "你"
    skip = [tokenizer_pb2.DetokenizeRequest(ids=[151644, 9707, 151645], skip_special_tokens=True)]
    assert [r.text for r in stub.Detokenize(iter(skip))] == ["Hello"]


def test_get_info_describes_the_vocabulary(stub):
    info = stub.GetInfo(tokenizer_pb2.GetInfoRequest())
    assert info.vocab_size == 151669 and info.special_tokens["<|im_end|>"] == 151645
    assert list(info.eos_token_ids) == [151645, 151643] and "<|im_start|>" in info.chat_template


BAD_REQUESTS = {
    "nothing": (tokenizer_pb2.TokenizeRequest(), "no input"),
    "empty_text": (tokenizer_pb2.TokenizeRequest(text=""), "empty"),
    "huge_text": (tokenizer_pb2.TokenizeRequest(text="x" * (2 << 20)), "larger than the limit"),
    "invalid_utf8": (tokenizer_pb2.TokenizeRequest(text_bytes=b"ok\xff\xfe"), "not valid UTF-8"),
    "unknown_role": (
        tokenizer_pb2.TokenizeRequest(
            chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(role="wizard", content="x")])
        ),
        "role",
    ),
    "empty_chat": (tokenizer_pb2.TokenizeRequest(chat=common_pb2.ChatInput()), "empty"),
    "bad_tools_json": (
        tokenizer_pb2.TokenizeRequest(
            chat=common_pb2.ChatInput(
                messages=[common_pb2.ChatMessage(role="user", content="x")], tools_json=["{nope"]
            )
        ),
        "tools_json[0]",
    ),
    "too_long": (
        tokenizer_pb2.TokenizeRequest(text="a b c d", max_length=2, reject_if_longer=True),
        "more than 2",
    ),
    # JSON fields are read with the router's bounded reader: no RecursionError, no lone surrogate in a template.
    "deep_tools_json": (
        tokenizer_pb2.TokenizeRequest(
            chat=common_pb2.ChatInput(
                messages=[common_pb2.ChatMessage(role="user", content="x")], tools_json=["[" * 100_000]
            )
        ),
        "nested too deeply",
    ),
    "lone_surrogate_in_tools_json": (
        tokenizer_pb2.TokenizeRequest(
            chat=common_pb2.ChatInput(
                messages=[common_pb2.ChatMessage(role="user", content="x")],
                tools_json=['{"type": "function", "function": {"name": "\\ud800"}}'],
            )
        ),
        "tools_json[0].function.name",
    ),
    "deep_tool_calls_json": (
        tokenizer_pb2.TokenizeRequest(
            chat=common_pb2.ChatInput(
                messages=[common_pb2.ChatMessage(role="assistant", tool_calls_json=['{"a":' * 50_000 + "}" * 50_000])]
            )
        ),
        "nested too deeply",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_the_server_stays_up(stub, case):
    request, words = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    assert stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="still here")).count == 2


def test_bad_batches_and_out_of_range_ids_are_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.CountTokens(tokenizer_pb2.CountTokensRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.TokenizeBatch(
            tokenizer_pb2.TokenizeBatchRequest(
                requests=[tokenizer_pb2.TokenizeRequest(text="a"), tokenizer_pb2.TokenizeRequest()]
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "requests[1]" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(
            stub.Detokenize(
                iter(
                    [
                        tokenizer_pb2.DetokenizeRequest(ids=[9707]),
                        tokenizer_pb2.DetokenizeRequest(ids=[5, 10**9]),
                    ]
                )
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1000000000" in err.value.details()
    assert stub.CountTokens(tokenizer_pb2.CountTokensRequest(texts=["ok"])).total == 1


def test_sigterm_drains_and_exits_cleanly(qwenserve_cache):
    proc, port = start_server()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        wait_serving(ch)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    assert "draining" in proc.stderr.read()
