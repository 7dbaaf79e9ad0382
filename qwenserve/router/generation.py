"""One request through the disaggregated path: tokenize, prefill, hand off, decode, relay text.

`Router.prepare()` turns a GenerateRequest into token ids and validated sampling (the rate limiter
needs the exact prompt length before any work starts); `Router.run()` streams GenerateResponses and
always ends with exactly one message that carries a finish reason and usage. The context limit prepare()
enforces is the smallest max_model_len the engine workers report (`Router.start()` asks them), so a
request no worker could hold is refused (context_length_exceeded) before any worker is called.

Every wait on a worker is bounded, so a request without a deadline of its own still ends: a worker's
connection must be ready within `connect_timeout_s`; tokenizer and prefill calls have default
deadlines; a decode stream silent for `stall_timeout_s` is failed over (failover.py); channels send keepalive
pings, so a worker that stopped answering (SIGSTOP, a dead host) breaks its calls within seconds.
The workers behind each address, their channels and the router's drain are the fleet's (fleet.py). A router
that is draining ends the streams still running at its drain deadline with finish reason ABORT, and any
stream that fails while it drains too: "error" means our fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from prometheus_client import CollectorRegistry

from qwenserve.engine.sampling_params import InvalidSamplingParams
from qwenserve.engine.structured import ReasoningFirst
from qwenserve.protocol import sampling_from_proto
from qwenserve.request_limits import ModelLimits, RequestOutOfLimits, check_cache_salt, check_request
from qwenserve.router.chat_output import ChatOutput, chat_shape_of, check_chat_json, tool_choice_of
from qwenserve.router.config import RouterConfig
from qwenserve.router.discovery import Resolver, system_resolver
from qwenserve.router.errors import InvalidRequest, ServiceUnavailable, UnknownModel, out_of_limits
from qwenserve.router.failover import Progress, RequestFailed, Step, decode, prefill
from qwenserve.router.fleet import WorkerFleet, remaining, shutting_down, stage_error
from qwenserve.router.generation_defaults import with_defaults
from qwenserve.router.prepared_request import PreparedRequest
from qwenserve.router.reasoning import thinking_closed_in_prompt
from qwenserve.router.request_ids import REQUEST_ID_RULE, new_request_id, valid_request_id
from qwenserve.router.stop_strings import Detokenizer, StopStringMatcher, TextRelay
from qwenserve.router.workers import NoWorkerAvailable
from qwenserve.telemetry.metrics import RouterMetrics, router_metrics
from qwenserve.telemetry.tracing import Attr, get_tracer
from qwenserve.tenancy.content_filter import ContentFilter
from qwenserve.untrusted_input import echo
from qwenserve.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2, tokenizer_pb2, tokenizer_pb2_grpc

log = logging.getLogger(__name__)
tracer = get_tracer("qwenserve.router")

MAX_STOP_STRINGS = 16
# The furthest a client's deadline_unix_ms is honoured; later ones are cut to it.
MAX_DEADLINE_S = 86_400.0


class Router:
    """Runs requests across tokenizer, prefill and decode workers (its `fleet`).

    Retries and failovers are counted in `metrics` (a private registry's group when none is given).
    """

    def __init__(
        self,
        config: RouterConfig,
        detokenizer_factory: Callable[[bool], Detokenizer],
        metrics: RouterMetrics | None = None,
        resolver: Resolver = system_resolver,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        if config.max_model_len is None:  # the router stage sets the checkpoint's; the library cannot guess it
            raise ValueError("RouterConfig.max_model_len: give the model's context length (prompt + output tokens)")
        self.config = config
        self.metrics = metrics if metrics is not None else router_metrics(CollectorRegistry())
        self.fleet = WorkerFleet(config, self.metrics, resolver)
        self.vocab_size = 0  # from the tokenizer service, at start(); until then requests wait for it (bounded)
        self._vocabulary_known = asyncio.Event()
        self._detokenizer_factory = detokenizer_factory
        self.token_bytes = token_bytes  # a token's exact bytes (the model's vocabulary), for logprobs

    async def start(self) -> None:
        """Learn the vocabulary size from the tokenizer service (waits for it to come up), then start the fleet:
        find the workers' pods and learn the context limit the engines report."""
        stub = tokenizer_pb2_grpc.TokenizerStub(self.fleet.channel(self.config.tokenizer_address))
        info = await stub.GetInfo(tokenizer_pb2.GetInfoRequest(), wait_for_ready=True, timeout=60)
        self.vocab_size = info.vocab_size
        self._vocabulary_known.set()
        await self.fleet.start()

    def drain(self, grace_s: float) -> None:
        """The router is shutting down: streams still running in (about) `grace_s` end with ABORT."""
        self.fleet.drain(grace_s)

    async def close(self) -> None:
        await self.fleet.close()

    def check_model(self, model: str) -> None:
        """Raises UnknownModel unless `model` is empty (the default) or the model this router serves."""
        if model and model != self.config.model_name:
            raise UnknownModel(
                f"the model {echo(model)} does not exist; this server serves {self.config.model_name!r}", "model"
            )

    # -- preparing -------------------------------------------------------------------------------

    async def prepare(self, req: router_pb2.GenerateRequest, deadline: float | None = None,
                      content_filter: ContentFilter | None = None) -> PreparedRequest:
        """Tokenize and validate; raises InvalidRequest / ContextLengthExceeded / ServiceUnavailable.
        `content_filter`: the tenant's, applied to the answer's text."""
        arrived = time.monotonic()
        await self._until_started(deadline)
        request_id = req.request_id or new_request_id()
        if not valid_request_id(request_id):
            raise InvalidRequest(f"request_id must be {REQUEST_ID_RULE}", "request_id")
        try:
            check_cache_salt(req.cache_salt)
        except RequestOutOfLimits as e:
            raise InvalidRequest(e.message, e.field) from e
        if len(req.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if any(not s for s in req.stop):
            raise InvalidRequest("stop strings must not be empty", "stop")
        if req.deadline_unix_ms:
            until = req.deadline_unix_ms / 1000 - time.time()
            if until <= 0:
                raise InvalidRequest("deadline_unix_ms is in the past", "deadline_unix_ms")
            # gRPC cannot carry a timeout of centuries (it fails the call at once): a day is as good as none.
            deadline = min(deadline or float("inf"), time.monotonic() + min(until, MAX_DEADLINE_S))
        chat_tools = tool_choice_of(req, self.config.tool_call_parser)
        prompt_ids = await self._prompt_ids(req, deadline, chat_tools)
        limits = ModelLimits(self.vocab_size, self.config.max_model_len)
        # What the stages get. A max_tokens the client (and the model's defaults) left out stays out: each stage
        # then gives the request what fits its context and KV cache (the whole context could need more blocks).
        wire = with_defaults(req.sampling, self.config.sampling_defaults, max(1, limits.max_model_len - len(prompt_ids)))
        try:
            sampling = sampling_from_proto(wire, default_max_tokens=None)
            budget = check_request(prompt_ids, sampling, limits, prompt_field="input")
            sampling = dataclasses.replace(sampling, max_tokens=budget)  # min_tokens is checked against it
        except InvalidSamplingParams as e:
            raise InvalidRequest(str(e), f"sampling.{e.field}") from e
        except RequestOutOfLimits as e:
            raise out_of_limits(e) from e
        chat = None
        if req.WhichOneof("input") == "chat":
            think = self.config.think_token_ids if self.config.reasoning_parser == "qwen3" else None
            chat = chat_shape_of(req, prompt_ids, chat_tools, think)
        if chat is not None and chat.reasoning and sampling.structured is not None and \
                not thinking_closed_in_prompt(prompt_ids, chat.think_end_id, self.detokenize):
            # The model thinks before it answers: the grammar constrains the answer, not the thinking.
            start_id, end_id = self.config.think_token_ids or (0, 0)
            wire.structured.reasoning_first.CopyFrom(common_pb2.ReasoningFirst(
                start_id=start_id, end_id=end_id, open_in_prompt=chat.open_in_prompt))
            sampling = dataclasses.replace(sampling, reasoning_first=ReasoningFirst(start_id, end_id,
                                                                                     chat.open_in_prompt))
        return PreparedRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=sampling,
            wire_sampling=wire,
            stop=list(req.stop),
            skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
            cache_salt=req.cache_salt,
            deadline=deadline,
            echo_prompt=req.echo_prompt_token_ids,
            arrived=arrived,
            chat=chat,
            content_filter=content_filter,
        )

    async def tokenize(self, req: router_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids as a generation would see them (chat template, tools and forced start)."""
        await self._until_started(None)
        return await self._prompt_ids(req, time.monotonic() + self.config.tokenizer_timeout_s, tool_choice_of(req, self.config.tool_call_parser))

    async def _until_started(self, deadline: float | None) -> None:
        """Returns once start() has heard from the tokenizer: a request that arrives in the router's first
        seconds (its ports open before the tokenizer answers) waits for it, within the tokenizer call's bound and
        its own deadline, instead of failing at once; ServiceUnavailable when it does not come."""
        if self.vocab_size:
            return
        wait_s = self.config.tokenizer_timeout_s
        if deadline is not None:
            wait_s = min(wait_s, deadline - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._vocabulary_known.wait(), max(0.0, wait_s))
        if not self.vocab_size:  # nothing can be checked without the vocabulary
            raise ServiceUnavailable("the router is starting: waiting for the tokenizer service")

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included."""
        bad = next((i for i in ids if i >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary of {self.vocab_size}", "tokens")
        detokenizer = self._detokenizer_factory(False)
        return detokenizer.push(ids) + detokenizer.flush()

    async def _prompt_ids(self, req: router_pb2.GenerateRequest, deadline: float | None,
                          chat_tools: tuple[str, str] = ("none", "")) -> list[int]:
        which = req.WhichOneof("input")
        if which is None:
            raise InvalidRequest("one of prompt, chat or prompt_token_ids is required", "input")
        if which == "prompt_token_ids":
            return list(req.prompt_token_ids.ids)  # checked against the vocabulary with the rest (request_limits)
        if which == "prompt":
            treq = tokenizer_pb2.TokenizeRequest(text=req.prompt)
        else:
            check_chat_json(req.chat)
            chat = tokenizer_pb2.TokenizeRequest().chat
            chat.CopyFrom(req.chat)
            choice, prefix = chat_tools
            if choice == "none":  # tools the model may not call are not offered to it
                del chat.tools_json[:]
            chat.assistant_prefix = prefix + req.chat.assistant_prefix
            treq = tokenizer_pb2.TokenizeRequest(chat=chat)
        stub = tokenizer_pb2_grpc.TokenizerStub(self.fleet.channel(self.config.tokenizer_address))
        with tracer.start_as_current_span("tokenize", attributes={"qwenserve.input": which}) as span:
            try:
                resp = await stub.Tokenize(treq, timeout=remaining(deadline, self.config.tokenizer_timeout_s))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(e.details() or "invalid input", "input") from e
                # gRPC's details name the tokenizer's address: logged, never told to the client.
                log.warning("tokenizer %s: %s: %s", self.config.tokenizer_address, e.code().name, e.details())
                raise ServiceUnavailable(f"the tokenizer service did not answer ({e.code().name}); retry shortly") from e
            span.set_attribute(Attr.PROMPT_TOKENS, len(resp.ids))
        return list(resp.ids)

    # -- running ---------------------------------------------------------------------------------

    async def run(self, prep: PreparedRequest) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream the answer; the last message has finish_reason and usage, whatever happens.

        Closing this generator early (a stop string, a client that left) cancels the worker's call at
        once, so the worker frees the request's KV blocks; callers should close it (`aclosing`) rather
        than leave that to the garbage collector.
        """
        progress = Progress()
        relay = TextRelay(self._detokenizer_factory(prep.skip_special_tokens), StopStringMatcher(prep.stop))
        output = ChatOutput(prep.chat) if prep.chat is not None else None
        screen = prep.content_filter.stream() if prep.content_filter else None
        first = True
        async with contextlib.aclosing(self._tokens(prep, progress)) as tokens:
            async for token_ids, logprobs, finish, error in tokens:
                if token_ids:
                    self.metrics.completion_rate.add(len(token_ids))
                text, stopped = relay.push(token_ids)
                if stopped:
                    finish, error = common_pb2.FINISH_REASON_STOP, None
                elif finish:
                    text += relay.flush()
                if screen is not None:  # after stop strings: text a stop string cut off is never sent anyway
                    text, hit = screen.push(text, final=bool(finish) or stopped)
                    if hit:  # counted as qwenserve_router_requests_total{finish_reason="content_filter"}
                        finish, error = common_pb2.FINISH_REASON_CONTENT_FILTER, None
                if finish == common_pb2.FINISH_REASON_ERROR and self.fleet.draining:
                    # Workers go away while the deployment shuts down: for the client that is an abort.
                    finish, error = common_pb2.FINISH_REASON_ABORT, shutting_down()
                msg = router_pb2.GenerateResponse(
                    request_id=prep.request_id, text=text, token_ids=token_ids, logprobs=logprobs
                )
                if output is not None:
                    reasoning, msg.text, calls = output.push(text, token_ids)
                    if finish:
                        more_reasoning, more_text, more_calls = output.flush()
                        reasoning, msg.text, calls = reasoning + more_reasoning, msg.text + more_text, calls + more_calls
                        if finish == common_pb2.FINISH_REASON_STOP and output.called:
                            finish = common_pb2.FINISH_REASON_TOOL_CALLS
                    msg.reasoning_text = reasoning
                    msg.tool_calls.extend(calls)
                if first and prep.echo_prompt:
                    msg.prompt_token_ids.extend(prep.prompt_ids)
                if first and progress.prompt_logprobs:
                    msg.prompt_logprobs.extend(progress.prompt_logprobs)
                first = False
                if finish:
                    msg.finish_reason = finish
                    msg.usage.CopyFrom(self._usage(prep, progress))
                    if output is not None:
                        msg.usage.reasoning_tokens = output.reasoning_tokens
                    if error is not None:
                        msg.error.CopyFrom(error)
                    yield msg
                    return
                yield msg

    def _usage(self, prep: PreparedRequest, progress: Progress) -> common_pb2.Usage:
        prompt, completion = len(prep.prompt_ids), len(progress.generated)
        return common_pb2.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_prompt_tokens=progress.cached_prompt_tokens,
            total_tokens=prompt + completion,
        )

    async def _tokens(self, prep: PreparedRequest, progress: Progress) -> AsyncIterator[Step]:
        """Yields (token ids, logprobs, finish reason or 0, error detail) until a finish reason."""
        if not await self.fleet.stream_slots.acquire(self.fleet.queue_wait(prep), prep.priority):
            if self.fleet.expired(prep):
                yield [], [], common_pb2.FINISH_REASON_ABORT, self.fleet.cutoff_detail(prep)
                return
            yield [], [], common_pb2.FINISH_REASON_ERROR, stage_error(
                "resource_exhausted", f"every decode worker has {self.config.max_streams_per_decode_worker} "
                f"requests in flight and none finished within the queue wait; retry shortly", retryable=True)
            return
        try:
            async with contextlib.aclosing(self._generate(prep, progress)) as steps:
                async for step in steps:
                    yield step
        finally:
            self.fleet.stream_slots.release()

    async def _generate(self, prep: PreparedRequest, progress: Progress) -> AsyncIterator[Step]:
        """Prefill (on a prefill worker, else the decode worker's own), then decode, with failover."""
        use_prefill = bool(self.fleet.prefill_pool.workers) and len(prep.prompt_ids) >= self.config.local_prefill_threshold
        self.metrics.queue_time.observe(time.monotonic() - prep.arrived)
        resp: prefill_pb2.PrefillResponse | None = None
        if use_prefill:
            try:
                with tracer.start_as_current_span("prefill", attributes={Attr.PROMPT_TOKENS: len(prep.prompt_ids)}):
                    resp = await prefill(self.fleet, prep)
            except NoWorkerAvailable as e:
                log.warning("%s: %s; the decode worker prefills the prompt itself", prep.request_id, e)
            except RequestFailed as e:
                yield [], [], e.finish_reason, e.detail
                return
        if resp is None:
            async with contextlib.aclosing(decode(self.fleet, prep, progress, None)) as stream:
                async for item in stream:
                    yield item
            return
        progress.generated.append(resp.first_token_id)
        progress.cached_prompt_tokens = resp.cached_prompt_tokens
        if prep.wire_sampling.HasField("prompt_logprobs"):
            progress.prompt_logprobs = list(resp.prompt_logprobs)
        logprobs = [resp.first_logprob] if resp.HasField("first_logprob") else []
        if resp.finish_reason:  # no handoff was made
            yield [resp.first_token_id], logprobs, resp.finish_reason, None
            return
        start = decode_pb2.PrefilledStart(
            kv_handle=resp.kv_handle,
            first_token_id=resp.first_token_id,
            cached_prompt_tokens=resp.cached_prompt_tokens,
            handoff_token=prep.handoff_token,
        )
        if resp.HasField("first_logprob"):
            start.first_logprob.CopyFrom(resp.first_logprob)
        first: Step = ([resp.first_token_id], logprobs, 0, None)
        held = first if self.config.first_token_waits_for_decode else None
        try:
            if held is None:
                yield first
            async with contextlib.aclosing(decode(self.fleet, prep, progress, start, held)) as stream:
                async for item in stream:
                    yield item
        finally:
            if not progress.handoff_sent:
                # The request ended (a stop string in the first token, a client that left) or no decode
                # worker could be reached before any took the handoff: free it now, not at lease expiry.
                self.fleet.release_handoff(start.kv_handle, prep.request_id, token=start.handoff_token)

