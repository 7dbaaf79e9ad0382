"""A few clients sending requests back to back (HTTP streamed chat, HTTP completions, gRPC streams) until
told to stop, every request recorded with its answer; some clients leave at a random moment.

    async with Load(deployment, clients=4, rng=random.Random(7)) as load:
        ...                                   # inject faults while the load runs
    load.records                              # every request, with when it started and its Answer
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from types import TracebackType

import aiohttp
import grpc

from qwenserve.v1 import router_pb2, router_pb2_grpc
from tests.support.answers import DISCONNECTED, Answer, grpc_generate, http_post
from tests.support.deployment import Deployment

# A client gives up on a request after this (the request is then recorded as hung).
GIVE_UP_S = 60.0
# Stop strings a random model's output soon contains: requests that end on one finish normally ("stop").
COMMON_STOPS = ["e", "a", "o", "i"]
KINDS = ("http-stream", "http", "grpc")
# Each request asks for 16 to MAX_TOKENS tokens.
MAX_TOKENS = 48
# After an error a client waits this long before its next request, as a polite client would.
ERROR_PAUSE_S = 0.2


@dataclass
class Record:
    """One request: what kind, when it started (monotonic), whether it asked for stop strings, its answer."""

    kind: str
    started: float
    with_stops: bool
    answer: Answer

    @property
    def ended_at(self) -> float:
        return self.started + self.answer.elapsed_s


class Load:
    """`clients` concurrent clients; a `disconnect_share` of requests is abandoned after a random delay of up
    to `max_disconnect_s`, a `stop_share` asks for COMMON_STOPS."""

    def __init__(self, deployment: Deployment, clients: int, rng: random.Random, *,
                 disconnect_share: float = 0.0, max_disconnect_s: float = 1.5,
                 stop_share: float = 0.0) -> None:
        self.deployment = deployment
        self.clients = clients
        self.rng = rng
        self.disconnect_share = disconnect_share
        self.max_disconnect_s = max_disconnect_s
        self.stop_share = stop_share
        self.records: list[Record] = []
        # When the fault injected under this load began, and when it was over (restart or SIGCONT included).
        self.fault_started = self.fault_ended = 0.0
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        # A connection per request: a disconnect closes exactly that request's connection.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self._channel = grpc.aio.insecure_channel(self.deployment.grpc_address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        """Let every client finish the request it is in, then close the connections."""
        self._stopping.set()
        await asyncio.gather(*self._tasks, return_exceptions=exc is not None)
        await self._session.close()
        await self._channel.close()

    def summary(self) -> Counter[str]:
        """Requests by outcome: ok, disconnected, or the error's status and code."""
        out: Counter[str] = Counter()
        for record in self.records:
            a = record.answer
            out["ok" if a.succeeded else a.status if not a.error_code else f"{a.status} {a.error_code}"] += 1
        return out

    async def _client(self, index: int) -> None:
        while not self._stopping.is_set():
            kind = self.rng.choice(KINDS)
            with_stops = self.rng.random() < self.stop_share
            leave_after = (self.rng.uniform(0, self.max_disconnect_s)
                           if self.rng.random() < self.disconnect_share else None)
            started = time.monotonic()
            max_tokens = self.rng.randint(16, MAX_TOKENS)
            work = asyncio.ensure_future(self._request(kind, index, max_tokens, with_stops))
            done, _ = await asyncio.wait({work}, timeout=leave_after)
            if done:
                answer = work.result()
            else:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                answer = Answer(kind.split("-")[0], DISCONNECTED, time.monotonic() - started)
            self.records.append(Record(kind, started, with_stops, answer))
            if answer.ended and not answer.succeeded:
                await asyncio.sleep(ERROR_PAUSE_S)

    async def _request(self, kind: str, index: int, max_tokens: int, with_stops: bool) -> Answer:
        prompt = f"Client {index} says hello number {self.rng.randint(0, 10**6)}"
        stops = COMMON_STOPS if with_stops else []
        if kind == "grpc":
            request = router_pb2.GenerateRequest(prompt=prompt, stop=stops)
            request.sampling.max_tokens = max_tokens
            request.sampling.ignore_eos = True
            return await grpc_generate(self._stub, request, self.deployment.grpc_metadata(), GIVE_UP_S)
        body: dict[str, object] = {"model": self.deployment.model_name, "max_tokens": max_tokens,
                                   "ignore_eos": True}
        if stops:
            body["stop"] = stops
        if kind == "http-stream":
            body.update(messages=[{"role": "user", "content": prompt}], stream=True)
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        return await http_post(self._session, self.deployment.http_base + path, json.dumps(body).encode(),
                               self.deployment.http_headers(), GIVE_UP_S)
