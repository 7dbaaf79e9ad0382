"""Decode: import a handoff (or prefill locally), join the running batch, stream token ids."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from qwenserve.engine.errors import KVLayoutMismatchError
from qwenserve.engine.kv_layout import KVImport
from qwenserve.kv_transfer.errors import KVTransferError
from qwenserve.protocol import finish_reason_to_proto
from qwenserve.v1 import common_pb2, decode_pb2
from qwenserve.worker.errors import BadRequest, HandoffRefused
from qwenserve.worker.prefill_worker import _logprobs_to_proto
from qwenserve.worker.requests import checked_request


class DecodeWorker:
    """Streams one request's tokens; coalesces several steps into one message when the reader lags."""

    def __init__(self, engine: Any, importer: Any) -> None:
        self.engine = engine
        self.importer = importer

    async def decode(self, request: decode_pb2.DecodeRequest) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """Raises BadRequest / HandoffRefused before the first message; afterwards errors end the stream."""
        start = request.WhichOneof("start")
        if start is None:
            raise BadRequest("one of prefilled or local_prefill is required")
        resume = list(request.resume_token_ids)
        prompt, sampling = checked_request(
            request.prompt_token_ids, request.sampling, vocab_size=self.engine.model_config.vocab_size,
            max_model_len=self.engine.max_model_len, generated=len(resume) + (start == "prefilled"),
        )
        bad = next((i for i in resume if i >= self.engine.model_config.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"resume token id {bad} is outside the vocabulary")
        kv_import, handle = None, None
        cached = 0
        if start == "prefilled":
            handle = request.prefilled.kv_handle
            kv_import = await self._import(handle, len(prompt))
            resume = [request.prefilled.first_token_id]
            cached = request.prefilled.cached_prompt_tokens
        request_id = request.request_id or f"decode-{uuid.uuid4().hex[:12]}"
        outputs = self.engine.generate(
            request_id, prompt, sampling, cache_salt=request.cache_salt or None,
            resume_token_ids=resume, kv_import=kv_import,
        )
        if handle is not None:
            outputs = self._release_after_first(outputs, handle)
        async for msg in _coalesced(outputs, cached):
            yield msg

    async def _release_after_first(self, outputs: AsyncIterator[Any], handle: Any) -> AsyncIterator[Any]:
        """An shm import is a view of the exporter's memory: release it only once the engine has copied it
        into its own blocks, which has happened by the time the first output exists."""
        released = False
        try:
            async for out in outputs:
                if not released:
                    released = True
                    await self.importer.release(handle, "imported")
                yield out
        finally:
            if not released:
                # Not awaited: this may run while the task is being cancelled.
                asyncio.ensure_future(self.importer.release(handle, "cancelled"))

    async def _import(self, handle: Any, prompt_len: int) -> KVImport:
        if handle.num_tokens != prompt_len:
            raise HandoffRefused(f"the handoff holds {handle.num_tokens} tokens, the prompt has {prompt_len}")
        try:
            tensor = await self.importer.fetch(handle, self.engine.kv_layout())
        except (KVTransferError, KVLayoutMismatchError) as e:
            await self.importer.release(handle, "failed")
            raise HandoffRefused(str(e)) from e
        return KVImport(kv=tensor, layout=self.engine.kv_layout())


async def _coalesced(outputs: AsyncIterator[Any], cached_from_prefill: int) -> AsyncIterator[decode_pb2.DecodeResponse]:
    """Drain the engine into a buffer; each message carries everything produced since the last one."""
    pending: list[Any] = []
    ready = asyncio.Event()
    done: list[BaseException | None] = []

    async def pump() -> None:
        try:
            async for out in outputs:
                pending.append(out)
                ready.set()
            done.append(None)
        except BaseException as e:  # handed to the writer, which re-raises it in the servicer's task
            done.append(e)
        finally:
            ready.set()

    task = asyncio.create_task(pump())
    try:
        while True:
            await ready.wait()
            ready.clear()
            batch, pending[:] = list(pending), []
            if batch:
                msg = decode_pb2.DecodeResponse()
                for out in batch:
                    msg.token_ids.extend(out.new_token_ids)
                    msg.logprobs.extend(_logprobs_to_proto(out))
                last = batch[-1]
                if last.finished:
                    msg.finish_reason = finish_reason_to_proto(last.finish_reason)
                    usage = last.usage
                    msg.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=usage.prompt_tokens,
                        completion_tokens=usage.completion_tokens,
                        cached_prompt_tokens=max(usage.cached_prompt_tokens, cached_from_prefill),
                        total_tokens=usage.prompt_tokens + usage.completion_tokens,
                    ))
                    yield msg
                    return
                yield msg
            if done and not pending:
                if done[0] is not None:
                    raise done[0]
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await outputs.aclose()
