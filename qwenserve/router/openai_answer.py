"""One OpenAI answer assembled from its generations: the `n` generations per prompt run concurrently
(`Generations`), each message added to its choice (`Choice`), and the answer's chunks, body and usage
(`Answer`) in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from qwenserve.protocol import FINISH_REASON_NAMES
from qwenserve.router.openai_errors import CLIENT_FAULT_CODES, RETRYABLE_CODES, error_type
from qwenserve.router.openai_request import ParsedRequest
from qwenserve.router.prepared_request import PreparedRequest
from qwenserve.router.shared_prompt_logprobs import SharedPromptLogprobs
from qwenserve.telemetry.metrics import StreamTimer
from qwenserve.v1 import common_pb2, router_pb2

log = logging.getLogger(__name__)

# The finish reasons OpenAI clients know that this server produces; any other ending is a failure.
OPENAI_FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter"}

TokenBytes = Callable[[int], bytes]


def ends_badly(msg: router_pb2.GenerateResponse) -> bool:
    """A terminal message whose finish reason is not an OpenAI one (an error, an abort)."""
    return bool(msg.finish_reason) and FINISH_REASON_NAMES.get(msg.finish_reason) not in OPENAI_FINISH_REASONS


async def relay(response: web.StreamResponse, answer: Answer, index: int,
                msg: router_pb2.GenerateResponse) -> dict[str, Any] | None:
    """Send the chunks of one message already added to its choice; the error object if it failed."""
    choice = answer.choices[index]
    # Tokens that decode to no text yet (a partial character, special tokens, a possible stop
    # string) still get their chunk: the client sees them arrive and, with usage, counts them.
    if msg.token_ids or msg.text or msg.logprobs:
        chunk = answer.chunk([choice.delta(msg)])
        if answer.parsed.kind == "chat" and answer.parsed.prompt_logprobs is not None and msg.prompt_logprobs:
            chunk["prompt_logprobs"] = choice.prompt_logprobs_json()  # the first chunk with tokens, as vLLM
        await send_chunk(response, chunk)
    if choice.failed:
        return choice.failure()[1]
    if msg.finish_reason:
        await send_chunk(response, answer.chunk([choice.closing()]))
    return None


async def send_chunk(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    """One server-sent event: `data: <chunk as compact JSON>`."""
    await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")


# -- running the generations -------------------------------------------------------------------


class Generations:
    """The request's generations as concurrent tasks, merged into one stream of (choice index, message)."""

    def __init__(self, run: Callable[[PreparedRequest], AsyncIterator[router_pb2.GenerateResponse]],
                 runs: Sequence[tuple[int, PreparedRequest]], timer: StreamTimer | None = None,
                 prompt_logprob_lenders: Mapping[int, int] | None = None) -> None:
        self._run = run
        self.timer = timer
        self._shared = SharedPromptLogprobs(prompt_logprob_lenders or {})
        self._queue: asyncio.Queue[tuple[int, router_pb2.GenerateResponse | None]] = asyncio.Queue()
        self._open = len(runs)
        self.disconnected = False
        self._tasks = [asyncio.create_task(self._pump(index, prep)) for index, prep in runs]

    async def _pump(self, index: int, prep: PreparedRequest) -> None:
        stream = self._run(prep)
        try:
            async for msg in stream:
                self._shared.lend(index, msg)
                await self._shared.borrow(index, msg)
                self._queue.put_nowait((index, msg))
                if msg.finish_reason:
                    return
            raise RuntimeError("the router's stream ended without a finish reason")
        except Exception as e:  # any failure still ends this choice with exactly one terminal message
            log.exception("%s: generation failed", prep.request_id)
            self._queue.put_nowait((index, router_pb2.GenerateResponse(
                request_id=prep.request_id,
                finish_reason=common_pb2.FINISH_REASON_ERROR,
                error=common_pb2.ErrorDetail(code="internal_error", message=str(e) or type(e).__name__),
            )))
        finally:
            self._shared.ended(index)
            await stream.aclose()  # closes the decode stream now, not when the generator is collected

    def disconnect(self) -> None:
        """The client went away: stop `events()` at once (the caller then cancels the tasks)."""
        self.disconnected = True
        self._queue.put_nowait((-1, None))

    async def events(self) -> AsyncIterator[tuple[int, router_pb2.GenerateResponse]]:
        """Messages as they arrive, until every choice has its terminal message or the client left."""
        while self._open:
            index, msg = await self._queue.get()
            if msg is None:
                return
            if msg.finish_reason:
                self._open -= 1
            if msg.token_ids and self.timer is not None:
                self.timer.token()
            yield index, msg

    async def cancel(self) -> None:
        """Stop whatever still runs (a disconnect, or an error on our side) and wait for it to stop."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# -- shaping the answer ------------------------------------------------------------------------


@dataclass(slots=True)
class Choice:
    """One answer being assembled: text, logprobs, token counts, finish reason."""

    index: int
    prompt_index: int
    kind: str
    token_bytes: TokenBytes | None
    top_logprobs: int
    want_logprobs: bool
    parallel_tool_calls: bool = True
    echo: str = ""  # the prompt, sent before the first token's text (the legacy API's echo)
    model: str = ""  # the model that answered, when it is not the one chosen at admission
    want_prompt_logprobs: bool = False  # vLLM's prompt_logprobs: shown per choice (chat: on the response)
    echo_logprobs: bool = False  # legacy echo with logprobs: the prompt's tokens lead `logprobs`
    first_prompt_token: int = 0  # the prompt's first token, which has no logprob
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_tokens: int = 0
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    finish_reason: str | None = None
    error: common_pb2.ErrorDetail | None = None

    def add(self, msg: router_pb2.GenerateResponse) -> None:
        self.text.append(msg.text)
        if msg.model:
            self.model = msg.model  # a fallback took over after admission
        self.reasoning.append(msg.reasoning_text)
        self.tool_calls.extend(self._calls(msg))
        self.logprobs.extend(msg.logprobs)
        if msg.prompt_logprobs:
            self.prompt_logprobs = list(msg.prompt_logprobs)
        self.completion_tokens += len(msg.token_ids)
        if msg.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES.get(msg.finish_reason, "error")
            if msg.HasField("usage"):
                self.completion_tokens = msg.usage.completion_tokens
                self.cached_prompt_tokens = msg.usage.cached_prompt_tokens
                self.reasoning_tokens = msg.usage.reasoning_tokens
            if msg.HasField("error"):
                self.error = msg.error

    def opening(self) -> dict[str, Any]:
        """The first chunk of a streamed chat choice: the role."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, msg: router_pb2.GenerateResponse) -> dict[str, Any]:
        """A streamed chunk's choice for one message's text and logprobs."""
        leading = self._leading_prompt_logprobs() if msg.prompt_logprobs else None
        logprobs = self._logprobs(msg.logprobs, leading) if self.want_logprobs else None
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            calls = self._calls(msg)
            if msg.reasoning_text:
                delta["reasoning_content"] = msg.reasoning_text
            if msg.text or not (msg.reasoning_text or calls):
                delta["content"] = msg.text
            if calls:
                delta["tool_calls"] = calls
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        echo, self.echo = self.echo, ""  # streamed once, before the first token's text
        out = {"index": self.index, "text": echo + msg.text, "logprobs": logprobs, "finish_reason": None}
        if self.want_prompt_logprobs and msg.prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs_json()
        return out

    def _calls(self, msg: router_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """A message's tool calls as OpenAI writes them (only the first of an answer without parallel calls)."""
        return [{"index": c.index, "id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments_json}}
                for c in msg.tool_calls if self.parallel_tool_calls or c.index == 0]

    @property
    def failed(self) -> bool:
        """Ended other than by `stop` or `length` (an error, or an abort such as a passed deadline)."""
        return self.finish_reason is not None and self.finish_reason not in OPENAI_FINISH_REASONS

    def failure(self) -> tuple[int, dict[str, Any]]:
        """The HTTP status and OpenAI error object of a failed choice: 4xx when the request was at fault."""
        detail = self.error or common_pb2.ErrorDetail(code="internal_error",
                                                      message=f"generation ended: {self.finish_reason}")
        code = detail.code or "internal_error"
        if code in CLIENT_FAULT_CODES:
            status, message = 400, detail.message
        else:
            status = 503 if detail.retryable or code in RETRYABLE_CODES else 500
            message = f"generation failed: {detail.message}"
        param = detail.field.removeprefix("sampling.") or None
        return status, {"message": message, "type": error_type(status), "param": param, "code": code}

    def summary(self) -> str:
        """How the choice ended, for the request's log line: "length", "error:no_decode_worker", "-"."""
        if self.failed and self.error is not None and self.error.code:
            return f"{self.finish_reason}:{self.error.code}"
        return self.finish_reason or "-"

    def closing(self) -> dict[str, Any]:
        """The last chunk of a streamed choice that ended well: its finish reason."""
        if self.kind == "chat":
            return {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason}
        return {"index": self.index, "text": "", "logprobs": None, "finish_reason": self.finish_reason}

    def full(self) -> dict[str, Any]:
        """The choice of a non-streamed answer."""
        text = "".join(self.text)
        logprobs = self._logprobs(self.logprobs, self._leading_prompt_logprobs()) if self.want_logprobs else None
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reasoning = "".join(self.reasoning)
            if reasoning:
                message["reasoning_content"] = reasoning
            if self.tool_calls:
                message["tool_calls"] = self.tool_calls
                if not text.strip():  # the whitespace around the calls is not an answer
                    message["content"] = None
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason}
        out = {"index": self.index, "text": self.echo + text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        if self.want_prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs_json()
        return out

    def prompt_logprobs_json(self) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then for each position its token and the
        most likely alternatives by id (as a string), with logprob, rank and decoded text."""
        out: list[dict[str, Any] | None] = [None]
        for lp in self.prompt_logprobs:
            entries = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                          "decoded_token": self._token(lp.token_id)[0]}}
            for rank, top in enumerate(lp.top, start=1):
                entries.setdefault(str(top.token_id), {"logprob": top.logprob, "rank": rank,
                                                       "decoded_token": self._token(top.token_id)[0]})
            out.append(entries)
        return out

    def _leading_prompt_logprobs(self) -> list[common_pb2.TokenLogprob | None] | None:
        """The echoed prompt's entries that lead a legacy `logprobs` (once); None when not asked for."""
        if not self.echo_logprobs or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return [common_pb2.TokenLogprob(token_id=self.first_prompt_token), *self.prompt_logprobs]

    def _logprobs(self, items: Sequence[common_pb2.TokenLogprob],
                  leading: Sequence[common_pb2.TokenLogprob] | None = None) -> dict[str, Any]:
        name = self._token
        if self.kind == "chat":
            content = []
            for lp in items:
                token, raw = name(lp.token_id)
                content.append({
                    "token": token, "logprob": lp.logprob, "bytes": list(raw),
                    "top_logprobs": [
                        {"token": t, "logprob": top.logprob, "bytes": list(b)}
                        for top in lp.top[: self.top_logprobs]
                        for t, b in [name(top.token_id)]
                    ],
                })
            return {"content": content, "refusal": None}
        # With echo, the prompt's tokens come first; the very first has no logprob (null, as OpenAI writes it).
        entries = [*(leading or []), *items]
        tokens = [name(lp.token_id)[0] for lp in entries]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        none_first = bool(leading)
        return {
            "tokens": tokens,
            "token_logprobs": [None if none_first and i == 0 else lp.logprob for i, lp in enumerate(entries)],
            "top_logprobs": [None if none_first and i == 0 else
                             {name(t.token_id)[0]: t.logprob for t in lp.top[: self.top_logprobs]}
                             for i, lp in enumerate(entries)] if self.top_logprobs else None,
            "text_offset": offsets,
        }

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """A token as OpenAI shows it: its text (invalid UTF-8 replaced) and its exact bytes."""
        raw = self.token_bytes(token_id) if self.token_bytes is not None else b""
        return raw.decode("utf-8", errors="replace"), raw


class Answer:
    """The whole response: choices, ids, usage, chunk envelopes."""

    def __init__(self, parsed: ParsedRequest, request_id: str, model: str, preps: Sequence[PreparedRequest],
                 token_bytes: TokenBytes | None) -> None:
        self.parsed = parsed
        self.request_id = request_id
        self.model = model
        self.preps = list(preps)
        self.created = int(time.time())
        self.object = "chat.completion" if parsed.kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"
        # OpenAI bills a prompt once however many answers it gets.
        self.prompt_tokens = sum(len(p.prompt_ids) for p in preps)
        self.choices = [
            Choice(index=p * parsed.n + j, prompt_index=p, kind=parsed.kind, token_bytes=token_bytes,
                    top_logprobs=parsed.top_logprobs, want_logprobs=parsed.logprobs,
                    parallel_tool_calls=parsed.parallel_tool_calls,
                    want_prompt_logprobs=parsed.prompt_logprobs is not None and parsed.kind == "completion",
                    echo_logprobs=parsed.echo_logprobs,
                    first_prompt_token=preps[p].prompt_ids[0] if preps[p].prompt_ids else 0)
            for p in range(len(preps))
            for j in range(parsed.n)
        ]

    @property
    def answered_by(self) -> str:
        """The model chosen at admission, or the fallback that took over when its workers failed the request."""
        return next((c.model for c in self.choices if c.model), self.model)

    def runs(self) -> list[tuple[int, PreparedRequest]]:
        """(choice index, prepared request) for every generation; copies get their own seeds and ids."""
        runs = []
        for choice in self.choices:
            prep = self.preps[choice.prompt_index]
            copy = choice.index % self.parsed.n
            runs.append((choice.index, prep if copy == 0 else copy_for_choice(prep, copy)))
        return runs

    def prompt_logprob_lenders(self) -> dict[int, int]:
        """Choice index -> the index of the choice whose prompt logprobs it shows: every copy but a prompt's
        first, when prompt logprobs are asked for (`copy_for_choice` does not ask again)."""
        if not any(p.wire_sampling.HasField("prompt_logprobs") for p in self.preps):
            return {}
        return {c.index: c.index - c.index % self.parsed.n for c in self.choices if c.index % self.parsed.n}

    def outcome(self) -> str:
        """The metrics' outcome label: "invalid" / "error" when a choice failed (by the request's
        fault or ours), else "ok"."""
        failed = next((c for c in self.choices if c.failed), None)
        if failed is None:
            return "ok"
        return "invalid" if failed.failure()[0] < 500 else "error"

    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> common_pb2.Usage:
        """Usage so far: each prompt once; cached tokens counted once per prompt (the least of its copies)."""
        cached = 0
        for p in range(len(self.preps)):
            copies = [c.cached_prompt_tokens for c in self.choices if c.prompt_index == p]
            cached += min(copies) if copies else 0
        completion = self.completion_tokens()
        return common_pb2.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                                cached_prompt_tokens=cached, total_tokens=self.prompt_tokens + completion,
                                reasoning_tokens=sum(c.reasoning_tokens for c in self.choices))

    def usage_json(self) -> dict[str, Any]:
        usage = self.usage()
        out = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
        }
        if self.parsed.kind == "chat":
            out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
        return out

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                               "model": self.answered_by, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        elif self.parsed.continuous_usage:
            out["usage"] = self.usage_json()
        elif self.parsed.include_usage:
            out["usage"] = None
        return out

    def full_body(self) -> dict[str, Any]:
        body = {"id": self.request_id, "object": self.object, "created": self.created, "model": self.answered_by,
                "choices": [c.full() for c in self.choices], "usage": self.usage_json()}
        if self.parsed.kind == "chat" and self.parsed.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.choices[0].prompt_logprobs_json()  # vLLM: on the response, not a choice
        return body


def copy_for_choice(prep: PreparedRequest, copy: int) -> PreparedRequest:
    """Choice `copy` (> 0) of a prompt: its own request id, a seed derived from the request's, and no prompt
    logprobs (the prompt's first choice computes them once; `SharedPromptLogprobs` lends them)."""
    sampling = dataclasses.replace(prep.sampling, prompt_logprobs=None)
    wire = common_pb2.SamplingParams()
    wire.CopyFrom(prep.wire_sampling)
    wire.ClearField("prompt_logprobs")
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=_mix64(sampling.seed, copy))
        wire.seed = sampling.seed
    # internal_id "" makes a fresh one: copies run side by side, and the stages key their work by it.
    return dataclasses.replace(prep, request_id=f"{prep.request_id}-{copy}", sampling=sampling, wire_sampling=wire,
                               internal_id="")


def _mix64(seed: int, stream: int) -> int:
    """A well-spread 64-bit seed for answer `stream` (splitmix64), so that answer 1 of seed s does
    not equal answer 0 of seed s + 1 as a plain `seed + i` would make it."""
    z = (seed + 0x9E3779B97F4A7C15 * stream) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)

