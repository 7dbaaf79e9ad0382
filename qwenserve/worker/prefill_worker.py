"""Prefill: run the prompt, sample the first token, export the prompt's KV into a handoff."""

from __future__ import annotations

import uuid
from typing import Any

from qwenserve.protocol import finish_reason_to_proto
from qwenserve.v1 import common_pb2, prefill_pb2
from qwenserve.worker.requests import checked_request


class PrefillWorker:
    """Owns nothing but references: the engine computes, the exporter holds the bytes under a lease."""

    def __init__(self, engine: Any, exporter: Any, lease_s: float = 30.0) -> None:
        self.engine = engine
        self.exporter = exporter
        self.lease_s = lease_s

    async def prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        """Raises BadRequest for invalid input; a cancelled caller aborts the engine request and the slot."""
        prompt, sampling = checked_request(
            request.prompt_token_ids, request.sampling,
            vocab_size=self.engine.model_config.vocab_size, max_model_len=self.engine.max_model_len,
        )
        request_id = request.request_id or f"prefill-{uuid.uuid4().hex[:12]}"
        handoff_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        slots: list[Any] = []

        def sink(layout: Any, num_tokens: int) -> Any:
            slot = self.exporter.reserve(handoff_id, layout, num_tokens)
            slots.append(slot)
            return slot.tensor

        first: list[int] = []
        logprobs: list[common_pb2.TokenLogprob] = []
        finish, cached = None, 0
        try:
            async for out in self.engine.generate(
                request_id, prompt, sampling, cache_salt=request.cache_salt or None, kv_export=sink
            ):
                first.extend(out.new_token_ids)
                logprobs.extend(_logprobs_to_proto(out))
                if out.finished:
                    finish = out.finish_reason
                    cached = out.usage.cached_prompt_tokens
        except BaseException:
            for slot in slots:
                slot.abort()
            raise
        response = prefill_pb2.PrefillResponse(
            request_id=request_id, first_token_id=first[0], cached_prompt_tokens=cached
        )
        if logprobs:
            response.first_logprob.CopyFrom(logprobs[0])
        if finish in ("stop", "length") or not slots:
            # The first token already ends the request: there is nothing for decode to continue.
            for slot in slots:
                slot.abort()
            response.finish_reason = finish_reason_to_proto(finish or "stop")
            return response
        response.kv_handle.CopyFrom(slots[0].publish(self.lease_s))
        return response


def _logprobs_to_proto(out: Any) -> list[common_pb2.TokenLogprob]:
    """The engine's per-token logprobs as wire messages (empty when not asked for)."""
    result = []
    for token_id, entry in zip(out.new_token_ids, out.logprobs or [], strict=False):
        msg = common_pb2.TokenLogprob(token_id=token_id, logprob=entry.logprob)
        for alt_id, alt_lp in entry.top:
            msg.top.add(token_id=alt_id, logprob=alt_lp)
        result.append(msg)
    return result
