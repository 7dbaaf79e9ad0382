"""The Tokenizer stage: `qwenserve.tokenizer` on the wire (qwenserve.v1.Tokenizer).

`qwen-serve serve tokenizer [MODEL] [--host H] [--port N]` (the options are TokenizerServiceConfig's, in
`config.py`); without a model it serves the
built-in Qwen3 vocabulary and chat template (the default model's tokenizer).

Bad input (nothing to tokenize, too large, invalid UTF-8, unknown roles, ids outside the
vocabulary, a template that refuses the conversation) is INVALID_ARGUMENT with a message naming the
field; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import StatusCode

from qwenserve.grpc_server import GrpcServerConfig, serve
from qwenserve.rpc_errors import abort, error_detail
from qwenserve.telemetry.metrics import tokenizer_metrics
from qwenserve.telemetry.tracing import get_tracer
from qwenserve.tokenizer import (
    BuiltinVocab,
    ChatTemplateError,
    IncrementalDetokenizer,
    InputLimits,
    InvalidInput,
    Tokenizer,
    TokenizerError,
    clean_messages,
    clean_text,
    decode_utf8,
)
from qwenserve.tokenizer.hygiene import parse_json_object
from qwenserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from qwenserve_services.stage_config import argv_or_sys, start
from qwenserve_services.tokenizer.config import TokenizerServiceConfig, check, parse_config

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# Inputs up to this size are encoded on the event loop: a thread hop would cost more than the work.
INLINE_BYTES = 16 << 10
# Template variables the service sets itself; chat_template_kwargs_json may not override them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

T = TypeVar("T")
tracer = get_tracer("qwenserve.tokenizer")


def load_tokenizer(config: TokenizerServiceConfig) -> Tokenizer:
    """The tokenizer the service answers with."""
    if config.model:
        return Tokenizer.from_dir(config.model)
    return Tokenizer.builtin(BuiltinVocab.from_name(config.vocab))


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Wires `Tokenizer` to the qwenserve.v1.Tokenizer RPCs."""

    def __init__(self, tokenizer: Tokenizer, config: TokenizerServiceConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.limits = InputLimits(max_text_bytes=config.max_input_bytes, max_batch=config.max_batch)
        self.pool = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="tokenize")
        self.metrics = tokenizer_metrics()

    # ---- RPCs -------------------------------------------------------------------------

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        inline = request.ByteSize() <= INLINE_BYTES
        return await self._guard(context, lambda: self._tokenize(request, "request"), inline, "Tokenize",
                                 lambda r: (1, len(r.ids)))

    async def TokenizeBatch(
        self, request: tokenizer_pb2.TokenizeBatchRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeBatchResponse:
        def work() -> tokenizer_pb2.TokenizeBatchResponse:
            self._check_batch(len(request.requests), "requests")
            return tokenizer_pb2.TokenizeBatchResponse(
                responses=[self._tokenize(r, f"requests[{i}]") for i, r in enumerate(request.requests)]
            )

        return await self._guard(context, work, inline=False, rpc="TokenizeBatch",
                                 count=lambda r: (len(r.responses), sum(len(x.ids) for x in r.responses)))

    async def CountTokens(
        self, request: tokenizer_pb2.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.CountTokensResponse:
        def work() -> tokenizer_pb2.CountTokensResponse:
            self._check_batch(len(request.texts), "texts")
            limit = self.limits.max_text_bytes
            texts = [clean_text(t, f"texts[{i}]", limit) for i, t in enumerate(request.texts)]
            counts = [len(ids) for ids in self.tokenizer.encode_batch(texts)]
            return tokenizer_pb2.CountTokensResponse(counts=counts, total=sum(counts))

        return await self._guard(context, work, inline=request.ByteSize() <= INLINE_BYTES, rpc="CountTokens",
                                 count=lambda r: (len(r.counts), r.total))

    async def Detokenize(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        detokenizer: IncrementalDetokenizer | None = None
        index = 0
        async for request in request_iterator:
            if detokenizer is None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, request.skip_special_tokens)
            try:
                self.tokenizer.check_ids(request.ids, f"message[{index}].ids")
            except InvalidInput as err:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, invalid_input_detail(err))
            text = detokenizer.push(request.ids)
            if request.flush:
                text += detokenizer.flush()
            index += 1
            yield tokenizer_pb2.DetokenizeResponse(text=text)
        # A stream that ends inside a character ends like a full decode: with U+FFFD.
        if detokenizer is not None and detokenizer.pending:
            yield tokenizer_pb2.DetokenizeResponse(text=detokenizer.flush())

    async def GetInfo(
        self, request: tokenizer_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        template = self.tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default", "")
        return tokenizer_pb2.TokenizerInfo(
            vocab_size=self.tokenizer.vocab_size,
            special_tokens=self.tokenizer.special_tokens,
            eos_token_ids=self.tokenizer.eos_token_ids,
            chat_template=template or "",
            max_input_bytes=self.limits.max_text_bytes,
        )

    # ---- the work ----------------------------------------------------------------------

    async def _guard(
        self,
        context: grpc.aio.ServicerContext,
        work: Callable[[], T],
        inline: bool,
        rpc: str,
        count: Callable[[T], tuple[int, int]] | None = None,
    ) -> T:
        """Run `work` (on the loop or in the pool); a caller's mistake becomes INVALID_ARGUMENT.

        `count(result)` gives the (texts, tokens) the call handled, for the metrics and its span.
        """
        started, code, texts, tokens = time.perf_counter(), "OK", 0, 0
        # The span lives here, on the loop: the pool's threads do not inherit the trace context.
        with tracer.start_as_current_span(f"tokenizer.{rpc}") as span:
            try:
                result = work() if inline else await asyncio.get_running_loop().run_in_executor(self.pool, work)
                if count is not None:
                    texts, tokens = count(result)
                    span.set_attribute("qwenserve.tokenizer.texts", texts)
                    span.set_attribute("qwenserve.tokenizer.tokens", tokens)
                return result
            except (InvalidInput, ChatTemplateError) as err:
                code = "INVALID_ARGUMENT"
                span.set_status(StatusCode.ERROR, str(err))
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, invalid_input_detail(err))
            finally:
                self.metrics.record_rpc(rpc, code, time.perf_counter() - started, texts=texts, tokens=tokens)
        raise AssertionError("unreachable: abort raises")

    def _check_batch(self, size: int, field: str) -> None:
        if size == 0:
            raise InvalidInput(field, "is empty; send at least one input")
        if size > self.limits.max_batch:
            raise InvalidInput(field, f"has {size} inputs, more than the limit of {self.limits.max_batch}")

    def _tokenize(self, request: tokenizer_pb2.TokenizeRequest, where: str) -> tokenizer_pb2.TokenizeResponse:
        kind = request.WhichOneof("input")
        rendered = ""
        if kind is None:
            raise InvalidInput(where, "has no input; set one of text, text_bytes or chat")
        if kind == "chat":
            rendered = self._render_chat(request.chat, f"{where}.chat")
            ids = self.tokenizer.encode(rendered)
        else:
            raw = request.text if kind == "text" else decode_utf8(request.text_bytes, f"{where}.text_bytes")
            if not raw:
                raise InvalidInput(f"{where}.{kind}", "is empty; there is nothing to tokenize")
            ids = self.tokenizer.encode(clean_text(raw, f"{where}.{kind}", self.limits.max_text_bytes))
        count = len(ids)
        limit = request.max_length
        if limit and count > limit:
            if request.reject_if_longer:
                raise InvalidInput(f"{where}.max_length", f"the input is {count} tokens, more than {limit}")
            ids = (
                ids[-limit:] if request.truncation_side == tokenizer_pb2.TRUNCATION_SIDE_LEFT else ids[:limit]
            )
        return tokenizer_pb2.TokenizeResponse(
            ids=ids, count=count, truncated=len(ids) < count, rendered=rendered
        )

    def _render_chat(self, chat: common_pb2.ChatInput, where: str) -> str:
        messages: list[dict[str, Any]] = []
        for i, m in enumerate(chat.messages):
            message: dict[str, Any] = {"role": m.role, "content": m.content}
            for key in ("name", "tool_call_id", "reasoning_content"):
                if value := getattr(m, key):
                    message[key] = value
            if m.tool_calls_json:
                message["tool_calls"] = [
                    parse_json_object(raw, f"{where}.messages[{i}].tool_calls_json[{j}]")
                    for j, raw in enumerate(m.tool_calls_json)
                ]
            messages.append(message)
        try:
            messages = clean_messages(messages, self.limits)
        except InvalidInput as err:
            raise InvalidInput(f"{where}.{err.field}", err.message) from None
        if len(chat.tools_json) > self.limits.max_tools:
            raise InvalidInput(f"{where}.tools_json", f"has more than {self.limits.max_tools} tools")
        tools = [parse_json_object(raw, f"{where}.tools_json[{i}]") for i, raw in enumerate(chat.tools_json)]
        kwargs: dict[str, Any] = {}
        if chat.chat_template_kwargs_json:
            kwargs = parse_json_object(chat.chat_template_kwargs_json, f"{where}.chat_template_kwargs_json")
            if reserved := RESERVED_TEMPLATE_VARIABLES & kwargs.keys():
                raise InvalidInput(
                    f"{where}.chat_template_kwargs_json",
                    f"may not set {', '.join(sorted(reserved))}; use the fields",
                )
        if chat.HasField("enable_thinking"):
            kwargs["enable_thinking"] = chat.enable_thinking
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=chat.add_generation_prompt, **kwargs
        )
        return rendered + chat.assistant_prefix  # the answer's forced start, which the model continues


def invalid_input_detail(err: InvalidInput | ChatTemplateError) -> common_pb2.ErrorDetail:
    """A caller's mistake as an ErrorDetail: `invalid_argument` naming the field, or `chat_template_error`."""
    if isinstance(err, InvalidInput):
        return error_detail("invalid_argument", str(err), field=err.field)
    return error_detail("chat_template_error", str(err))


# ---- command line --------------------------------------------------------------------------


async def run(config: TokenizerServiceConfig) -> None:
    """Load the tokenizer, then serve until SIGTERM / SIGINT."""
    tokenizer = load_tokenizer(config)
    servicer = TokenizerServicer(tokenizer, config)

    async def warm_up() -> None:
        # Compiles the chat template and touches the encoder before health says SERVING.
        tokenizer.encode("warm-up: hello, 你好 👋")
        if tokenizer.chat_template:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)

    server_config = GrpcServerConfig(
        host=config.host, port=config.port, max_message_bytes=config.max_message_bytes, grace_s=config.grace_s,
        metrics_port=config.metrics_port,
    )
    try:
        await serve(
            server_config,
            "tokenizer",
            [SERVICE_NAME],
            lambda server: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server),
            warm_up,
        )
    finally:
        servicer.pool.shutdown(wait=False, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `qwen-serve serve tokenizer`."""
    return start("tokenizer", parse_config(argv_or_sys(argv)), check, run,
                 startup_errors=(OSError, ValueError, TokenizerError))


if __name__ == "__main__":
    sys.exit(main())
