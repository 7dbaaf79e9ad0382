"""What the load generator talks to. Every target turns one LoadRequest into a stream of Chunks:
the router over gRPC `Generate`, any OpenAI-compatible HTTP server (qwen-serve's front, vLLM, SGLang,
TGI...), the in-process engine, or a synthetic server with known latencies (to check the generator).

A target raises TargetError with a short `kind` ("grpc:UNAVAILABLE", "http:429", "connect", ...) for
a failed request; the runner records it and carries on.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from qwenserve.loadgen.prompts import Prompt
from qwenserve.loadgen.workload import RequestSpec


class TargetError(Exception):
    """A request failed; `kind` is the error type counted in the report."""

    def __init__(self, kind: str, message: str = "") -> None:
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind
        self.message = message


@dataclass(frozen=True, slots=True)
class ReportedUsage:
    """The token counts the server reported for one request (its last message's usage)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed message: `tokens` new output tokens; usage and finish_reason on the last one.
    error_code is set when the server ended the stream with an error."""

    tokens: int
    usage: ReportedUsage | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str = ""


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request as sent: the spec it came from, its prompt, and how many tokens to generate."""

    request_id: str
    spec: RequestSpec
    prompt: Prompt

    @property
    def max_tokens(self) -> int:
        return self.spec.output_len


class Target(Protocol):
    """A server under test."""

    name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def max_model_len(self) -> int | None: ...

    def stream(self, req: LoadRequest) -> AsyncIterator[Chunk]: ...


# ---- gRPC router ------------------------------------------------------------------------------------


class GrpcTarget:
    """The router's gRPC `Generate`. input: "text" (raw prompt, no template, so the prompt's token count
    is exact), "chat" (one user message through the chat template) or "tokens" (prompt_token_ids)."""

    def __init__(self, address: str, *, input_mode: str = "text", api_key: str | None = None,
                 timeout_s: float = 600.0, cache_salt_per_request: bool = False) -> None:
        self.name = f"grpc://{address}"
        self.address = address
        self.input_mode = input_mode
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.timeout_s = timeout_s
        # A fresh salt per request keeps every request out of every other's prefix cache ("cold" runs).
        self.cache_salt_per_request = cache_salt_per_request
        self._channel: Any = None
        self._stub: Any = None

    async def start(self) -> None:
        import grpc

        from qwenserve.v1 import router_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self.address, options=[("grpc.enable_retries", 0)])
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def max_model_len(self) -> int | None:
        import grpc

        from qwenserve.v1 import router_pb2

        try:
            reply = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=5.0, metadata=self.metadata)
        except grpc.aio.AioRpcError:
            return None
        return reply.models[0].max_model_len if reply.models and reply.models[0].max_model_len else None

    def _request(self, req: LoadRequest) -> Any:
        from qwenserve.v1 import router_pb2

        msg = router_pb2.GenerateRequest(request_id=req.request_id)
        if self.input_mode == "tokens":
            msg.prompt_token_ids.ids.extend(req.prompt.token_ids)
        elif self.input_mode == "chat":
            msg.chat.messages.add(role="user", content=req.prompt.text)
            msg.chat.add_generation_prompt = True
        else:
            msg.prompt = req.prompt.text
        msg.sampling.max_tokens = req.max_tokens
        msg.sampling.temperature = 0.0
        msg.sampling.ignore_eos = True  # the mix decides the output length, not the (random) model
        if self.cache_salt_per_request:
            msg.cache_salt = req.request_id
        return msg

    async def stream(self, req: LoadRequest) -> AsyncIterator[Chunk]:
        import grpc

        from qwenserve.v1 import common_pb2

        try:
            call = self._stub.Generate(self._request(req), timeout=self.timeout_s, metadata=self.metadata)
            async for msg in call:
                if not msg.finish_reason:
                    yield Chunk(len(msg.token_ids))
                    continue
                reason = common_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
                u = msg.usage
                err = msg.error if msg.HasField("error") else None
                yield Chunk(len(msg.token_ids), ReportedUsage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
                            reason, (err.code or "error") if reason == "error" else None, err.message if err else "")
        except grpc.aio.AioRpcError as e:
            kind = "timeout" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else f"grpc:{e.code().name}"
            raise TargetError(kind, e.details() or "") from None


# ---- OpenAI-compatible HTTP ---------------------------------------------------------------------------


class HttpTarget:
    """An OpenAI-compatible server, streaming. api: "completions" (text prompt, exact token count) or
    "chat". Output tokens per chunk come from `continuous_usage_stats` when the server supports it
    (qwen-serve, vLLM); otherwise each content chunk counts one token and the final usage corrects the
    total (set continuous_usage=False for servers that reject the option)."""

    def __init__(self, base_url: str, *, api: str = "completions", model: str | None = None,
                 api_key: str | None = None, timeout_s: float = 600.0, continuous_usage: bool = True,
                 ignore_eos: bool = True) -> None:
        self.name = base_url
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api = api
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.continuous_usage = continuous_usage
        self.ignore_eos = ignore_eos
        self._session: Any = None
        self._max_model_len: int | None = None

    async def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10.0),
            connector=aiohttp.TCPConnector(limit=0),
        )
        await self._read_models()

    async def _read_models(self) -> None:
        """The served model's name (many servers require it) and context length, when /v1/models answers."""
        import aiohttp

        try:
            async with self._session.get(f"{self.base_url}/v1/models", headers=self.headers) as resp:
                if resp.status != 200:
                    return
                body = await resp.json()
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError):
            return  # a dead server: every request will say why
        models = body.get("data") or []
        if models:
            self.model = self.model or models[0].get("id")
            self._max_model_len = models[0].get("max_model_len")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def max_model_len(self) -> int | None:
        return self._max_model_len

    def _body(self, req: LoadRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt.text}]
        else:
            body["prompt"] = req.prompt.text
        return body

    async def stream(self, req: LoadRequest) -> AsyncIterator[Chunk]:
        import aiohttp

        path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        headers = {**self.headers, "X-Request-Id": req.request_id}
        seen = 0
        try:
            async with self._session.post(f"{self.base_url}{path}", json=self._body(req), headers=headers) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise TargetError(f"http:{resp.status}", text)
                finish: str | None = None
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event and not event.get("choices"):
                        err = event["error"]
                        raise TargetError(f"stream:{err.get('code') or err.get('type') or 'error'}",
                                          str(err.get("message", "")))
                    choice = (event.get("choices") or [{}])[0]
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    usage = event.get("usage")
                    if usage and self.continuous_usage:
                        tokens = usage.get("completion_tokens", 0) - seen
                    else:
                        tokens = 1 if text else 0
                    seen += tokens
                    finish = choice.get("finish_reason") or finish
                    error_code = None
                    if finish == "error":
                        err = choice.get("error") or event.get("error") or {}
                        error_code = err.get("code") or "error"
                    if usage and not event.get("choices"):
                        details = usage.get("prompt_tokens_details") or {}
                        yield Chunk(tokens, ReportedUsage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                                                  details.get("cached_tokens", 0) or 0), finish)
                    elif tokens or error_code:
                        yield Chunk(tokens, finish_reason=finish if error_code else None, error_code=error_code)
        except aiohttp.ClientConnectorError as e:
            raise TargetError("connect", str(e)) from None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
            raise TargetError("disconnected", str(e)) from None
        except aiohttp.ClientError as e:
            raise TargetError(f"http:{type(e).__name__}", str(e)) from None
        except TimeoutError:
            raise TargetError("timeout", f"no answer within {self.timeout_s:.0f}s") from None


# ---- in-process engine --------------------------------------------------------------------------------


class EngineTarget:
    """The engine in this process (no network, no router): what the scheduler alone does.
    Settings come from the engine flags' QWENSERVE_* variables plus `overrides` (e.g. enable_prefix_caching=False)."""

    def __init__(self, model: Path, **overrides: object) -> None:
        self.name = f"engine:{model}"
        self.model = model
        self.overrides = overrides
        self.engine: Any = None

    async def start(self) -> None:
        from qwenserve.engine.config import EngineConfig
        from qwenserve.engine.engine import LLMEngine
        from qwenserve.flags import config_from_env

        config = config_from_env(EngineConfig, **self.overrides)
        self.engine = await asyncio.to_thread(LLMEngine.from_pretrained, self.model, config)

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    async def max_model_len(self) -> int | None:
        return self.engine.max_model_len if hasattr(self.engine, "max_model_len") else None

    async def stream(self, req: LoadRequest) -> AsyncIterator[Chunk]:
        from qwenserve.engine.errors import RequestError
        from qwenserve.engine.sampling_params import SamplingParams
        from qwenserve.request_limits import RequestOutOfLimits

        params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        try:
            async for out in self.engine.generate(req.request_id, req.prompt.token_ids, params):
                if not out.finished:
                    yield Chunk(len(out.new_token_ids))
                    continue
                u = out.usage
                yield Chunk(len(out.new_token_ids), ReportedUsage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
                            out.finish_reason, "error" if out.finish_reason == "error" else None, out.error or "")
        except (RequestError, RequestOutOfLimits) as e:
            raise TargetError(f"engine:{type(e).__name__}", str(e)) from None


# ---- synthetic ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class SyntheticTarget:
    """A server with known behaviour, to check the generator's own arithmetic and control flow:
    TTFT = ttft_s + prompt_tokens * prefill_s_per_token, then one token every itl_s; every
    `slow_every`-th request (by index) adds slow_extra_s to its TTFT; every `error_every`-th fails
    with a gRPC-like UNAVAILABLE. Usage is reported exactly."""

    ttft_s: float = 0.05
    itl_s: float = 0.01
    prefill_s_per_token: float = 0.0
    slow_every: int = 0
    slow_extra_s: float = 0.0
    error_every: int = 0
    max_len: int | None = 4096
    name: str = "synthetic"

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def max_model_len(self) -> int | None:
        return self.max_len

    def expected_ttft(self, spec: RequestSpec) -> float:
        """The TTFT this target aims for (the measured one is a little larger: timer overshoot)."""
        slow = self.slow_every and (spec.index + 1) % self.slow_every == 0
        return self.ttft_s + spec.prompt_len * self.prefill_s_per_token + (self.slow_extra_s if slow else 0.0)

    async def stream(self, req: LoadRequest) -> AsyncIterator[Chunk]:
        if self.error_every and (req.spec.index + 1) % self.error_every == 0:
            await asyncio.sleep(self.ttft_s)
            raise TargetError("grpc:UNAVAILABLE", "synthetic failure")
        await asyncio.sleep(self.expected_ttft(req.spec))
        n = req.max_tokens
        for i in range(n):
            if i:
                await asyncio.sleep(self.itl_s)
            last = i == n - 1
            usage = ReportedUsage(len(req.prompt.token_ids), n) if last else None
            yield Chunk(1, usage, "length" if last else None)


def parse_synthetic(spec: str) -> SyntheticTarget:
    """`synthetic` or `synthetic:ttft_ms=50,itl_ms=10,slow_every=4,slow_extra_ms=200,error_every=10`."""
    target = SyntheticTarget()
    _, _, params = spec.partition(":")
    for item in filter(None, params.split(",")):
        key, _, value = item.partition("=")
        if key.endswith("_ms"):
            setattr(target, key.removesuffix("_ms") + "_s", float(value) / 1000.0)
        elif key in ("slow_every", "error_every"):
            setattr(target, key, int(value))
        else:
            raise ValueError(f"synthetic target: unknown setting {key!r}")
    return target


def make_target(spec: str, **options: Any) -> Target:
    """A target from its address: grpc://host:port, http(s)://host:port, engine:/model/dir, synthetic[:...]."""
    if spec.startswith("grpc://"):
        keys = ("input_mode", "api_key", "timeout_s", "cache_salt_per_request")
        return GrpcTarget(spec.removeprefix("grpc://"), **{k: v for k, v in options.items() if k in keys})
    if spec.startswith(("http://", "https://")):
        keys = ("api", "model", "api_key", "timeout_s", "continuous_usage", "ignore_eos")
        return HttpTarget(spec, **{k: v for k, v in options.items() if k in keys})
    if spec.startswith("engine:"):
        return EngineTarget(Path(spec.removeprefix("engine:")), **options.get("engine_overrides", {}))
    if spec.startswith("synthetic"):
        return parse_synthetic(spec)
    raise ValueError(f"target {spec!r}: use grpc://host:port, http://host:port, engine:/model/dir or synthetic")


def new_request_id() -> str:
    return f"bench-{uuid.uuid4().hex[:20]}"
