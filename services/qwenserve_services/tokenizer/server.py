"""The Tokenizer stage: `qwenserve.tokenizer.service` on the wire (qwenserve.v1.Tokenizer).

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
from typing import TypeVar

import grpc
from opentelemetry.trace import StatusCode

from qwenserve.grpc_server import GrpcServerConfig, serve
from qwenserve.rpc_errors import abort
from qwenserve.stage_auth import guarding_secret
from qwenserve.stages.common import argv_or_sys, checked, run_checked
from qwenserve.stages.tokenizer import TokenizerServiceConfig, check, parse_config
from qwenserve.telemetry.metrics import tokenizer_metrics
from qwenserve.telemetry.tracing import get_tracer
from qwenserve.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    InputLimits,
    InvalidInput,
    TokenizerError,
)
from qwenserve.tokenizer.service import TokenizerService, invalid_input_detail, load_tokenizer
from qwenserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# Inputs up to this size are encoded on the event loop: a thread hop would cost more than the work.
INLINE_BYTES = 16 << 10

T = TypeVar("T")
tracer = get_tracer("qwenserve.tokenizer")


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Wires `TokenizerService` to the qwenserve.v1.Tokenizer RPCs: thread pool, metrics, spans, statuses."""

    def __init__(self, service: TokenizerService, workers: int) -> None:
        self.service = service
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self.metrics = tokenizer_metrics()

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        inline = request.ByteSize() <= INLINE_BYTES
        return await self._guard(context, lambda: self.service.tokenize(request), inline, "Tokenize",
                                 lambda r: (1, len(r.ids)))

    async def TokenizeBatch(
        self, request: tokenizer_pb2.TokenizeBatchRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeBatchResponse:
        return await self._guard(context, lambda: self.service.tokenize_batch(request), inline=False,
                                 rpc="TokenizeBatch",
                                 count=lambda r: (len(r.responses), sum(len(x.ids) for x in r.responses)))

    async def CountTokens(
        self, request: tokenizer_pb2.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.CountTokensResponse:
        return await self._guard(context, lambda: self.service.count_tokens(request),
                                 inline=request.ByteSize() <= INLINE_BYTES, rpc="CountTokens",
                                 count=lambda r: (len(r.counts), r.total))

    async def Detokenize(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        tokenizer = self.service.tokenizer
        detokenizer: IncrementalDetokenizer | None = None
        index = 0
        async for request in request_iterator:
            if detokenizer is None:
                detokenizer = IncrementalDetokenizer(tokenizer, request.skip_special_tokens)
            try:
                tokenizer.check_ids(request.ids, f"message[{index}].ids")
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
        return self.service.info()

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


async def run(config: TokenizerServiceConfig) -> None:
    """Load the tokenizer, then serve until SIGTERM / SIGINT."""
    limits = InputLimits(max_text_bytes=config.max_input_bytes, max_batch=config.max_batch)
    service = TokenizerService(load_tokenizer(config.model, config.vocab), limits)
    servicer = TokenizerServicer(service, config.workers)

    async def warm_up() -> None:
        service.warm_up()

    server_config = GrpcServerConfig(
        host=config.host, port=config.port, max_message_bytes=config.max_message_bytes, grace_s=config.grace_s,
        metrics_port=config.metrics_port, stage_secret=guarding_secret(config.stage_secret_file, "tokenizer"),
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


def start(config: TokenizerServiceConfig) -> int:
    """`qwen-serve serve tokenizer` from its parsed and checked config (the CLI did both, before importing this
    module) to the stage's exit code."""
    return run_checked("tokenizer", config, run, startup_errors=(OSError, ValueError, TokenizerError))


def main(argv: list[str] | None = None) -> int:
    """`python -m qwenserve_services.tokenizer.server [flags]`: parse, check, start."""
    config = checked("tokenizer", parse_config(argv_or_sys(argv)), check)
    return 1 if config is None else start(config)


if __name__ == "__main__":
    sys.exit(main())
