"""One request through the disaggregated path: tokenize, prefill, hand off, decode, relay text.

`Router.prepare()` turns a GenerateRequest into token ids and validated sampling (the rate limiter
needs the exact prompt length before any work starts); `Router.run()` streams GenerateResponses and
always ends with exactly one message that carries a finish reason and usage. The context limit prepare()
enforces is the smallest max_model_len the engine workers report (`Router.start()` asks them), so a
request no worker could hold is refused (context_length_exceeded) before any worker is called.

Every wait on a worker is bounded, so a request without a deadline of its own still ends: a worker's
connection must be ready within `connect_timeout_s`; tokenizer and prefill calls have default
deadlines; a decode stream silent for `stall_timeout_s` is failed over; channels send keepalive
pings, so a worker that stopped answering (SIGSTOP, a dead host) breaks its calls within seconds.
Each prefill and decode address that is a DNS name (a headless Service) stands for its pods: the router
keeps a worker and a channel per pod (discovery.py), closing a removed pod's channel once its calls end.
Only worker faults count towards a worker's circuit breaker, never a client that left or a
stop string. A router that is draining ends the streams still running at its drain deadline with
finish reason ABORT, and any stream that fails while it drains too: "error" means our fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from qwenserve.engine.sampling_params import InvalidSamplingParams, SamplingParams
from qwenserve.engine.structured import ReasoningFirst
from qwenserve.protocol import sampling_from_proto
from qwenserve.router.chat_output import TOOL_CHOICES, ChatOutput, ChatShape, forced_prefix
from qwenserve.router.discovery import Change, PodDiscovery, Resolver, system_resolver
from qwenserve.router.errors import ContextLengthExceeded, InvalidRequest, ServiceUnavailable, UnknownModel
from qwenserve.router.generation_defaults import with_defaults
from qwenserve.router.reasoning import thinking_closed_in_prompt, thinking_open_in_prompt
from qwenserve.router.request_ids import REQUEST_ID_RULE, internal_id, new_request_id, valid_request_id
from qwenserve.router.stop_strings import StopStringMatcher
from qwenserve.router.workers import NoWorkerAvailable, WorkerPool
from qwenserve.rpc_errors import detail_of
from qwenserve.telemetry.metrics import RouterMetrics, router_metrics
from qwenserve.telemetry.tracing import Attr, client_interceptors, get_tracer
from qwenserve.tenancy.content_filter import ContentFilter
from qwenserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

log = logging.getLogger(__name__)
tracer = get_tracer("qwenserve.router")

MAX_STOP_STRINGS = 16
# Codes that mean the request itself is wrong: it ends with this error, no other worker is tried.
# Any other failure of a stage call is the worker's, and the request moves on to another worker.
CLIENT_MISTAKES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
# After these the worker is gone or going (dead, restarting, draining): send it nothing for a while.
WORKER_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
# How long after abandoning a decode call that never answered the router releases its handoff itself.
HANDOFF_RELEASE_DELAY_S = 3.0
# ... and after a prefill call given up on, enough for an answer already sent to have been published.
UNREAD_PREFILL_RELEASE_DELAY_S = 0.5
# The furthest a client's deadline_unix_ms is honoured; later ones are cut to it.
MAX_DEADLINE_S = 86_400.0
HANDOFF_RELEASE_TIMEOUT_S = 5.0  # one attempt; a worker that does not answer is asked again
# A release that found the worker stopped or unreachable is retried (backoff up to 4 s) for this long: a worker
# resumed after SIGSTOP may still publish the handoff, and the exporter refuses a name cancelled before it.
HANDOFF_RELEASE_RETRY_S = 60.0
# A failed prefill call with one of these may have left its handler running: free its handoff by name.
PREFILL_MAYBE_RUNNING = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                         grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}


class Detokenizer(Protocol):
    def push(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


@dataclass(slots=True)
class RouterConfig:
    """Where the workers are and how the router treats requests."""

    tokenizer_address: str
    # Worker entries: a pod's ip:port, or a name:port (dns:///name:port) standing for every address it resolves to.
    prefill_addresses: list[str]
    decode_addresses: list[str]
    model_name: str = "qwen"
    # The longest request accepted, prompt + output tokens. start() lowers it to the smallest max_model_len the
    # engine workers report (GetInfo), as does a worker that reports later: what a worker would have to refuse
    # is refused here, before any work.
    max_model_len: int = 4096
    # Prompts shorter than this are prefilled on the decode worker itself (no handoff).
    local_prefill_threshold: int = 0
    prefill_attempts: int = 3
    # How long a worker's connection may take to become ready before another worker is tried.
    connect_timeout_s: float = 5.0
    # Default deadline of a tokenizer call (the client's deadline wins when it is sooner).
    rpc_timeout_s: float = 30.0
    # Default deadline of a prefill call, plus an allowance per prompt token: a long prompt on a CPU may
    # legitimately take minutes (10 tokens/s is far below any engine's prefill rate).
    prefill_timeout_s: float = 300.0
    prefill_timeout_per_token_s: float = 0.1
    # A decode stream that sends nothing for this long is failed over; a worker busy on the request's long
    # prompt sends empty heartbeats meanwhile (decode_worker.HEARTBEAT_S).
    stall_timeout_s: float = 30.0
    # Keepalive pings on every channel: a worker that does not answer one within the timeout is cut off.
    keepalive_s: float = 10.0
    keepalive_timeout_s: float = 10.0
    # How long start() waits for the other workers' limits once a decode worker has reported its own.
    worker_info_wait_s: float = 30.0
    # How often worker names are resolved again: a new pod gets traffic, a removed one drains, this soon.
    resolve_interval_s: float = 5.0
    # A request for a stage with no worker at all (scaled to zero) is held this long for one to appear (the
    # operator starts one when it sees the held count); 0: answered at once (no_decode_worker).
    cold_start_wait_s: float = 0.0
    # Chat answers: "qwen3" splits <think> blocks into reasoning ("none" leaves them in the text); "hermes"
    # parses <tool_call> blocks into tool calls when the request offers tools ("none" refuses tools).
    reasoning_parser: str = "qwen3"
    tool_call_parser: str = "hermes"
    # The vocabulary's <think> and </think> ids; None: the model has no thinking tokens (nothing is split).
    think_token_ids: tuple[int, int] | None = None
    # Sampling settings a request leaves out, from the model's generation_config.json (generation_defaults.py).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)


@dataclass(slots=True)
class PreparedRequest:
    """A validated request: exact prompt ids and engine sampling settings."""

    request_id: str  # the client's: echoed in every answer
    prompt_ids: list[int]
    sampling: SamplingParams
    wire_sampling: common_pb2.SamplingParams
    stop: list[str]
    skip_special_tokens: bool
    cache_salt: str
    deadline: float | None  # time.monotonic() deadline
    echo_prompt: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when prepare() began, for the queue-time metric
    internal_id: str = ""  # what the stages know it by (unique even when client ids repeat); made if empty
    chat: ChatShape | None = None  # a chat answer: how its text is split (None: text as generated)
    content_filter: ContentFilter | None = None  # the tenant's words that must never be sent (the fronts set it)
    priority: int = 0  # the tenant's tier: lower is admitted first by the engines (the gatekeeper sets it)

    def __post_init__(self) -> None:
        if not self.internal_id:
            self.internal_id = internal_id(self.request_id)


@dataclass(slots=True)
class _Progress:
    """What the client has received so far; failover resumes from here."""

    generated: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    first_token_at: float | None = None
    handoff_sent: bool = False  # a decode call carried the prefill's handoff: its worker releases it
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None  # once a worker computed them


class Router:
    """Runs requests across tokenizer, prefill and decode workers.

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
        self.config = config
        self._detokenizer_factory = detokenizer_factory
        self.token_bytes = token_bytes  # a token's exact bytes (the model's vocabulary), for logprobs
        self.discovery = PodDiscovery(
            {"prefill": config.prefill_addresses, "decode": config.decode_addresses},
            self._pods_changed, resolver, config.resolve_interval_s,
        )
        # Literal addresses are workers from the start; the pods of names join at start().
        self.prefill_pool = WorkerPool(self.discovery.pods["prefill"], on_drained=self._close_channel)
        self.decode_pool = WorkerPool(self.discovery.pods["decode"], on_drained=self._close_channel)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.vocab_size = 0
        self.metrics = metrics if metrics is not None else router_metrics(CollectorRegistry())
        # A stage given no workers (prefill=0: decode prefills) is not a stage that is down.
        for stage, pool, given in (("prefill", self.prefill_pool, config.prefill_addresses),
                                   ("decode", self.decode_pool, config.decode_addresses)):
            if given:
                self.metrics.available_workers.labels(config.model_name, stage).set_function(pool.num_available)
        self.metrics.held_requests.labels(config.model_name, "decode").set_function(lambda: self._held["decode"])
        self._drain_deadline: float | None = None  # time.monotonic(); set once the router drains
        self._background: set[asyncio.Task[None]] = set()  # handoff releases still on their way
        self._closing = asyncio.Event()  # set by close(): delayed releases go out at once
        self._watches: set[_StreamWatch] = set()  # decode streams in flight, told when a drain starts
        self.worker_limits: dict[str, int] = {}  # engine worker address -> the max_model_len it reported
        self._limit_asks: dict[str, asyncio.Task[None]] = {}  # worker -> its GetInfo call, until it answers
        self._limits_changed = asyncio.Event()  # a worker reported, stopped being asked, or joined
        self._asking = False  # start() asks every worker for its limits, and from then on every new one
        self._started = False
        self._workers_joined = {"prefill": asyncio.Event(), "decode": asyncio.Event()}  # set when a pod joins
        self._held = {"prefill": 0, "decode": 0}  # requests waiting for a stage's first worker

    # -- lifecycle -------------------------------------------------------------------------------

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            c = self.config
            self._channels[address] = grpc.aio.insecure_channel(
                address,
                options=[
                    ("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.enable_retries", 0),
                    ("grpc.keepalive_time_ms", int(c.keepalive_s * 1000)),
                    ("grpc.keepalive_timeout_ms", int(c.keepalive_timeout_s * 1000)),
                    ("grpc.keepalive_permit_without_calls", 1),
                    # Keep pinging while only the worker sends (a decode stream): the pings are the point.
                    ("grpc.http2.max_pings_without_data", 0),
                    # A worker back from a restart is reachable again within seconds, not gRPC's 2-minute backoff.
                    ("grpc.initial_reconnect_backoff_ms", 500),
                    ("grpc.max_reconnect_backoff_ms", 5000),
                    # Prefill and decode channels each name one pod; the tokenizer's names its Service, whose
                    # pods then share the calls (gRPC's default, pick_first, would send every call to one).
                    ("grpc.lb_policy_name", "round_robin"),
                ],
                interceptors=client_interceptors(),
            )
        return self._channels[address]

    async def _connected(self, address: str) -> bool:
        """Whether the worker's connection is (or becomes, within connect_timeout_s) ready for calls.

        A worker that refuses connections fails at once; one that accepts and never answers (a stopped
        process) fails at the timeout. Either way the caller tries another worker.
        """
        channel = self._channel(address)
        state = channel.get_state(try_to_connect=True)
        deadline = time.monotonic() + self.config.connect_timeout_s
        while state != grpc.ChannelConnectivity.READY:
            left = deadline - time.monotonic()
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN) or left <= 0:
                return False
            try:
                async with asyncio.timeout(left):
                    await channel.wait_for_state_change(state)
            except TimeoutError:
                return False
            state = channel.get_state(try_to_connect=True)
        return True

    def drain(self, grace_s: float) -> None:
        """The router is shutting down: streams still running in (about) `grace_s` end with ABORT.

        Ends them a little before the grace period does, so that each still gets its terminal message
        before the server cancels the call.
        """
        self._drain_deadline = time.monotonic() + max(0.0, grace_s - min(1.0, grace_s / 5))
        for watch in list(self._watches):
            watch.check()
        log.info("router draining: streams still running in %.1fs end with finish reason abort", grace_s)

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def can_serve(self) -> bool:
        """Whether a decode worker could take a request now: one is known and its circuit is closed."""
        now = time.monotonic()
        return any(w.available(now) for w in self.decode_pool.workers.values())

    def check_model(self, model: str) -> None:
        """Raises UnknownModel unless `model` is empty (the default) or the model this router serves."""
        if model and model != self.config.model_name:
            raise UnknownModel(
                f"the model {model!r} does not exist; this server serves {self.config.model_name!r}", "model"
            )

    def channel(self, address: str) -> grpc.aio.Channel:
        """The router's (traced) channel to a worker, e.g. for health checks."""
        return self._channel(address)

    def pods(self, stage: str) -> list[str]:
        """The worker addresses of "prefill" or "decode" (in the order they came): those getting requests, then
        those draining."""
        pool = self._pool(stage)
        return [*pool.workers, *pool.draining]

    def draining_pods(self) -> set[str]:
        """Workers gone from discovery whose calls are still running."""
        return set(self.prefill_pool.draining) | set(self.decode_pool.draining)

    def _pool(self, stage: str) -> WorkerPool:
        return self.prefill_pool if stage == "prefill" else self.decode_pool

    def _pods_changed(self, stage: str, change: Change) -> None:
        """Discovery found pods that came or went: new ones get requests (and are asked for their limits),
        gone ones get none and drain."""
        pool = self._pool(stage)
        for address in change.added:
            pool.add(address)
            if self._asking:
                self._ask(stage, address)
        if change.added:
            self._workers_joined[stage].set()
            self._workers_joined[stage] = asyncio.Event()
        for address in change.removed:
            task = self._limit_asks.pop(address, None)
            if task is not None:
                task.cancel()
            self.worker_limits.pop(address, None)
            pool.remove(address)
        self._limits_changed.set()

    def _close_channel(self, address: str) -> None:
        """A removed worker has drained: close its channel (in the background; close() waits for it)."""
        channel = self._channels.pop(address, None)
        if channel is None:
            return
        log.info("worker %s drained: closing its channel", address)
        task = asyncio.ensure_future(channel.close())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def start(self) -> None:
        """Find the workers' pods (and keep finding them), learn the vocabulary size from the tokenizer service
        (waits for it to come up) and the context limit from the engine workers (_learn_max_model_len)."""
        await self.discovery.refresh()
        self.discovery.start()
        stub = tokenizer_pb2_grpc.TokenizerStub(self._channel(self.config.tokenizer_address))
        info = await stub.GetInfo(tokenizer_pb2.GetInfoRequest(), wait_for_ready=True, timeout=60)
        self.vocab_size = info.vocab_size
        await self._learn_max_model_len()
        self._started = True

    async def _learn_max_model_len(self) -> None:
        """Lower config.max_model_len to the smallest limit the engine workers report.

        Waits for a decode worker (nothing is served without one), then up to worker_info_wait_s for the others;
        a worker still silent is asked on in the background and lowers the limit when it answers.
        """
        c = self.config
        self._asking = True
        for stage in ("decode", "prefill"):
            for address in self._pool(stage).workers:
                self._ask(stage, address)
        if not self.decode_pool.workers:
            log.warning("router: no decode worker yet (%s): waiting for one", ", ".join(c.decode_addresses))
        while not any(address in self.worker_limits for address in self.decode_pool.workers):
            if self.decode_pool.workers and not any(address in self._limit_asks for address in self.decode_pool.workers):
                break  # every decode worker answered without a limit
            self._limits_changed.clear()
            await self._limits_changed.wait()
        silent = list(self._limit_asks.values())
        if silent:
            await asyncio.wait(silent, timeout=c.worker_info_wait_s)
        missing = [a for stage in ("decode", "prefill") for a in self._pool(stage).workers if a not in self.worker_limits]
        log.info("router: max_model_len %d (workers report %s)%s", c.max_model_len, self.worker_limits,
                 f"; not reported yet: {missing}" if missing else "")

    def _ask(self, stage: str, address: str) -> None:
        if address in self._limit_asks or address in self.worker_limits:
            return
        task = asyncio.ensure_future(self._ask_limit(stage, address))
        self._limit_asks[address] = task

        def done(_: asyncio.Task[None]) -> None:
            if self._limit_asks.get(address) is task:
                del self._limit_asks[address]
            self._limits_changed.set()

        task.add_done_callback(done)

    async def _ask_limit(self, stage: str, address: str) -> None:
        """Ask one engine worker for its limits until it answers (waiting for it to come up)."""
        channel = self._channel(address)
        stub = prefill_pb2_grpc.PrefillStub(channel) if stage == "prefill" else decode_pb2_grpc.DecodeStub(channel)
        while True:
            try:
                info = await stub.GetInfo(common_pb2.EngineInfoRequest(), wait_for_ready=True,
                                          timeout=self.config.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # not one of our engine stages: it sets no limit
                    log.warning("%s worker %s does not report its limits (GetInfo: UNIMPLEMENTED)", stage, address)
                    return
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # wait_for_ready has waited already
                    await asyncio.sleep(1.0)
                continue
            self._note_limit(stage, address, info.max_model_len)
            return

    def _note_limit(self, stage: str, address: str, limit: int) -> None:
        if not limit:
            return
        self.worker_limits[address] = limit
        if limit < self.config.max_model_len:
            if self._started:
                log.warning("%s worker %s serves at most %d tokens: max_model_len lowered from %d to %d",
                            stage, address, limit, self.config.max_model_len, limit)
            self.config.max_model_len = limit

    async def close(self) -> None:
        self._closing.set()
        await self.discovery.close()
        asks = list(self._limit_asks.values())
        for task in asks:
            task.cancel()
        await asyncio.gather(*asks, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    # -- preparing -------------------------------------------------------------------------------

    async def prepare(self, req: router_pb2.GenerateRequest, deadline: float | None = None,
                      content_filter: ContentFilter | None = None) -> PreparedRequest:
        """Tokenize and validate; raises InvalidRequest / ContextLengthExceeded / ServiceUnavailable.
        `content_filter`: the tenant's, applied to the answer's text."""
        arrived = time.monotonic()
        if not self.vocab_size:  # start() has not heard from the tokenizer yet: nothing can be checked
            raise ServiceUnavailable("the router is starting: waiting for the tokenizer service")
        request_id = req.request_id or new_request_id()
        if not valid_request_id(request_id):
            raise InvalidRequest(f"request_id must be {REQUEST_ID_RULE}", "request_id")
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
        chat_tools = self._chat_tools(req)
        prompt_ids = await self._prompt_ids(req, deadline, chat_tools)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "input")
        limit = self.config.max_model_len
        room = limit - len(prompt_ids)
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt_ids)} tokens; this server's context is {limit} tokens, prompt and "
                f"output together, so a prompt may have at most {limit - 1}",
                "input",
            )
        # What the stages get. A max_tokens the client (and the model's defaults) left out stays out: each stage
        # then gives the request what fits its context and KV cache (the whole context could need more blocks).
        wire = with_defaults(req.sampling, self.config.sampling_defaults, room)
        try:
            sampling = sampling_from_proto(wire, default_max_tokens=room)
        except InvalidSamplingParams as e:
            raise InvalidRequest(str(e), f"sampling.{e.field}") from e
        if sampling.max_tokens is not None and sampling.max_tokens > room:
            raise ContextLengthExceeded(
                f"max_tokens {sampling.max_tokens} + prompt {len(prompt_ids)} tokens exceeds the context of "
                f"{limit} tokens; lower max_tokens to at most {room}",
                "sampling.max_tokens",
            )
        first = sampling.reasoning_first
        if first is not None and max(first.start_id, first.end_id) >= self.vocab_size:
            raise InvalidRequest(f"reasoning_first names a token outside the vocabulary of {self.vocab_size}",
                                 "sampling.structured.reasoning_first")
        bad_stop = next((t for t in sampling.stop_token_ids if t >= self.vocab_size), None)
        if bad_stop is not None:
            raise InvalidRequest(
                f"stop token id {bad_stop} is outside the vocabulary of {self.vocab_size}", "sampling.stop_token_ids"
            )
        chat = self._chat_shape(req, prompt_ids, chat_tools) if req.WhichOneof("input") == "chat" else None
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
        if not self.vocab_size:
            raise ServiceUnavailable("the router is starting: waiting for the tokenizer service")
        return await self._prompt_ids(req, time.monotonic() + self.config.rpc_timeout_s, self._chat_tools(req))

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included."""
        bad = next((i for i in ids if i >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary of {self.vocab_size}", "tokens")
        detokenizer = self._detokenizer_factory(False)
        return detokenizer.push(ids) + detokenizer.flush()

    def _chat_tools(self, req: router_pb2.GenerateRequest) -> tuple[str, str]:
        """(tool_choice, the answer's forced start) of a chat request that offers tools; ("none", "") otherwise."""
        if req.WhichOneof("input") != "chat" or not req.chat.tools_json:
            return "none", ""
        choice = req.chat.tool_choice or "auto"
        if choice not in TOOL_CHOICES:
            raise InvalidRequest(f"chat.tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {choice!r}",
                                 "chat.tool_choice")
        if choice == "none":
            return choice, ""
        if self.config.tool_call_parser == "none":
            raise InvalidRequest("tools are turned off on this server (--tool-call-parser none)", "chat.tools_json")
        names = set()
        for raw in req.chat.tools_json:
            try:
                names.add(json.loads(raw).get("function", {}).get("name"))
            except (ValueError, AttributeError):
                raise InvalidRequest("chat.tools_json holds a tool that is not a JSON object", "chat.tools_json") \
                    from None
        if choice == "function" and req.chat.tool_choice_name not in names:
            raise InvalidRequest(f"chat.tool_choice_name {req.chat.tool_choice_name!r} is not one of the tools",
                                 "chat.tool_choice_name")
        return choice, forced_prefix(choice, req.chat.tool_choice_name)

    def _chat_shape(self, req: router_pb2.GenerateRequest, prompt_ids: list[int],
                    chat_tools: tuple[str, str]) -> ChatShape:
        choice, prefix = chat_tools
        think = self.config.think_token_ids if self.config.reasoning_parser == "qwen3" else None
        return ChatShape(
            reasoning=think is not None and not prefix,
            open_in_prompt=think is not None and thinking_open_in_prompt(prompt_ids, *think),
            think_end_id=think[1] if think is not None else -1,
            tools=choice != "none",
            prefix=prefix + req.chat.assistant_prefix,
        )

    async def _prompt_ids(self, req: router_pb2.GenerateRequest, deadline: float | None,
                          chat_tools: tuple[str, str] = ("none", "")) -> list[int]:
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
            choice, prefix = chat_tools
            if choice == "none":  # tools the model may not call are not offered to it
                del chat.tools_json[:]
            chat.assistant_prefix = prefix + req.chat.assistant_prefix
            treq = tokenizer_pb2.TokenizeRequest(chat=chat)
        stub = tokenizer_pb2_grpc.TokenizerStub(self._channel(self.config.tokenizer_address))
        with tracer.start_as_current_span("tokenize", attributes={"qwenserve.input": which}) as span:
            try:
                resp = await stub.Tokenize(treq, timeout=_remaining(deadline, self.config.rpc_timeout_s))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(e.details() or "invalid input", "input") from e
                raise ServiceUnavailable(f"tokenizer: {e.code().name}: {e.details()}") from e
            span.set_attribute(Attr.PROMPT_TOKENS, len(resp.ids))
        return list(resp.ids)

    # -- running ---------------------------------------------------------------------------------

    async def run(self, prep: PreparedRequest) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream the answer; the last message has finish_reason and usage, whatever happens.

        Closing this generator early (a stop string, a client that left) cancels the worker's call at
        once, so the worker frees the request's KV blocks; callers should close it (`aclosing`) rather
        than leave that to the garbage collector.
        """
        progress = _Progress()
        relay = _TextRelay(self._detokenizer_factory(prep.skip_special_tokens), StopStringMatcher(prep.stop))
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
                if finish == common_pb2.FINISH_REASON_ERROR and self.draining:
                    # Workers go away while the deployment shuts down: for the client that is an abort.
                    finish, error = common_pb2.FINISH_REASON_ABORT, _shutting_down()
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
        use_prefill = bool(self.prefill_pool.workers) and len(prep.prompt_ids) >= self.config.local_prefill_threshold
        self.metrics.queue_time.observe(time.monotonic() - prep.arrived)
        resp: prefill_pb2.PrefillResponse | None = None
        if use_prefill:
            try:
                with tracer.start_as_current_span("prefill", attributes={Attr.PROMPT_TOKENS: len(prep.prompt_ids)}):
                    resp = await self._prefill(prep)
            except NoWorkerAvailable as e:
                log.warning("%s: %s; the decode worker prefills the prompt itself", prep.request_id, e)
            except _RequestFailed as e:
                yield [], [], e.finish_reason, e.detail
                return
        if resp is None:
            async with contextlib.aclosing(self._decode(prep, progress, None)) as decode:
                async for item in decode:
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
        )
        if resp.HasField("first_logprob"):
            start.first_logprob.CopyFrom(resp.first_logprob)
        try:
            yield [resp.first_token_id], logprobs, 0, None
            async with contextlib.aclosing(self._decode(prep, progress, start)) as decode:
                async for item in decode:
                    yield item
        finally:
            if not progress.handoff_sent:
                # The request ended (a stop string in the first token, a client that left) or no decode
                # worker could be reached before any took the handoff: free it now, not at lease expiry.
                self._release_handoff(start.kv_handle, prep.request_id)

    def _release_handoff(self, handle: common_pb2.KVHandle, request_id: str, delay_s: float = 0.0) -> None:
        """Free a handoff at its exporter now (or after `delay_s`) rather than at its lease's expiry."""
        if not handle.control_endpoint:
            return
        task = asyncio.ensure_future(self._release(handle, request_id, delay_s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, handle: common_pb2.KVHandle, request_id: str, delay_s: float) -> None:
        if delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay_s)
        stub = kv_transfer_pb2_grpc.KVTransferStub(self._channel(handle.control_endpoint))
        release = kv_transfer_pb2.ReleaseRequest(handoff_id=handle.handoff_id, reason="cancelled")
        give_up, backoff = time.monotonic() + HANDOFF_RELEASE_RETRY_S, 0.5
        while True:
            try:
                await stub.Release(release, timeout=HANDOFF_RELEASE_TIMEOUT_S)
                return
            except grpc.aio.AioRpcError as e:
                unanswered = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not unanswered or self._closing.is_set() or time.monotonic() + backoff > give_up:
                    log.warning("%s: could not release handoff %s at %s (%s); its lease will free it", request_id,
                                handle.handoff_id, handle.control_endpoint, e.code().name)
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), backoff)  # closing: one last attempt at once
            backoff = min(2 * backoff, 4.0)

    async def _prefill(self, prep: PreparedRequest) -> prefill_pb2.PrefillResponse:
        """Prefill on the least loaded worker; a failure of any kind but the request's own moves it on.

        Raises NoWorkerAvailable when no attempt succeeded (the decode worker then prefills locally),
        _RequestFailed when the request itself was refused or ran out of time.
        """
        tried: list[str] = []
        request = prefill_pb2.PrefillRequest(
            request_id=prep.internal_id,
            prompt_token_ids=prep.prompt_ids,
            sampling=prep.wire_sampling,
            cache_salt=prep.cache_salt,
            priority=prep.priority,
        )
        tokens = len(prep.prompt_ids)
        for attempt in range(self.config.prefill_attempts):
            worker = self.prefill_pool.choose(prep.prompt_ids, exclude=tried)
            tried.append(worker.address)
            span = trace.get_current_span()
            span.set_attribute(Attr.WORKER, worker.address)
            span.set_attribute("qwenserve.attempt", attempt + 1)
            failed = False  # a client that leaves (CancelledError) is no fault of the worker
            self.prefill_pool.started(worker, tokens)
            try:
                if not await self._connected(worker.address):
                    failed, why = True, f"no connection within {self.config.connect_timeout_s:g}s"
                    self.prefill_pool.mark_dead(worker)
                else:
                    stub = prefill_pb2_grpc.PrefillStub(self._channel(worker.address))
                    timeout = _remaining(self._cutoff(prep), self._prefill_timeout(tokens))
                    try:
                        return await stub.Prefill(request, timeout=timeout)
                    except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
                        if isinstance(e, asyncio.CancelledError) or e.code() in PREFILL_MAYBE_RUNNING:
                            # Given up while the worker may still publish the handoff (its answer in flight, or
                            # a stopped worker resumed later): prefill names it after the request id, so free it
                            # by that name, before it is made if need be.
                            handle = common_pb2.KVHandle(handoff_id=prep.internal_id, control_endpoint=worker.address)
                            self._release_handoff(handle, prep.request_id, UNREAD_PREFILL_RELEASE_DELAY_S)
                        raise
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._expired(prep):
                    raise _RequestFailed(common_pb2.FINISH_REASON_ABORT, self._cutoff_detail(prep)) from e
                if code in CLIENT_MISTAKES:
                    raise _RequestFailed(common_pb2.FINISH_REASON_ERROR, _refusal(e)) from e
                failed = code != grpc.StatusCode.RESOURCE_EXHAUSTED  # an overloaded worker did nothing wrong
                if code in WORKER_GONE:
                    self.prefill_pool.mark_dead(worker)
                why = f"{code.name}: {e.details()}"
            finally:
                self.prefill_pool.finished(worker, tokens, failed)
            log.warning("%s: prefill on %s failed (%s), attempt %d", prep.request_id, worker.address, why, attempt + 1)
            self.metrics.record_retry("prefill")
        raise NoWorkerAvailable(f"prefill failed on {tried}")

    async def _decode(
        self, prep: PreparedRequest, progress: _Progress, start: decode_pb2.PrefilledStart | None
    ) -> AsyncIterator[tuple[list[int], list[common_pb2.TokenLogprob], int, common_pb2.ErrorDetail | None]]:
        """Stream from a decode worker; on a worker fault resume on another from the tokens so far."""
        tried: list[str] = []
        budget = prep.sampling.max_tokens or 0
        while True:
            try:
                worker = self.decode_pool.choose(prep.prompt_ids, exclude=tried)
            except NoWorkerAvailable:
                if not self.decode_pool.workers and self.config.cold_start_wait_s > 0 and not tried:
                    if await self._first_worker("decode", prep):
                        continue
                    yield [], [], common_pb2.FINISH_REASON_ERROR, _error(
                        "cold_start_timeout", f"no decode worker is running (scaled to zero) and none became ready "
                        f"within {self.config.cold_start_wait_s:g}s; retry shortly", retryable=True)
                    return
                yield [], [], common_pb2.FINISH_REASON_ERROR, _error(
                    "no_decode_worker", f"no decode worker could finish the request (tried {tried})", retryable=True
                )
                return
            tried.append(worker.address)
            self.decode_pool.started(worker, budget)
            # A span per attempt; current only while the call starts (this generator yields across it).
            span = tracer.start_span("decode", attributes={
                Attr.WORKER: worker.address, "qwenserve.attempt": len(tried), "qwenserve.handoff": start is not None,
            })
            request = self._decode_request(prep, progress, start)
            call: grpc.aio.UnaryStreamCall | None = None
            watch: _StreamWatch | None = None
            answered = False  # the worker sent a message
            # Set only for a fault of the worker: the request then fails over. A client that leaves
            # (GeneratorExit at a yield, CancelledError at an await) or a normal finish leaves it unset.
            fault = ""
            failed = False  # whether the fault counts towards the worker's circuit breaker
            try:
                if not await self._connected(worker.address):
                    fault, failed = f"no connection within {self.config.connect_timeout_s:g}s", True
                    self.decode_pool.mark_dead(worker)
                else:
                    call = self._start_decode(worker.address, request, span, prep)
                    progress.handoff_sent = progress.handoff_sent or request.HasField("prefilled")
                    watch = _StreamWatch(call, self.config.stall_timeout_s, lambda: self._drain_deadline)
                    self._watches.add(watch)
                    while True:
                        msg = await watch.read()
                        if msg is grpc.aio.EOF:
                            fault, failed = "the decode stream ended without a finish reason", True
                            break
                        answered = True
                        if not msg.token_ids and not msg.finish_reason:
                            continue  # a heartbeat: the worker is busy on this request (a long prompt)
                        if msg.token_ids:
                            progress.generated.extend(msg.token_ids)
                        if msg.prompt_logprobs and progress.prompt_logprobs is None:
                            progress.prompt_logprobs = list(msg.prompt_logprobs)
                        if msg.finish_reason:
                            if msg.HasField("usage") and not progress.cached_prompt_tokens:
                                progress.cached_prompt_tokens = msg.usage.cached_prompt_tokens
                            error = msg.error if msg.HasField("error") else None
                            yield list(msg.token_ids), list(msg.logprobs), msg.finish_reason, error
                            return
                        yield list(msg.token_ids), list(msg.logprobs), 0, None
            except _Stalled:
                fault, failed = f"no message for {self.config.stall_timeout_s:g}s", True
                self.decode_pool.mark_dead(worker)
            except _OutOfTime:
                yield [], [], common_pb2.FINISH_REASON_ABORT, self._cutoff_detail(prep)
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._expired(prep):
                    yield [], [], common_pb2.FINISH_REASON_ABORT, self._cutoff_detail(prep)
                    return
                if code == grpc.StatusCode.FAILED_PRECONDITION and start is not None:
                    # The handoff was refused (layout or checksum): recompute the prompt locally instead.
                    log.warning("%s: handoff refused by %s: %s", prep.request_id, worker.address, e.details())
                    start = None
                    tried.pop()
                    continue
                if code in CLIENT_MISTAKES:
                    yield [], [], common_pb2.FINISH_REASON_ERROR, _refusal(e)
                    return
                fault, failed = f"{code.name}: {e.details()}", code != grpc.StatusCode.RESOURCE_EXHAUSTED
                if code in WORKER_GONE:
                    self.decode_pool.mark_dead(worker)
            finally:
                if watch is not None:
                    watch.close()
                    self._watches.discard(watch)
                if call is not None:
                    call.cancel()  # a no-op after a finish; otherwise the worker aborts the request, frees the KV
                    if request.HasField("prefilled") and not answered:
                        # gRPC drops a call cancelled before its handler ran, and with it the worker's duty to
                        # release the handoff: release it here, late enough for a handler that did run to
                        # have done it first (releases are idempotent).
                        self._release_handoff(request.prefilled.kv_handle, prep.request_id, HANDOFF_RELEASE_DELAY_S)
                self.decode_pool.finished(worker, budget, failed)
                span.set_attribute(Attr.COMPLETION_TOKENS, len(progress.generated))
                span.end()
            self.metrics.record_failover("decode")
            if call is not None:
                start = None  # the failed worker may have consumed the handoff: recompute the prompt
            log.warning("%s: decode on %s failed (%s); resuming after %d tokens", prep.request_id,
                        worker.address, fault, len(progress.generated))

    async def _first_worker(self, stage: str, prep: PreparedRequest) -> bool:
        """Hold a request while `stage` has no worker, until one joins (True) or the cold-start wait, or the
        request's own deadline, runs out (False). The held count is what the operator scales up on."""
        wait = self.config.cold_start_wait_s
        cutoff = self._cutoff(prep)
        if cutoff is not None:
            wait = min(wait, cutoff - time.monotonic())
        self._held[stage] += 1
        started = time.monotonic()
        try:
            joined = self._workers_joined[stage]
            await asyncio.wait_for(joined.wait(), timeout=max(0.0, wait))
            self.metrics.cold_starts.labels(stage, "served").inc()
            log.info("%s: a %s worker joined after %.1fs held", prep.request_id, stage, time.monotonic() - started)
            return True
        except TimeoutError:
            self.metrics.cold_starts.labels(stage, "timed_out").inc()
            return False
        finally:
            self._held[stage] -= 1

    def _decode_request(
        self, prep: PreparedRequest, progress: _Progress, start: decode_pb2.PrefilledStart | None
    ) -> decode_pb2.DecodeRequest:
        request = decode_pb2.DecodeRequest(
            request_id=prep.internal_id,
            prompt_token_ids=prep.prompt_ids,
            sampling=prep.wire_sampling,
            cache_salt=prep.cache_salt,
            priority=prep.priority,
        )
        if start is not None or progress.prompt_logprobs is not None:
            # Computed once, where the prompt was first computed: a decode worker that imports the KV or resumes
            # after a failover takes prefix-cache hits instead of scoring the prompt again.
            request.sampling.ClearField("prompt_logprobs")
        if start is not None and len(progress.generated) == 1:
            request.prefilled.CopyFrom(start)
        else:
            request.local_prefill = True
            request.resume_token_ids.extend(progress.generated)
        return request

    def _start_decode(
        self, address: str, request: decode_pb2.DecodeRequest, span: trace.Span, prep: PreparedRequest
    ) -> grpc.aio.UnaryStreamCall:
        stub = decode_pb2_grpc.DecodeStub(self._channel(address))
        timeout = _remaining(self._cutoff(prep), None)
        if span.is_recording():
            with trace.use_span(span, end_on_exit=False):
                return stub.Decode(request, timeout=timeout)
        return stub.Decode(request, timeout=timeout)

    def _prefill_timeout(self, prompt_tokens: int) -> float:
        """A prefill call's deadline grows with its prompt: an 8k-token prompt of a 0.6B model takes minutes on
        a busy CPU, and a dead or stopped worker is noticed sooner anyway, by keepalive."""
        return self.config.prefill_timeout_s + self.config.prefill_timeout_per_token_s * prompt_tokens

    def _cutoff(self, prep: PreparedRequest) -> float | None:
        """When the request must end (time.monotonic()): its own deadline or the drain deadline, if sooner."""
        ends = [t for t in (prep.deadline, self._drain_deadline) if t is not None]
        return min(ends) if ends else None

    def _expired(self, prep: PreparedRequest) -> bool:
        # A little slack: gRPC's own deadline may fire a hair before our clock reads it.
        cutoff = self._cutoff(prep)
        return cutoff is not None and time.monotonic() >= cutoff - 0.05

    def _cutoff_detail(self, prep: PreparedRequest) -> common_pb2.ErrorDetail:
        drain = self._drain_deadline
        if drain is not None and (prep.deadline is None or drain <= prep.deadline):
            return _shutting_down()
        return _error("deadline_exceeded", "the request's deadline passed")


class _Stalled(Exception):
    """A decode stream sent nothing for stall_timeout_s."""


class _OutOfTime(Exception):
    """The request's deadline (or the router's drain deadline) came while waiting on a worker."""


class _StreamWatch:
    """Reads a decode stream; cancels the call when it sends nothing for `stall_s` or the router's drain
    deadline comes, and then makes `read()` raise _Stalled or _OutOfTime.

    One timer per stream, moved on only when it fires: noting a message is an assignment (an asyncio
    timeout around every read cost more than relaying the message). The request's own deadline is the
    call's gRPC deadline.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall, stall_s: float,
                 drain_deadline: Callable[[], float | None]) -> None:
        self._call = call
        self._stall_s = stall_s
        self._drain_deadline = drain_deadline
        self._last = time.monotonic()
        self._fired: type[Exception] | None = None
        self._timer = asyncio.get_running_loop().call_later(stall_s, self.check)

    async def read(self) -> decode_pb2.DecodeResponse:
        """The next message, or grpc.aio.EOF."""
        try:
            msg = await self._call.read()
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            # Our own cancel surfaces as CancelledError (or CANCELLED); a cancel of the task itself passes on.
            task = asyncio.current_task()
            ours = not isinstance(e, grpc.aio.AioRpcError) or e.code() == grpc.StatusCode.CANCELLED
            if self._fired is None or not ours or (task is not None and task.cancelling()):
                raise
            raise self._fired() from None
        self._last = time.monotonic()
        return msg

    def check(self) -> None:
        """Cancel the call if it is overdue, else look again when it would be (also when a drain starts)."""
        self._timer.cancel()
        due, why = self._last + self._stall_s, _Stalled
        drain = self._drain_deadline()
        if drain is not None and drain < due:
            due, why = drain, _OutOfTime
        left = due - time.monotonic()
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self.check)
            return
        self._fired = why
        self._call.cancel()

    def close(self) -> None:
        self._timer.cancel()


class _RequestFailed(Exception):
    """The request itself cannot go on: refused by a stage as invalid, or out of time."""

    def __init__(self, finish_reason: int, detail: common_pb2.ErrorDetail) -> None:
        super().__init__(detail.message)
        self.finish_reason = finish_reason
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


def _refusal(error: grpc.aio.AioRpcError) -> common_pb2.ErrorDetail:
    """A stage's refusal of the request itself, in the stage's words (the ErrorDetail of its status); named
    from the status code when it sent none (OUT_OF_RANGE: it does not fit the context or KV cache)."""
    detail = detail_of(error)
    if detail is not None:
        return detail
    code = error.code()
    name = "context_length_exceeded" if code == grpc.StatusCode.OUT_OF_RANGE else code.name.lower()
    return _error(name, error.details() or "the request was refused")


def _error(code: str, message: str, retryable: bool = False) -> common_pb2.ErrorDetail:
    return common_pb2.ErrorDetail(code=code, message=message, retryable=retryable)


def _shutting_down() -> common_pb2.ErrorDetail:
    return _error("shutting_down", "the server is shutting down; retry the request", retryable=True)


def _remaining(deadline: float | None, cap: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic()), at most `cap`; None when neither bounds it."""
    left = None if deadline is None else max(0.001, deadline - time.monotonic())
    if cap is None:
        return left
    return cap if left is None else min(left, cap)
