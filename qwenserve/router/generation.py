"""One request through the disaggregated path: tokenize, prefill, hand off, decode, relay text.

`Router.prepare()` turns a GenerateRequest into token ids and validated sampling (the rate limiter
needs the exact prompt length before any work starts); `Router.run()` streams GenerateResponses and
always ends with exactly one message that carries a finish reason and usage.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from qwenserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qwenserve.protocol import sampling_from_proto
from qwenserve.router.errors import ContextLengthExceeded, InvalidRequest, ServiceUnavailable
from qwenserve.router.stop_strings import StopStringMatcher
from qwenserve.router.workers import NoWorkerAvailable, WorkerPool
from qwenserve.telemetry.metrics import RouterMetrics, router_metrics
from qwenserve.telemetry.tracing import Attr, client_interceptors, get_tracer
from qwenserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

log = logging.getLogger(__name__)
tracer = get_tracer("qwenserve.router")

MAX_STOP_STRINGS = 16
# Codes after which the same request may succeed on another worker.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
# A decode stream that breaks with these means the worker (not the request) failed: fail over.
FAILOVER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class Detokenizer(Protocol):
    def push(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


@dataclass(slots=True)
class RouterConfig:
    """Where the workers are and how the router treats requests."""

    tokenizer_address: str
    prefill_addresses: list[str]
    decode_addresses: list[str]
    model_name: str = "qwen"
    max_model_len: int = 4096
    # Prompts shorter than this are prefilled on the decode worker itself (no handoff).
    local_prefill_threshold: int = 0
    prefill_attempts: int = 3
    # How long to wait for a worker's first reply before trying another.
    connect_timeout_s: float = 5.0


@dataclass(slots=True)
class PreparedRequest:
    """A validated request: exact prompt ids and engine sampling settings."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    wire_sampling: common_pb2.SamplingParams
    stop: list[str]
    skip_special_tokens: bool
    cache_salt: str
    deadline: float | None  # time.monotonic() deadline
    echo_prompt: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when prepare() began, for the queue-time metric

    @property
    def budget_tokens(self) -> int:
        """Prompt plus output budget: what the rate limiter charges up front."""
        return len(self.prompt_ids) + (self.sampling.max_tokens or 0)


@dataclass(slots=True)
class _Progress:
    """What the client has received so far; failover resumes from here."""

    generated: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    first_token_at: float | None = None


class Router:
    """Runs requests across tokenizer, prefill and decode workers.

    Retries and failovers are counted in `metrics` (a private registry's group when none is given).
    """

    def __init__(
        self,
        config: RouterConfig,
        detokenizer_factory: Callable[[bool], Detokenizer],
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self._detokenizer_factory = detokenizer_factory
        self.prefill_pool = WorkerPool(config.prefill_addresses)
        self.decode_pool = WorkerPool(config.decode_addresses)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.vocab_size = 0
        self.metrics = metrics if metrics is not None else router_metrics(CollectorRegistry())

    # -- lifecycle -------------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(
                address,
                options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 0)],
                interceptors=client_interceptors(),
            )
        return self._channels[address]

    def channel(self, address: str) -> grpc.aio.Channel:
        """The router's (traced) channel to a worker, e.g. for health checks."""
        return self._channel(address)

    async def start(self) -> None:
        """Learn the vocabulary size from the tokenizer service (waits for it to come up)."""
        stub = tokenizer_pb2_grpc.TokenizerStub(self._channel(self.config.tokenizer_address))
        info = await stub.GetInfo(tokenizer_pb2.GetInfoRequest(), wait_for_ready=True, timeout=60)
        self.vocab_size = info.vocab_size

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- preparing -------------------------------------------------------------------------------

    async def prepare(self, req: router_pb2.GenerateRequest, deadline: float | None = None) -> PreparedRequest:
        """Tokenize and validate; raises InvalidRequest / ContextLengthExceeded / ServiceUnavailable."""
        arrived = time.monotonic()
        if not self.vocab_size:  # start() has not heard from the tokenizer yet: nothing can be checked
            raise ServiceUnavailable("the router is starting: waiting for the tokenizer service")
        request_id = req.request_id or f"req-{uuid.uuid4().hex[:16]}"
        if len(req.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if any(not s for s in req.stop):
            raise InvalidRequest("stop strings must not be empty", "stop")
        if req.deadline_unix_ms:
            until = req.deadline_unix_ms / 1000 - time.time()
            if until <= 0:
                raise InvalidRequest("deadline_unix_ms is in the past", "deadline_unix_ms")
            deadline = min(deadline or float("inf"), time.monotonic() + until)
        prompt_ids = await self._prompt_ids(req, deadline)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "input")
        room = self.config.max_model_len - len(prompt_ids)
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.config.max_model_len}",
                "input",
            )
        try:
            sampling = sampling_from_proto(req.sampling, default_max_tokens=room)
        except InvalidSamplingParams as e:
            raise InvalidRequest(str(e), f"sampling.{e.field}") from e
        if sampling.max_tokens is not None and sampling.max_tokens > room:
            raise ContextLengthExceeded(
                f"max_tokens {sampling.max_tokens} + prompt {len(prompt_ids)} tokens exceeds the context of "
                f"{self.config.max_model_len}",
                "sampling.max_tokens",
            )
        return PreparedRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=sampling,
            wire_sampling=_wire_sampling(req.sampling, sampling),
            stop=list(req.stop),
            skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
            cache_salt=req.cache_salt,
            deadline=deadline,
            echo_prompt=req.echo_prompt_token_ids,
            arrived=arrived,
        )

    async def _prompt_ids(self, req: router_pb2.GenerateRequest, deadline: float | None) -> list[int]:
        which = req.WhichOneof("input")
        if which is None:
            raise InvalidRequest("one of prompt, chat or prompt_token_ids is required", "input")
        if which == "prompt_token_ids":
            ids = list(req.prompt_token_ids.ids)
            bad = [i for i in ids if i >= self.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary of {self.vocab_size}", "input")
            return ids
        if which == "prompt":
            treq = tokenizer_pb2.TokenizeRequest(text=req.prompt)
        else:
            chat = tokenizer_pb2.TokenizeRequest().chat
            chat.CopyFrom(req.chat)
            treq = tokenizer_pb2.TokenizeRequest(chat=chat)
        stub = tokenizer_pb2_grpc.TokenizerStub(self._channel(self.config.tokenizer_address))
        with tracer.start_as_current_span("tokenize", attributes={"qwenserve.input": which}) as span:
            try:
                resp = await stub.Tokenize(treq, timeout=_remaining(deadline, 30.0))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(e.details() or "invalid input", "input") from e
                raise ServiceUnavailable(f"tokenizer: {e.code().name}: {e.details()}") from e
            span.set_attribute(Attr.PROMPT_TOKENS, len(resp.ids))
        return list(resp.ids)

    # -- running ---------------------------------------------------------------------------------

    async def run(self, prep: PreparedRequest) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream the answer; the last message has finish_reason and usage, whatever happens."""
        progress = _Progress()
        relay = _TextRelay(self._detokenizer_factory(prep.skip_special_tokens), StopStringMatcher(prep.stop))
        first = True
        async for token_ids, logprobs, finish, error in self._tokens(prep, progress):
            if token_ids:
                self.metrics.completion_rate.add(len(token_ids))
            text, stopped = relay.push(token_ids)
            if stopped:
                finish, error = common_pb2.FINISH_REASON_STOP, None
            elif finish:
                text += relay.flush()
            msg = router_pb2.GenerateResponse(
                request_id=prep.request_id, text=text, token_ids=token_ids, logprobs=logprobs
            )
            if first and prep.echo_prompt:
                msg.prompt_token_ids.extend(prep.prompt_ids)
            first = False
            if finish:
                msg.finish_reason = finish
                msg.usage.CopyFrom(self._usage(prep, progress))
                if error is not None:
                    msg.error.CopyFrom(error)
                yield msg
                return
            yield msg

    def _usage(self, prep: PreparedRequest, progress: _Progress) -> common_pb2.Usage:
        prompt, completion = len(prep.prompt_ids), len(progress.generated)
        return common_pb2.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_prompt_tokens=progress.cached_prompt_tokens,
            total_tokens=prompt + completion,
        )

    async def _tokens(
        self, prep: PreparedRequest, progress: _Progress
    ) -> AsyncIterator[tuple[list[int], list[common_pb2.TokenLogprob], int, common_pb2.ErrorDetail | None]]:
        """Yields (token ids, logprobs, finish reason or 0, error detail) until a finish reason."""
        start: decode_pb2.PrefilledStart | None = None
        use_prefill = bool(self.config.prefill_addresses) and len(prep.prompt_ids) >= self.config.local_prefill_threshold
        self.metrics.queue_time.observe(time.monotonic() - prep.arrived)
        if use_prefill:
            try:
                with tracer.start_as_current_span("prefill", attributes={Attr.PROMPT_TOKENS: len(prep.prompt_ids)}):
                    resp = await self._prefill(prep)
            except NoWorkerAvailable:
                resp = None  # every prefill worker failed: decode prefills locally
            except _RequestFailed as e:
                yield [], [], common_pb2.FINISH_REASON_ERROR, e.detail
                return
            if resp is not None:
                progress.generated.append(resp.first_token_id)
                progress.cached_prompt_tokens = resp.cached_prompt_tokens
                logprobs = [resp.first_logprob] if resp.HasField("first_logprob") else []
                if resp.finish_reason:
                    yield [resp.first_token_id], logprobs, resp.finish_reason, None
                    return
                yield [resp.first_token_id], logprobs, 0, None
                start = decode_pb2.PrefilledStart(
                    kv_handle=resp.kv_handle,
                    first_token_id=resp.first_token_id,
                    cached_prompt_tokens=resp.cached_prompt_tokens,
                )
                if resp.HasField("first_logprob"):
                    start.first_logprob.CopyFrom(resp.first_logprob)
        async for item in self._decode(prep, progress, start):
            yield item

    async def _prefill(self, prep: PreparedRequest) -> prefill_pb2.PrefillResponse:
        """Prefill on the least loaded worker, retrying elsewhere on worker failures."""
        tried: list[str] = []
        request = prefill_pb2.PrefillRequest(
            request_id=prep.request_id,
            prompt_token_ids=prep.prompt_ids,
            sampling=prep.wire_sampling,
            cache_salt=prep.cache_salt,
        )
        for attempt in range(self.config.prefill_attempts):
            worker = self.prefill_pool.choose(prep.prompt_ids, exclude=tried)
            tried.append(worker.address)
            span = trace.get_current_span()
            span.set_attribute(Attr.WORKER, worker.address)
            span.set_attribute("qwenserve.attempt", attempt + 1)
            stub = prefill_pb2_grpc.PrefillStub(self._channel(worker.address))
            ok = False
            self.prefill_pool.started(worker, len(prep.prompt_ids))
            try:
                resp = await stub.Prefill(request, timeout=_remaining(prep.deadline, None))
                ok = True
                return resp
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and _expired(prep.deadline):
                    raise _RequestFailed(_error("deadline_exceeded", "the request's deadline passed")) from e
                if e.code() not in RETRYABLE:
                    raise _RequestFailed(_error(e.code().name.lower(), e.details() or "prefill failed")) from e
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.prefill_pool.mark_dead(worker)
                log.warning("%s: prefill on %s failed (%s), attempt %d", prep.request_id, worker.address,
                            e.code().name, attempt + 1)
                self.metrics.record_retry("prefill")
            finally:
                self.prefill_pool.finished(worker, len(prep.prompt_ids), ok)
        raise NoWorkerAvailable(f"prefill failed on {tried}")

    async def _decode(
        self, prep: PreparedRequest, progress: _Progress, start: decode_pb2.PrefilledStart | None
    ) -> AsyncIterator[tuple[list[int], list[common_pb2.TokenLogprob], int, common_pb2.ErrorDetail | None]]:
        """Stream from a decode worker; on a worker failure resume on another from the tokens so far."""
        tried: list[str] = []
        budget = prep.sampling.max_tokens or 0
        while True:
            try:
                worker = self.decode_pool.choose(prep.prompt_ids, exclude=tried)
            except NoWorkerAvailable:
                yield [], [], common_pb2.FINISH_REASON_ERROR, _error(
                    "no_decode_worker", f"no decode worker could finish the request (tried {tried})", retryable=True
                )
                return
            tried.append(worker.address)
            request = decode_pb2.DecodeRequest(
                request_id=prep.request_id,
                prompt_token_ids=prep.prompt_ids,
                sampling=prep.wire_sampling,
                cache_salt=prep.cache_salt,
            )
            if start is not None and len(progress.generated) == 1:
                request.prefilled.CopyFrom(start)
            else:
                request.local_prefill = True
                request.resume_token_ids.extend(progress.generated)
            stub = decode_pb2_grpc.DecodeStub(self._channel(worker.address))
            self.decode_pool.started(worker, budget)
            # A span per attempt; current only while the call starts (this generator yields across it).
            span = tracer.start_span("decode", attributes={
                Attr.WORKER: worker.address, "qwenserve.attempt": len(tried), "qwenserve.handoff": start is not None,
            })
            if span.is_recording():
                with trace.use_span(span, end_on_exit=False):
                    call = stub.Decode(request, timeout=_remaining(prep.deadline, None))
            else:
                call = stub.Decode(request, timeout=_remaining(prep.deadline, None))
            ok = False
            try:
                async for msg in call:
                    if msg.token_ids:
                        progress.generated.extend(msg.token_ids)
                    if msg.finish_reason:
                        ok = True
                        if msg.HasField("usage") and not progress.cached_prompt_tokens:
                            progress.cached_prompt_tokens = msg.usage.cached_prompt_tokens
                        error = msg.error if msg.HasField("error") else None
                        yield list(msg.token_ids), list(msg.logprobs), msg.finish_reason, error
                        return
                    yield list(msg.token_ids), list(msg.logprobs), 0, None
                failure = "the decode stream ended without a finish reason"
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    ok = True
                    yield [], [], common_pb2.FINISH_REASON_ABORT, _error("deadline_exceeded", "the deadline passed")
                    return
                if code == grpc.StatusCode.FAILED_PRECONDITION and start is not None:
                    # The handoff was refused (layout or checksum): recompute the prompt locally instead.
                    log.warning("%s: handoff refused by %s: %s", prep.request_id, worker.address, e.details())
                    start = None
                    tried.pop()
                    continue
                if code not in FAILOVER:
                    ok = True
                    yield [], [], common_pb2.FINISH_REASON_ERROR, _error(code.name.lower(), e.details() or "")
                    return
                failure = f"{code.name}: {e.details()}"
                self.decode_pool.mark_dead(worker)
            finally:
                call.cancel()  # a stop string or a client that left: the worker frees the KV
                self.decode_pool.finished(worker, budget, ok)
                span.set_attribute(Attr.COMPLETION_TOKENS, len(progress.generated))
                span.end()
            self.metrics.record_failover("decode")
            start = None  # the dead worker may have consumed the handoff: recompute the prompt
            log.warning("%s: decode on %s failed (%s); resuming after %d tokens", prep.request_id,
                        worker.address, failure, len(progress.generated))


class _RequestFailed(Exception):
    def __init__(self, detail: common_pb2.ErrorDetail) -> None:
        super().__init__(detail.message)
        self.detail = detail


class _TextRelay:
    """Token ids to text deltas: incremental detokenization, then stop strings."""

    def __init__(self, detokenizer: Detokenizer, stops: StopStringMatcher) -> None:
        self._detok = detokenizer
        self._stops = stops

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        check = self._stops.push(self._detok.push(ids))
        return check.text, check.stopped

    def flush(self) -> str:
        check = self._stops.push(self._detok.flush())
        return check.text + ("" if check.stopped else self._stops.flush())


def _wire_sampling(msg: common_pb2.SamplingParams, sampling: SamplingParams) -> common_pb2.SamplingParams:
    """The request's sampling with max_tokens made explicit, so every worker uses the same budget."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(msg)
    if sampling.max_tokens is not None:
        out.max_tokens = sampling.max_tokens
    return out


def _error(code: str, message: str, retryable: bool = False) -> common_pb2.ErrorDetail:
    return common_pb2.ErrorDetail(code=code, message=message, retryable=retryable)


def _remaining(deadline: float | None, default: float | None) -> float | None:
    if deadline is None:
        return default
    return max(0.001, deadline - time.monotonic())


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
