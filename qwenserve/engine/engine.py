"""LLMEngine: the async front of the engine and the compute loop behind it.

The loop runs on its own thread: it drains a command queue (add / abort / stop) and runs one step after another
(step.py: schedule, compute, sample), which push each request's outputs back to that request's consumer (an
asyncio queue on the caller's event loop, or a plain queue for `generate_sync`). Nothing on the event loop ever
waits for a forward pass. Requests are checked before they are queued (intake.py).

Faults: whatever fails while computing, sampling or finishing one request ends that request with
finish_reason "error"; the others go on. Should the loop itself fail (its scheduler's state is beyond
repair), the engine dies loudly instead of hanging: every request in flight ends with an error, new
ones raise EngineDeadError, and `on_failure` callbacks tell the process to stop serving and exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from qwenserve.engine.admission_policy import WatermarkSettings
from qwenserve.engine.block_pool import BlockPool
from qwenserve.engine.config import EngineConfig, KVCapacity, derived_max_model_len, resolve_max_model_len
from qwenserve.engine.errors import DuplicateRequestError, EngineDeadError, EngineShutdownError
from qwenserve.engine.grammar import GrammarBackend
from qwenserve.engine.host_memory import Prefault, cpus_idle, keep_freed_memory
from qwenserve.engine.intake import RequestIntake
from qwenserve.engine.kernels import select_kernels
from qwenserve.engine.kv_handoff import KVExportSink, KVImport
from qwenserve.engine.mailbox import LoopMailbox
from qwenserve.engine.model_runner import ModelRunner
from qwenserve.engine.outputs import EngineStats, RequestOutput
from qwenserve.engine.sampler import Sampler
from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.engine.scheduler import Scheduler, SchedulerLimits
from qwenserve.engine.sequence import Sequence, SequenceStatus
from qwenserve.engine.state_pool import StatePool, linear_state_layout
from qwenserve.engine.state_snapshots import StateSnapshots
from qwenserve.engine.step import EngineStep, StepObserver
from qwenserve.engine.structured import GrammarLimitExceeded
from qwenserve.engine.weights import architecture_fingerprint, embedded_by_codes, load_checkpoint
from qwenserve.kv_layout import KVLayout
from qwenserve.models import ModelConfig, linear_attention_gpu, model_class
from qwenserve.models.linear_state import LinearStateCache

log = logging.getLogger("qwenserve.engine")

_STOP = object()
# Snapshots of a hybrid model's linear-attention state, at most (a tiny model's are small enough for thousands).
MAX_STATE_SNAPSHOTS = 1024


class LLMEngine:
    """A Qwen model served with continuous batching on a paged KV cache. Thread-safe; `generate` may be
    called from many coroutines (and event loops) at once."""

    def __init__(self, model_cfg: ModelConfig, config: EngineConfig, checkpoint: str | Path) -> None:
        self.config = config
        self.model_config = model_cfg
        device = config.torch_device()
        if device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
            keep_freed_memory()
        # Chosen once for this engine, from its config, and handed down (engine/kernels.py).
        self.kernels = kernels = select_kernels(config, device, model_cfg)
        self.precision = precision = kernels.precision
        dtype, kv_dtype, block_size = precision.dtype, precision.kv_dtype, kernels.block_size
        log.info("precision: %s (%s)", precision.name, precision.reason)
        if model_cfg.is_hybrid and kv_dtype != dtype:
            # A hybrid model's handoff carries its convolution state in the layout's one dtype, the KV's.
            raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype}: a hybrid model ({model_cfg.model_type}) keeps "
                             f"its KV cache in the model's dtype ({dtype}); use --kv-cache-dtype auto")
        bytes_per_block = (
            len(model_cfg.kv_layers) * 2 * block_size * model_cfg.num_kv_heads * model_cfg.head_dim
            * torch.empty((), dtype=kv_dtype).element_size()
        )
        budget = config.kv_cache_memory_gb * 2**30
        num_state_slots = num_snapshots = 0
        if model_cfg.is_hybrid:
            # A hybrid model's linear-attention states come out of the same budget as its KV: a slot per sequence
            # that may run at once (--max-num-seqs), but at most half the budget, so a large model's default
            # max_num_seqs cannot allocate more than the operator gave; fewer slots then bound the running batch.
            per_slot = LinearStateCache.bytes_per_slot(model_cfg, dtype)
            num_state_slots = max(1, min(config.max_num_seqs, int(budget / 2 // per_slot)))
            budget -= num_state_slots * per_slot
            # Prefix caching keeps states at snapshot boundaries: at most a quarter of what is left, for the KV.
            if config.enable_prefix_caching and config.state_snapshot_tokens > 0:
                num_snapshots = min(MAX_STATE_SNAPSHOTS, int(budget / 4 // per_slot))
                budget -= num_snapshots * per_slot
        num_blocks = config.num_kv_blocks or max(1, int(budget // bytes_per_block))
        # Checked before the weights load: a max_model_len that cannot fit stops the start in a second, not a minute.
        self.max_model_len = self._fit_max_model_len(
            model_cfg.max_position_embeddings, KVCapacity(num_blocks, block_size, bytes_per_block)
        )
        self.eos_token_ids: list[int] = list(model_cfg.eos_token_ids)
        self.grammar = GrammarBackend(Path(checkpoint) / "tokenizer.json", model_cfg.vocab_size, self.eos_token_ids,
                                      kernels.cpu, config.grammar_limits())
        with torch.device(device):
            model = model_class(model_cfg)(model_cfg, dtype, self.max_model_len, kernels.ops)
        architecture = architecture_fingerprint(model_cfg, {n: tuple(t.shape) for n, t in
                                                            model.checkpoint_targets().items()})
        fingerprint = load_checkpoint(model, checkpoint, keep_codes=kernels.quantized is not None,
                                      pack_codes=kernels.pack_codes)
        model.eval()
        backend = kernels.attention
        self.runner = ModelRunner(model, backend, num_blocks, block_size, device, dtype, num_state_slots, kernels.cpu,
                                  kv_dtype)
        prefix_caching = config.enable_prefix_caching
        snapshots = None
        if model_cfg.is_hybrid and prefix_caching:
            snapshots = self._state_snapshots(model_cfg, num_snapshots, block_size, dtype, device)
            prefix_caching = snapshots is not None
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        self.states = StatePool(num_state_slots) if model_cfg.is_hybrid else None
        if self.runner.linear_state is not None:
            state_bytes = self.runner.linear_state.nbytes
            log.info("linear-attention state: %d slots of %.1f MiB (%.2f GiB of --kv-cache-gb; at most --max-num-seqs, "
                     "at most half the budget) for %d of %d layers, KV for the other %d%s", num_state_slots,
                     state_bytes / num_state_slots / 2**20, state_bytes / 2**30, len(model_cfg.linear_layers),
                     model_cfg.num_layers, len(model_cfg.kv_layers),
                     f"; at most {num_state_slots} sequences run at once" if num_state_slots < config.max_num_seqs
                     else "")
            if device.type == "cuda" and model.ops.gated_delta_prefills is not linear_attention_gpu.fla_gated_delta_prefills:
                log.warning("the delta rule runs in PyTorch's ops on CUDA, slower: flash-linear-attention is not "
                            "installed (`pip install fla-core`, in the gpu extra), is off (--no-linear-attention-kernels, "
                            "QWENSERVE_LINEAR_ATTENTION_KERNELS=0), or failed its start-up check (logged above)")
        self.scheduler = Scheduler(
            SchedulerLimits(
                max_num_batched_tokens=config.token_budget(kernels.prefill_on_tiles),
                max_prefill_only_tokens=config.prefill_only_budget(kernels.prefill_on_tiles),
                max_num_seqs=config.max_num_seqs,
                admission_policy=config.admission_policy,
                max_queue_delay_s=config.max_queue_delay_s,
                burst_prefill_steps=config.burst_prefill_steps,
                burst_max_stall_s=config.burst_max_stall_s,
                watermark_blocks=int(config.admission_watermark * num_blocks),
                priority_aging_s=config.priority_aging_s,
                watermark=WatermarkSettings(config.watermark_window, config.watermark_percentile,
                                            config.watermark_decay, config.watermark_reset_idle_s),
            ),
            self.pool,
            self.states,
            snapshots,
        )
        self._layout = KVLayout(
            dtype=str(kv_dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=len(model_cfg.kv_layers),
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            model_fingerprint=embedded_by_codes(fingerprint, model_cfg, precision.lm_head),
            **linear_state_layout(model_cfg),
            architecture_fingerprint=architecture,
            accepts_other_weights=config.kv_from_other_weights,
            weights=precision.labels()["weights"],
        )
        self.intake = RequestIntake(model_cfg.vocab_size, self.max_model_len, self.grammar, self._layout)
        self.step = EngineStep(self.scheduler, self.runner, Sampler(config.seed, self.grammar, self.kernels.cpu), self._layout,
                               self.eos_token_ids, self.max_model_len, self._finish)
        self._refusal_listener: Callable[[str], None] | None = None
        self._commands: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._active: dict[str, Sequence] = {}  # request id -> sequence, until its terminal output
        self._pending = 0  # submitted, not yet seen by the loop
        self._finished = 0
        # Steps the loop has begun, and when the one running now began: what says the engine is making progress.
        self.steps_completed = 0
        self._step_started: float | None = None
        self._closed = False
        self._failure: str | None = None  # why the compute loop died; None while it runs
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._idle = threading.Event()
        self._idle.set()
        # Only while nothing runs, here or beside it (`up`'s other engine): populating competes with a step for the
        # cores and the memory's bandwidth.
        self.kv_prefault = (Prefault(self.runner.kv_cache, block_dim=2, when=self._idle, machine_idle=cpus_idle)
                            if config.kv_prefault and device.type == "cpu" else None)
        # One per event loop that calls generate(): a step's outputs reach a loop with one wake-up.
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
            weakref.WeakKeyDictionary()
        )
        self._mailbox_lock = threading.Lock()
        log.info(
            "engine: %s on %s/%s, %s, block_size=%d, kv_blocks=%d (%.2f GiB), max_model_len=%d, token budget %d a "
            "step (%d without decodes), %s",
            model_cfg.model_type, device, self._layout.dtype, kernels.name, block_size, num_blocks,
            num_blocks * bytes_per_block / 2**30, self.max_model_len, self.scheduler.limits.max_num_batched_tokens,
            self.scheduler.limits.max_prefill_only_tokens, config,
        )
        self._thread = threading.Thread(target=self._loop, name="qwenserve-engine", daemon=True)
        self._thread.start()
        if kernels.cpu is not None:
            # This thread's OpenMP workers (loading and packing ran here) would otherwise stay beside the loop's own:
            # libgomp then counts more threads than cores and puts every worker to sleep at each region's end
            # (thread_pool.c).
            kernels.cpu.release_thread_pool()

    def _fit_max_model_len(self, max_positions: int, kv: KVCapacity) -> int:
        """This engine's max_model_len: one request of that length fits in its KV cache (resolve_max_model_len
        raises MaxModelLenError for an explicit one that does not); a derived one that had to shrink is logged."""
        limit = resolve_max_model_len(self.config.max_model_len, max_positions, kv)
        derived = derived_max_model_len(max_positions)
        if self.config.max_model_len is None and limit < derived:
            log.warning(
                "max_model_len lowered from %d to %d: the KV cache holds %d tokens; --kv-cache-gb %.2f or more "
                "serves %d (or set --max-model-len to choose)",
                derived, limit, kv.tokens, kv.gib_for(derived), derived,
            )
        return limit

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        """Load a Hugging Face checkpoint folder (config.json + safetensors) and start the compute loop."""
        return cls(ModelConfig.from_folder(path), config or EngineConfig(), path)

    # ---- public API -------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        cache_salt: str | None = None,
        resume_token_ids: Seq[int] = (),
        kv_import: KVImport | None = None,
        kv_export: KVExportSink | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request; the last has finished=True. Raises a RequestError subclass
        for an invalid request. Stopping the iteration early (or cancelling) aborts the request.

        resume_token_ids: tokens already generated elsewhere; they count as output (penalties, max_tokens,
        seed positions) and are not emitted again. kv_import: KV for the first tokens, computed elsewhere.
        kv_export: prefill-only; after the first token, the KV of every computed token is written into the
        tensor the sink returns and the request finishes with finish_reason "export". priority: lower is admitted
        first (a tenant's tier; admission_policy.py).
        Raises EngineDeadError, instead of a last output, when the compute loop dies meanwhile.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._mailbox_lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = LoopMailbox(loop)

        def emit(out: RequestOutput) -> None:
            mailbox.post(outputs.put_nowait, out)

        compiled = None
        if sampling.structured is not None:
            # Compiled off this loop and off the compute loop (grammar_compile.py): the request joins the
            # scheduler only once its grammar is ready, and a hostile one is refused without reaching it.
            self._check_open()
            try:
                compiled = await self.grammar.compile(sampling.structured)
            except GrammarLimitExceeded as exc:
                self._grammar_refused(exc)
                raise
        seq = self._new_sequence(
            request_id, prompt_token_ids, sampling, cache_salt=cache_salt, resume_token_ids=resume_token_ids,
            kv_import=kv_import, kv_export=kv_export, emit=emit, compiled_grammar=compiled,
        )
        seq.priority = priority
        self._submit(seq)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                if finished and out.finish_reason == "error" and self._failure is not None:
                    raise EngineDeadError(self._failure)
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def generate_sync(
        self,
        prompts: Seq[list[int]],
        sampling: SamplingParams | Seq[SamplingParams],
        **kwargs: object,
    ) -> list[list[int]]:
        """Run prompts to completion from a plain thread; returns the generated token ids of each."""
        results = self.generate_sync_outputs(prompts, sampling, **kwargs)
        return [[t for o in outs for t in o.new_token_ids] for outs in results]

    def generate_sync_outputs(
        self,
        prompts: Seq[list[int]],
        sampling: SamplingParams | Seq[SamplingParams],
        **kwargs: object,
    ) -> list[list[RequestOutput]]:
        """Like generate_sync, but returns every RequestOutput of each request (logprobs, usage...)."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        inbox: queue.Queue[RequestOutput] = queue.Queue()
        ids = [f"sync-{id(inbox)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self._submit(self._new_sequence(rid, list(prompt), p, emit=inbox.put, **kwargs))  # type: ignore[arg-type]
        collected: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        remaining = len(ids)
        while remaining:
            out = inbox.get()
            collected[out.request_id].append(out)
            remaining -= out.finished
        return [collected[rid] for rid in ids]

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks; its stream ends with finish_reason "abort".
        Unknown or already finished ids are ignored."""
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """A snapshot of load, KV usage and prefix-cache effectiveness."""
        s, pool = self.scheduler, self.pool
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting) + self._pending,
            kv_blocks_used=pool.num_used,
            kv_blocks_free=pool.num_free,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_cached=pool.num_cached_free,
            prefix_cache_hit_tokens=s.prefix_hit_tokens,
            prefix_cache_query_tokens=s.prefix_query_tokens,
            preemptions=s.num_preemptions,
            finished=self._finished,
            prefill_only_steps=s.num_prefill_only_steps,
            cpu_kernels=self.kernels.cpu is not None,
        )

    @property
    def failure(self) -> str | None:
        """Why the compute loop died, or None while it runs."""
        return self._failure

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once if the compute loop dies (on the engine's thread: hop to your own loop),
        or at once if it already has."""
        with self._lock:
            if self._failure is None:
                self._failure_callbacks.append(callback)
                return
        callback(self._failure)

    def step_running_s(self) -> float | None:
        """How long the step in progress has run (None between steps): on a busy CPU one step of a long prompt
        may take long, which is slow, not stuck."""
        started = self._step_started
        return None if started is None else time.monotonic() - started

    def holds(self, request_id: str) -> bool:
        """Whether the request is queued or running (its terminal output not yet produced)."""
        with self._lock:
            return request_id in self._active

    def observe_steps(self, observer: StepObserver | None) -> None:
        """Have `observer` told about every step from now on (None: no more); on the engine thread."""
        self.step.observer = observer

    def on_grammar_refusal(self, listener: Callable[[str], None] | None) -> None:
        """Have `listener` told, once per request a grammar bound ends, the flag that sets that bound
        (GrammarLimitExceeded.limit); on the engine thread or the caller's (a compile refused). None: no more."""
        self._refusal_listener = listener
        self.step.on_grammar_refusal = listener

    def _grammar_refused(self, exc: GrammarLimitExceeded) -> None:
        if self._refusal_listener is not None:
            self._refusal_listener(exc.limit)

    def _state_snapshots(self, model_cfg: ModelConfig, count: int, block_size: int, dtype: torch.dtype,
                         device: torch.device) -> StateSnapshots | None:
        """A hybrid model's prefix cache of linear-attention states (state_snapshots.py), or None (and why, logged)
        when --state-snapshot-tokens is 0 or the budget holds no snapshot: prefix caching is then off for it."""
        tokens = self.config.state_snapshot_tokens
        if tokens <= 0 or count == 0:
            log.info("prefix caching is off for %s: its linear-attention layers keep a state per sequence, not per "
                     "token, and %s", model_cfg.model_type,
                     "--state-snapshot-tokens 0 keeps no snapshot of it" if tokens <= 0
                     else "--kv-cache-gb leaves no room for a snapshot of it")
            return None
        interval = -(-tokens // block_size) * block_size
        storage = LinearStateCache.for_model(model_cfg, count, dtype, device)
        log.info("prefix caching for %s: its linear-attention state is kept every %d prompt tokens, in %d snapshots "
                 "of %.1f MiB (%.2f GiB of --kv-cache-gb), reused least recently used first", model_cfg.model_type,
                 interval, count, storage.nbytes / count / 2**20, storage.nbytes / 2**30)
        return StateSnapshots(storage, interval)

    def kv_layout(self) -> KVLayout:
        """How this engine's KV is shaped and which weights produced it (for export / import)."""
        return self._layout

    def wait_until_idle(self, timeout: float = 30.0) -> bool:
        """Block until no request is queued or running (tests, drains); False on timeout."""
        return self._idle.wait(timeout)

    def shutdown(self) -> None:
        """Abort everything in flight and stop the compute loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._commands.put(_STOP)
        if self.kv_prefault is not None:
            self.kv_prefault.stop()
        self._thread.join(timeout=60)
        self.grammar.close()

    # ---- request intake ---------------------------------------------------------------------------

    def _new_sequence(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, **kwargs: Any
    ) -> Sequence:
        self._check_open()  # a dead or closed engine says so before anything about the request
        try:
            return self.intake.sequence(request_id, prompt_token_ids, sampling, **kwargs)
        except GrammarLimitExceeded as exc:  # compiled here (generate_sync): the request ends before it is queued
            self._grammar_refused(exc)
            raise

    def _check_open(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")

    def _submit(self, seq: Sequence) -> None:
        with self._lock:
            self._check_open()
            if seq.request_id in self._active:
                raise DuplicateRequestError(f"request id {seq.request_id!r} is already in flight")
            self._active[seq.request_id] = seq
            self._pending += 1
            self._idle.clear()
        self._commands.put(("add", seq))

    # ---- compute loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    idle = not self.scheduler.has_work()
                    if idle and self.kernels.cpu is not None:
                        # An idle engine holds no OpenMP workers, so that another engine's in this process (a
                        # benchmark's, a test's) are not throttled by them; the next step starts its own again.
                        self.kernels.cpu.release_thread_pool()
                    if not self._drain_commands(block=idle):
                        break
                    if self.scheduler.has_work():
                        self._step_started = time.monotonic()
                        self.steps_completed += 1  # counted as the step starts: one that raises still moved
                        self.step()
                        self._step_started = None
                    if not self.scheduler.has_work() and self._pending == 0:
                        self._idle.set()
        except BaseException as exc:  # the loop cannot go on: fail every caller now rather than hang them
            self._die(exc)
            return
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, "abort")
        # Requests submitted while stopping never reached the scheduler; their streams still need an end.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd is not _STOP and cmd[0] == "add":  # type: ignore[index]
                self._finish(cmd[1], "abort")  # type: ignore[index]
        self._idle.set()

    def _die(self, exc: BaseException) -> None:
        reason = f"the engine's compute loop failed: {type(exc).__name__}: {exc}"
        log.critical("%s; failing every request in flight", reason, exc_info=exc)
        with self._lock:
            self._failure = reason
            stranded = list(self._active.values())
            self._active.clear()
            self._pending = 0
            callbacks, self._failure_callbacks = self._failure_callbacks, []
        # The scheduler's state is not to be trusted any more: end the streams without it.
        for seq in stranded:
            seq.status = SequenceStatus.FINISHED
            seq.emit(RequestOutput(seq.request_id, [], None, True, "error", seq.usage(), reason))
        self._idle.set()
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:  # one listener's bug must not keep the others from hearing of the failure
                log.exception("an engine failure callback raised")

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                return False
            kind, arg = cmd  # type: ignore[misc]
            if kind == "add":
                with self._lock:
                    self._pending -= 1
                self.scheduler.add(arg)
            elif kind == "abort":
                seq = self._active.get(arg)
                if seq is not None and seq.status is not SequenceStatus.FINISHED:
                    self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str, last: RequestOutput | None = None, error: str | None = None,
                request_fault: bool = False) -> None:
        if seq.status is SequenceStatus.FINISHED:
            return
        self.scheduler.finish(seq)
        with self._lock:
            self._active.pop(seq.request_id, None)
            self._finished += 1
        new_tokens = last.new_token_ids if last else []
        logprobs = last.logprobs if last else None
        seq.emit(RequestOutput(seq.request_id, new_tokens, logprobs, True, reason, seq.usage(), error,
                               prompt_logprobs=last.prompt_logprobs if last else None, request_fault=request_fault))
