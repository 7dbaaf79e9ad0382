"""One step of the compute loop: plan it, compute it, sample it, and move each request on (or end it).

Faults stay as small as they can: a failed forward pass fails the requests of that step, a failed sample only
its rows, a failed export only its request. A fault outside a step (the scheduler's own state) is the loop's
(engine.py): it kills the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from qwenserve.engine.errors import RequestError
from qwenserve.engine.model_runner import ModelRunner
from qwenserve.engine.outputs import RequestOutput, TokenLogprob
from qwenserve.engine.sampler import Sampler, SamplingRow
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from qwenserve.engine.sequence import Sequence
from qwenserve.engine.structured import GrammarLimitExceeded
from qwenserve.kv_layout import KVLayout

log = logging.getLogger("qwenserve.engine")


class StepObserver(Protocol):
    """Told about every step, on the engine thread (so keep it cheap): how a stage measures the engine (step
    metrics, when a request first ran) without the engine knowing about Prometheus."""

    def on_scheduled(self, plan: SchedulerOutput) -> None:
        """A step was planned; its forward pass follows."""

    def on_step(self, scheduled: list[ScheduledSequence], seconds: float) -> None:
        """A step was computed, `seconds` after its planning began (its sampling follows, not included)."""


class Finish(Protocol):
    """Ends a request (frees its blocks, forgets it) and sends its last output: the engine's bookkeeping."""

    def __call__(self, seq: Sequence, reason: str, last: RequestOutput | None = None,
                 error: str | None = None, request_fault: bool = False) -> None: ...


class EngineStep:
    """Runs one step at a time on the engine thread. `sampler` may be replaced (tests inject faults there)."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        layout: KVLayout,
        eos_token_ids: list[int],
        max_model_len: int,
        finish: Finish,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.layout = layout
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.finish = finish
        self.observer: StepObserver | None = None
        # Told the flag of each request a grammar bound ends here (its mask cost), once per request.
        self.on_grammar_refusal: Callable[[str], None] | None = None

    def __call__(self) -> None:
        began = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.observer is not None:
            self.observer.on_scheduled(plan)
        if not plan.scheduled:
            # Only possible while the pool is briefly full of cached blocks being released; wait for news.
            time.sleep(0.001)
            return
        started = time.perf_counter()
        try:
            for seq in plan.imports:
                self.runner.import_kv(seq, seq.kv_import.kv, seq.num_computed_tokens)
                if seq.kv_import.state is not None:
                    self.runner.import_state(seq, seq.kv_import.state)
                seq.kv_import = None
            snapshots = self.scheduler.snapshots
            for seq in plan.restores:
                self.runner.import_state(seq, snapshots.restore(seq.restore_state))
                seq.restore_state = None
            logits, sampling = self.runner.execute(plan.scheduled)
        except Exception as exc:  # a failed step fails its requests, never the engine
            log.exception("engine step failed")
            for item in plan.scheduled:
                self.finish(item.seq, "error", error=f"{type(exc).__name__}: {exc}")
            return
        for slot, key in self.scheduler.on_step_computed(plan.scheduled):
            self.scheduler.snapshots.save(key, self.runner.linear_state.slot(slot))
        now = time.perf_counter()
        self.scheduler.observe_step(plan, now - started)
        if self.observer is not None:
            self.observer.on_step(plan.scheduled, now - began)
        if not sampling:
            return
        for item, token, lp in self._sample(logits, sampling):
            try:
                self._advance(item.seq, token, lp)
            except Exception as exc:  # this request's bookkeeping failed; the batch goes on
                log.exception("request %s: failed after sampling", item.seq.request_id)
                self.finish(item.seq, "error", error=f"{type(exc).__name__}: {exc}")

    def _sample(
        self, logits: torch.Tensor, items: list[ScheduledSequence]
    ) -> list[tuple[ScheduledSequence, int, TokenLogprob | None]]:
        """Sample every row at once; should that fail, row by row, so that only the rows at fault end (with an
        error) and the rest of the batch gets its tokens."""
        rows = [self._sampling_row(item.seq) for item in items]
        try:
            tokens, logprobs = self.sampler(logits, rows)
            return list(zip(items, tokens, logprobs, strict=True))
        except RequestError as exc:  # a request's grammar went past a bound: that request ends, no fault here
            log.info("a request's grammar refused a step (%s); sampling the batch's rows one at a time", exc)
        except Exception:
            log.exception("sampling a batch of %d rows failed; sampling its rows one at a time", len(rows))
        sampled = []
        for i, (item, row) in enumerate(zip(items, rows, strict=True)):
            try:
                tokens, logprobs = self.sampler(logits[i : i + 1], [row])
            except RequestError as exc:
                self.finish(item.seq, "error", error=str(exc), request_fault=True)
                if isinstance(exc, GrammarLimitExceeded) and self.on_grammar_refusal is not None:
                    self.on_grammar_refusal(exc.limit)
                continue
            except Exception as exc:
                self.finish(item.seq, "error", error=f"sampling failed: {type(exc).__name__}: {exc}")
                continue
            sampled.append((item, tokens[0], logprobs[0]))
        return sampled

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        return SamplingRow(
            params=seq.sampling,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            banned_token_ids=self._banned_until_min_tokens(seq.sampling),
            grammar=seq.grammar,
        )

    def _advance(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        """Append a sampled token and tell the request's consumer: a new token, or its last."""
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            raise RequestError(f"token {token} does not fit the request's grammar")
        reason = self._stop_reason(seq, token)
        if reason is None and seq.kv_export is not None:
            reason = self._export(seq)
        new = RequestOutput(seq.request_id, [token], [lp] if lp is not None else None, False, None, seq.usage(),
                            prompt_logprobs=seq.take_prompt_logprobs())
        if reason is None:
            seq.emit(new)
        else:
            self.finish(seq, reason, last=new)

    def _banned_until_min_tokens(self, p: SamplingParams) -> tuple[int, ...]:
        if not p.min_tokens:
            return ()
        return tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_token_ids))

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _export(self, seq: Sequence) -> str:
        num_tokens = seq.num_computed_tokens
        try:
            out = seq.kv_export(self.layout, num_tokens)
            self.runner.export_kv(seq, num_tokens, out)
        except Exception as exc:  # the sink belongs to the caller; its failure fails only this request
            log.exception("request %s: KV export failed", seq.request_id)
            seq.kv_export = None
            self.finish(seq, "error", error=f"KV export failed: {type(exc).__name__}: {exc}")
            return "error"
        return "export"
