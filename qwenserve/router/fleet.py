"""The prefill and decode workers a router calls: the pods behind each address, a channel per pod, the
context limits the engines report, requests held while a stage has no worker, and the router's drain.

Each prefill and decode address that is a DNS name (a headless Service) stands for its pods: the fleet
keeps a worker and a channel per pod (discovery.py), closing a removed pod's channel once its calls end.
`Router` (generation.py) holds a fleet and runs requests on it; failover.py makes the calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from qwenserve.router.config import RouterConfig
from qwenserve.router.discovery import Change, PodDiscovery, Resolver
from qwenserve.router.prepared_request import PreparedRequest
from qwenserve.router.stream_slots import StreamSlots
from qwenserve.router.stream_watch import StreamWatch
from qwenserve.router.workers import WorkerPool
from qwenserve.stage_auth import credential_interceptors
from qwenserve.telemetry.metrics import RouterMetrics
from qwenserve.telemetry.tracing import client_interceptors
from qwenserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2_grpc,
)

log = logging.getLogger(__name__)

HANDOFF_RELEASE_TIMEOUT_S = 5.0  # one attempt; a worker that does not answer is asked again
# A release that found the worker stopped or unreachable is retried (backoff up to 4 s) for this long: a worker
# resumed after SIGSTOP may still publish the handoff, and the exporter refuses a name cancelled before it.
HANDOFF_RELEASE_RETRY_S = 60.0


class WorkerFleet:
    """The router's workers and its channels to them; retries and failovers are counted in `metrics`."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, resolver: Resolver) -> None:
        self.config = config
        self.discovery = PodDiscovery(
            {"prefill": config.prefill_addresses, "decode": config.decode_addresses},
            self._pods_changed, resolver, config.resolve_interval_s,
        )
        # Literal addresses are workers from the start; the pods of names join at start().
        self.prefill_pool = WorkerPool(self.discovery.pods["prefill"], on_drained=self._close_channel)
        self.decode_pool = WorkerPool(self.discovery.pods["decode"], on_drained=self._close_channel)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.metrics = metrics
        # A stage given no workers (prefill=0: decode prefills) is not a stage that is down.
        for stage, pool, given in (("prefill", self.prefill_pool, config.prefill_addresses),
                                   ("decode", self.decode_pool, config.decode_addresses)):
            if given:
                self.metrics.available_workers.labels(config.model_name, stage).set_function(pool.num_available)
        self.metrics.held_requests.labels(config.model_name, "decode").set_function(lambda: self._held)
        self.stream_slots = StreamSlots(config.max_streams_per_decode_worker, lambda: len(self.decode_pool.workers),
                                        config.priority_aging_s)
        self.metrics.queued_requests.labels(config.model_name).set_function(lambda: self.stream_slots.waiting)
        self.drain_deadline: float | None = None  # time.monotonic(); set once the router drains
        self._background: set[asyncio.Task[None]] = set()  # handoff releases still on their way
        self._closing = asyncio.Event()  # set by close(): delayed releases go out at once
        self.watches: set[StreamWatch] = set()  # decode streams in flight, told when a drain starts
        self.worker_limits: dict[str, int] = {}  # engine worker address -> the max_model_len it reported
        self.worker_precisions: dict[str, tuple[str, str]] = {}  # engine worker address -> (stage, its precision)
        self.sends_headers_on_accept: set[str] = set()  # decode workers that said so: their calls get accept_timeout_s
        self._limit_asks: dict[str, asyncio.Task[None]] = {}  # worker -> its GetInfo call, until it answers
        self._limits_changed = asyncio.Event()  # a worker reported, stopped being asked, or joined
        self._asking = False  # start() asks every worker for its limits, and from then on every new one
        self._started = False
        # Only decode is waited for: with no prefill worker the decode worker prefills the prompt itself.
        self._decode_joined = asyncio.Event()  # set when a decode pod joins
        self._held = 0  # requests waiting for a decode worker to start

    # -- lifecycle -------------------------------------------------------------------------------

    def channel(self, address: str) -> grpc.aio.Channel:
        """The router's (traced) channel to a worker (made on first use)."""
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
                    # A worker that comes up (a start, a restart) is found within a second, not after gRPC's
                    # 2-minute backoff: at 5 s, `up`'s router found its workers 5 s after they served, a quarter
                    # of its start on two cores. A refused connect on loopback or in a pod network costs nothing.
                    ("grpc.initial_reconnect_backoff_ms", 250),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                    # Prefill and decode channels each name one pod; the tokenizer's names its Service, whose
                    # pods then share the calls (gRPC's default, pick_first, would send every call to one).
                    ("grpc.lb_policy_name", "round_robin"),
                ],
                interceptors=[*credential_interceptors(c.stage_secret), *client_interceptors()],
            )
        return self._channels[address]

    async def connected(self, address: str) -> bool:
        """Whether the worker's connection is (or becomes, within connect_timeout_s) ready for calls.

        A worker that refuses connections fails at once; one that accepts and never answers (a stopped
        process) fails at the timeout. Either way the caller tries another worker.
        """
        channel = self.channel(address)
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
        self.drain_deadline = time.monotonic() + max(0.0, grace_s - min(1.0, grace_s / 5))
        for watch in list(self.watches):
            watch.check()
        log.info("router draining: streams still running in %.1fs end with finish reason abort", grace_s)

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def can_serve(self) -> bool:
        """Whether a decode worker could take a request now: one is known and its circuit is closed."""
        now = time.monotonic()
        return any(w.available(now) for w in self.decode_pool.workers.values())

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
        if change.added and stage == "decode":
            self._decode_joined.set()
            self._decode_joined = asyncio.Event()
            self.stream_slots.wake()  # more workers, more slots
        for address in change.removed:
            task = self._limit_asks.pop(address, None)
            if task is not None:
                task.cancel()
            self.worker_limits.pop(address, None)
            self.sends_headers_on_accept.discard(address)
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
        """Find the workers' pods (and keep finding them) and learn the context limit from the engine workers
        (_learn_max_model_len)."""
        await self.discovery.refresh()
        self.discovery.start()
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
        channel = self.channel(address)
        stub = prefill_pb2_grpc.PrefillStub(channel) if stage == "prefill" else decode_pb2_grpc.DecodeStub(channel)
        while True:
            try:
                info = await stub.GetInfo(common_pb2.EngineInfoRequest(), wait_for_ready=True,
                                          timeout=self.config.tokenizer_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # not one of our engine stages: it sets no limit
                    log.warning("%s worker %s does not report its limits (GetInfo: UNIMPLEMENTED)", stage, address)
                    return
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # wait_for_ready has waited already
                    await asyncio.sleep(1.0)
                continue
            if info.sends_headers_on_accept:
                self.sends_headers_on_accept.add(address)
            if info.precision:
                self.worker_precisions[address] = (stage, info.precision)
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

    def precisions(self) -> dict[str, str]:
        """What each engine stage computes in, as its workers reported it (several values where they differ, as
        during a rollout): e.g. {"prefill": "bfloat16", "decode": "weights=w4a16 kv=bfloat16 ..."}."""
        seen: dict[str, set[str]] = {}
        for stage, precision in self.worker_precisions.values():
            seen.setdefault(stage, set()).add(precision)
        return {stage: "; ".join(sorted(values)) for stage, values in sorted(seen.items())}

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

    # -- handoffs, held requests, deadlines --------------------------------------------------------

    def release_handoff(self, handle: common_pb2.KVHandle, request_id: str, delay_s: float = 0.0,
                        token: str = "") -> None:
        """Free a handoff at its exporter now (or after `delay_s`) rather than at its lease's expiry, presenting
        the `token` it is bound to; a handle with no handoff_id frees (or forestalls) the one bound to `token`."""
        if not handle.control_endpoint:
            return
        task = asyncio.ensure_future(self._release(handle, request_id, delay_s, token))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, handle: common_pb2.KVHandle, request_id: str, delay_s: float, token: str) -> None:
        if delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay_s)
        stub = kv_transfer_pb2_grpc.KVTransferStub(self.channel(handle.control_endpoint))
        release = kv_transfer_pb2.ReleaseRequest(handoff_id=handle.handoff_id, reason="cancelled", handoff_token=token)
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

    async def wait_for_decode_worker(self, prep: PreparedRequest) -> bool:
        """Hold a request while decode has no worker (scaled to zero), until one joins (True) or the cold-start
        wait, or the request's own deadline, runs out (False). The held count is what the operator scales up on."""
        wait = self.config.cold_start_wait_s
        cutoff = self.cutoff(prep)
        if cutoff is not None:
            wait = min(wait, cutoff - time.monotonic())
        self._held += 1
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._decode_joined.wait(), timeout=max(0.0, wait))
            self.metrics.cold_starts.labels("decode", "served").inc()
            log.info("%s: a decode worker joined after %.1fs held", prep.request_id, time.monotonic() - started)
            return True
        except TimeoutError:
            self.metrics.cold_starts.labels("decode", "timed_out").inc()
            return False
        finally:
            self._held -= 1

    def queue_wait(self, prep: PreparedRequest) -> float:
        """How long a request may wait for a decode stream slot: the queue wait, or less to its deadline."""
        cutoff = self.cutoff(prep)
        wait = self.config.max_queue_wait_s
        return wait if cutoff is None else min(wait, cutoff - time.monotonic())

    def prefill_timeout(self, prompt_tokens: int) -> float:
        """A prefill call's deadline grows with its prompt: an 8k-token prompt of a 0.6B model takes minutes on
        a busy CPU, and a dead or stopped worker is noticed sooner anyway, by keepalive."""
        return self.config.prefill_timeout_s + self.config.prefill_timeout_per_token_s * prompt_tokens

    def cutoff(self, prep: PreparedRequest) -> float | None:
        """When the request must end (time.monotonic()): its own deadline or the drain deadline, if sooner."""
        ends = [t for t in (prep.deadline, self.drain_deadline) if t is not None]
        return min(ends) if ends else None

    def expired(self, prep: PreparedRequest) -> bool:
        # A little slack: gRPC's own deadline may fire a hair before our clock reads it.
        cutoff = self.cutoff(prep)
        return cutoff is not None and time.monotonic() >= cutoff - 0.05

    def cutoff_detail(self, prep: PreparedRequest) -> common_pb2.ErrorDetail:
        drain = self.drain_deadline
        if drain is not None and (prep.deadline is None or drain <= prep.deadline):
            return shutting_down()
        return stage_error("deadline_exceeded", "the request's deadline passed")


def stage_error(code: str, message: str, retryable: bool = False) -> common_pb2.ErrorDetail:
    """The ErrorDetail a request's terminal message carries when the router (not a stage) ends it."""
    return common_pb2.ErrorDetail(code=code, message=message, retryable=retryable)


def shutting_down() -> common_pb2.ErrorDetail:
    """Why a stream still running at the drain deadline ended: retryable elsewhere."""
    return stage_error("shutting_down", "the server is shutting down; retry the request", retryable=True)


def remaining(deadline: float | None, cap: float | None) -> float | None:
    """Seconds until `deadline` (time.monotonic()), at most `cap`; None when neither bounds it."""
    left = None if deadline is None else max(0.001, deadline - time.monotonic())
    if cap is None:
        return left
    return cap if left is None else min(left, cap)
