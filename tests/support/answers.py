"""One request's answer as its client saw it, over HTTP (JSON or server-sent events) and gRPC.

Every call runs under a time bound and is reduced to an `Answer`: the status, how long it took, the
terminal events it carried and, in words, every way it broke the rule that a request ends with
exactly one terminal event. The fuzz and chaos suites judge answers; they never parse wire formats.

Terminal events:
- HTTP, not streamed: the response itself (a JSON body with `choices`, or an OpenAI error object).
- HTTP, streamed: per choice one chunk with a `finish_reason` (or one top-level `error` event for
  the whole stream), then exactly one `data: [DONE]`, and nothing after it.
- gRPC: exactly one message with a finish reason, the last, on an OK stream; or an error status
  with no such message before it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp
import grpc

from qwenserve.protocol import FINISH_REASON_NAMES
from qwenserve.v1 import router_pb2, router_pb2_grpc

# How an answer that never reached its terminal event is labelled.
HUNG = "hung"  # nothing ended it within the bound
CUT = "cut"  # the server dropped the connection without a terminal event
DISCONNECTED = "disconnected"  # the client left on purpose (chaos suite)
# Finish reasons of a generation that went as asked.
NORMAL_FINISHES = ("stop", "length")


@dataclass
class Answer:
    """What one request got back."""

    transport: str  # "http" or "grpc"
    # HTTP: the status code as text ("200", "400"); gRPC: the status code's name ("OK",
    # "INVALID_ARGUMENT"); or HUNG / CUT / DISCONNECTED.
    status: str
    elapsed_s: float
    # The finish reason of every terminal event, one per choice ("error" for a top-level error event).
    finishes: list[str] = field(default_factory=list)
    # The OpenAI error object's code, or the gRPC ErrorDetail code / status details.
    error_code: str = ""
    error_message: str = ""
    # Ways the answer broke the one-terminal-event rule, in words.
    problems: list[str] = field(default_factory=list)
    # The first bytes of the body, for failure messages.
    excerpt: str = ""

    @property
    def http_status(self) -> int:
        """The HTTP status as a number (0 for HUNG / CUT / DISCONNECTED and for gRPC)."""
        return int(self.status) if self.transport == "http" and self.status.isdigit() else 0

    @property
    def ended(self) -> bool:
        """The server ended the request with a status (no hang, no cut connection, no disconnect)."""
        return self.status not in (HUNG, CUT, DISCONNECTED)

    @property
    def succeeded(self) -> bool:
        """A 2xx / OK answer whose every choice finished normally (stop or length), rule kept."""
        ok = (200 <= self.http_status < 300) if self.transport == "http" else self.status == "OK"
        normal = bool(self.finishes) and all(f in NORMAL_FINISHES for f in self.finishes)
        return ok and normal and not self.problems

    @property
    def clean_error(self) -> bool:
        """Ended with exactly one terminal event that says it failed, with an error code or message."""
        if not self.ended or self.problems or self.succeeded:
            return False
        return bool(self.error_code or self.error_message)

    def describe(self) -> str:
        """One line for assertion messages."""
        parts = [f"{self.transport} {self.status} after {self.elapsed_s:.1f}s", f"finishes={self.finishes}"]
        if self.error_code or self.error_message:
            parts.append(f"error={self.error_code}: {self.error_message[:200]}")
        if self.problems:
            parts.append(f"problems={self.problems}")
        if self.excerpt:
            parts.append(f"body={self.excerpt[:300]!r}")
        return "; ".join(parts)


# -- HTTP ----------------------------------------------------------------------------------------


async def http_post(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], bound_s: float
) -> Answer:
    """POST `body` to `url` and read the whole answer (JSON or SSE) within `bound_s` seconds."""
    started = time.monotonic()
    answer = Answer("http", HUNG, 0.0)
    try:
        async with asyncio.timeout(bound_s):
            async with session.post(url, data=body, headers=headers) as response:
                answer.status = str(response.status)
                if response.content_type == "text/event-stream":
                    await _read_events(response, answer)
                else:
                    _judge_body(await response.read(), response.status, answer)
    except TimeoutError:
        answer.status = HUNG
        answer.problems.append(f"no terminal event within {bound_s:.0f}s")
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        answer.status = CUT
        answer.problems.append(f"the connection broke without a terminal event: {type(e).__name__}: {e}")
    answer.elapsed_s = time.monotonic() - started
    return answer


def _judge_body(raw: bytes, status: int, answer: Answer) -> None:
    answer.excerpt = raw[:400].decode("utf-8", "replace")
    try:
        body = json.loads(raw)
    except ValueError:
        answer.problems.append("the body is not JSON")
        return
    if 200 <= status < 300:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or not choices:
            answer.problems.append("a 2xx answer without choices")
            return
        answer.finishes = [c.get("finish_reason") for c in choices]
        if any(f is None for f in answer.finishes):
            answer.problems.append("a choice of a finished answer has no finish_reason")
        return
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not error["message"]:
        answer.problems.append(f"HTTP {status} without an OpenAI error object")
        return
    answer.error_code = str(error.get("code") or "")
    answer.error_message = error["message"]


async def _read_events(response: aiohttp.ClientResponse, answer: Answer) -> None:
    finishes: dict[int, list[str]] = defaultdict(list)
    seen: set[int] = set()
    done = 0
    async for raw_line in response.content:
        line = raw_line.decode("utf-8", "replace").rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if done:
            answer.problems.append(f"an event after [DONE]: {data[:80]!r}")
        if data == "[DONE]":
            done += 1
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            answer.problems.append(f"an event that is not JSON: {data[:80]!r}")
            continue
        if "error" in chunk and "choices" not in chunk:
            answer.finishes.append("error")
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            answer.error_code = str(error.get("code") or "")
            answer.error_message = str(error.get("message") or "")
            continue
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            seen.add(index)
            if choice.get("finish_reason") is not None:
                finishes[index].append(choice["finish_reason"])
                if isinstance(choice.get("error"), dict):
                    answer.error_code = str(choice["error"].get("code") or "")
                    answer.error_message = str(choice["error"].get("message") or "")
    if done != 1:
        answer.problems.append("the stream ended without [DONE]" if not done else f"{done} [DONE] events")
    if "error" in answer.finishes:
        if len(answer.finishes) > 1 or finishes:
            answer.problems.append("a top-level error event besides other terminal events")
        return
    if not seen:
        answer.problems.append("a stream without any choice")
    if seen != set(range(len(seen))):
        answer.problems.append(f"choice indices {sorted(seen)} are not 0..n-1")
    for index in sorted(seen):
        if len(finishes[index]) != 1:
            answer.problems.append(f"choice {index} has {len(finishes[index])} finish_reason chunks")
        answer.finishes.extend(finishes[index])


# -- gRPC ----------------------------------------------------------------------------------------


async def grpc_generate(
    stub: router_pb2_grpc.RouterStub,
    request: router_pb2.GenerateRequest,
    metadata: tuple[tuple[str, str], ...],
    bound_s: float,
) -> Answer:
    """Run one Generate stream with no gRPC deadline (a request without one must still end) and read it
    to its end within `bound_s` seconds; cancelled by the client after that."""
    started = time.monotonic()
    answer = Answer("grpc", HUNG, 0.0)
    call = stub.Generate(request, metadata=metadata)
    messages: list[router_pb2.GenerateResponse] = []
    try:
        async with asyncio.timeout(bound_s):
            async for message in call:
                messages.append(message)
        answer.status = "OK"
    except TimeoutError:
        call.cancel()
        answer.problems.append(f"no terminal event within {bound_s:.0f}s")
    except asyncio.CancelledError:
        call.cancel()  # the client leaves: the server must see the call cancelled at once
        raise
    except grpc.aio.AioRpcError as e:
        answer.status = e.code().name
        answer.error_message = e.details() or ""
        answer.error_code = e.code().name.lower()
    answer.elapsed_s = time.monotonic() - started
    _judge_messages(messages, answer)
    return answer


def _judge_messages(messages: list[router_pb2.GenerateResponse], answer: Answer) -> None:
    terminal = [i for i, m in enumerate(messages) if m.finish_reason]
    answer.finishes = [FINISH_REASON_NAMES.get(messages[i].finish_reason, "unknown") for i in terminal]
    if terminal:
        last = messages[terminal[-1]]
        if last.HasField("error"):
            answer.error_code, answer.error_message = last.error.code, last.error.message
    if answer.status == "OK":
        if len(terminal) != 1:
            answer.problems.append(f"an OK stream with {len(terminal)} finish_reason messages")
        elif terminal[0] != len(messages) - 1:
            answer.problems.append("messages after the one with the finish_reason")
    elif answer.ended and terminal:
        answer.problems.append(f"a finish_reason message and then the status {answer.status}")
