"""Engine settings: one dataclass, defaults that suit the device.

The fields declared with `option` are the engine stages' flags (`--kv-cache-gb`, `--max-model-len`, ...), each
with its `QWENSERVE_<FLAG>` environment fallback (`qwenserve.flags`, the one rule); torch is imported only where
a method needs it, so the stages' flags can be read without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qwenserve.engine.errors import MaxModelLenError
from qwenserve.engine.structured import GrammarLimits
from qwenserve.flags import option

if TYPE_CHECKING:
    import torch

# The names vLLM accepts for --dtype, mapped to ours; "auto" (None) is the device's default.
DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "half": "float16"}

#: A max_model_len derived from the model is at most this many tokens (Qwen3's 40960 positions give 32768).
DERIVED_MAX_MODEL_LEN_CAP = 32768


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs a model. `None` means "derive from the model and the device"."""

    device: str | None = option(None, help="cpu or cuda[:N] (default: cuda when available)")
    # "auto" on a CPU with the C kernels is fp32 math over bf16 weights and KV where a start-up probe finds them
    # faster (engine/precision.py); "float32" there is fp32 throughout, token-exact with transformers.
    dtype: str | None = option(None, choices=tuple(DTYPES),
                               help="weights and activations (default auto: on CPU fp32 activations with bf16 "
                                    "weights and KV cache where the C kernels load and a start-up probe finds them "
                                    "faster, else float32; bfloat16 on CUDA)")
    # Longest request (prompt + output tokens). Default: the model's max_position_embeddings (at most 32768),
    # lowered to what the KV cache holds; an explicit value that does not fit stops the engine (resolve_max_model_len).
    max_model_len: int | None = option(
        None, help="longest request, prompt + output tokens (default: the model's, lowered to what the KV cache "
                   "holds; one the KV cache cannot hold stops the start)")
    # Block size in tokens. Default 16 for the torch backend (finer prefix sharing) and 256 where
    # flash-attn's paged kernels run (their minimum page size).
    block_size: int | None = option(None, help="tokens per KV cache block (default: 16; 256 with flash-attn)")
    num_kv_blocks: int | None = None  # default: kv_cache_memory_gb worth of blocks
    kv_cache_memory_gb: float = option(4.0, flag="--kv-cache-gb", help="memory for the paged KV cache (and a hybrid model's linear-attention states), in GB")
    # A fresh page's first write waits for the kernel (and a VM's host) to back it: 12% of a 2k-token prefill.
    kv_prefault: bool = option(True, help="on CPU, fault the KV cache's pages in from an idle-priority thread after "
                                          "start (off: each page on its first write)")
    # Per-step token budget (prefill chunks + decodes); default: 2048 on CUDA and on a CPU that prefills on AMX tiles,
    # 512 on other CPUs (token_budget()).
    max_num_batched_tokens: int | None = option(
        None, help="per-step token budget (default: 2048 on CUDA and where a CPU prefills on AMX tiles, else 512)")
    # A step with no decode rows makes nobody wait, so its prompt chunks may be larger: each chunk re-reads every
    # weight and attends to the chunks before it, and a 2,000-token prompt in 512-token chunks took 1.3x as long.
    max_prefill_only_tokens: int | None = option(
        None, help="per-step token budget of a step with no decodes in it, prompt chunks only (default: 2048, or "
                   "--max-num-batched-tokens where that is set)")
    max_num_seqs: int = option(256, help="running sequences at once")
    enable_prefix_caching: bool = option(True, help="share the KV cache of common prompt prefixes")
    # Hybrid models' prefix caching: their linear-attention state is kept at these boundaries (state_snapshots.py).
    state_snapshot_tokens: int = option(
        256, help="hybrid models: with prefix caching, keep their linear-attention state every this many prompt "
                  "tokens (rounded up to whole KV blocks), where a cached prefix resumes; 0: prefix caching off "
                  "for them")
    # "short_first" protects the TTFT of short prompts in a burst (see scheduler.py); "fcfs" is plain order.
    admission_policy: str = option("short_first", choices=("short_first", "fcfs", "watermark"),
                                   help="which waiting request is admitted first (admission_policy.py)")
    # A waiting request older than this is admitted before any shorter one (no starvation).
    max_queue_delay_s: float = 2.0
    # short_first: while more prompt tokens wait than a step with decodes could take, up to this many
    # steps in a row run prefill alone (a burst clears without every step carrying the decodes).
    burst_prefill_steps: int = option(
        2, help="short_first: prefill-only steps in a row allowed while prompts queue up (0: never)")
    # ... and only while those steps together are expected to last no longer than this.
    burst_max_stall_s: float = 0.25
    # watermark: the window of recent request scores, its percentile, the per-second decay of a held request's
    # score, and how long an empty queue makes it forget the window.
    watermark_window: int = option(48, help="watermark policy: recent requests the watermark is taken from")
    watermark_percentile: float = option(90.0, help="watermark policy: the window's percentile that is the watermark")
    watermark_decay: float = option(0.95, help="watermark policy: a held request's score shrinks by this per second")
    watermark_reset_idle_s: float = option(3.0, help="watermark policy: an empty queue this long forgets the window")
    # A waiting request's priority improves by one level per this many seconds (low tiers never starve).
    priority_aging_s: float = option(5.0, help="seconds of waiting that raise a request's priority by one level")
    # Fraction of the pool kept free when admitting, so running requests can grow without preemption.
    admission_watermark: float = 0.01
    attention_backend: str = option("auto", choices=("auto", "torch", "flash_attn"),
                                    help="attention kernels (auto: flash-attn's where CUDA and flash-attn are)")
    # Which kernels run is decided once per engine from these (engine/kernels.py); off, the same tokens, slower.
    cpu_kernel: bool = option(True, help="run qwenserve's C kernels for what runs on the CPU, where they load "
                                         "(off: PyTorch's ops)")
    # The same kernels either way, equal bit for bit; off is for measuring what the per-layer calls cost.
    fused_decode: bool = option(True, help="a dense bf16 model on the C kernels: run a decode step's decoder layers "
                                           "in one C call (off: layer by layer)")
    # bf16 halves the weight bytes a CPU decode step streams (bench/kernels_bench.py); activations stay fp32.
    cpu_weight_dtype: str = option(
        "auto", choices=("auto", "float32", "bfloat16"),
        help="an fp32 model on CPU with the C kernels: the linear layers' packed weights in this dtype (bfloat16: "
             "rounded once at load, products still accumulate in fp32; auto: bfloat16 under --dtype auto where "
             "the start-up probe finds it faster, else float32)")
    # A 4-bit weight is a quarter of the bytes of a bf16 one that a memory-bound decode step streams.
    dequantize_weights: bool = option(
        False, help="a 4- or 8-bit checkpoint (AWQ, GPTQ, compressed-tensors) on CPU with the C kernels: dequantize its "
                    "linear weights to the model's dtype at load instead of keeping them as codes for the W4A16 / "
                    "W8A16 products (more memory; elsewhere they are always dequantized)")
    # A single stream's decode step reads the whole LM head: behind W4A16 layers, most of a small model's bytes.
    quantize_lm_head: str = option(
        "none", choices=("none", "int8"),
        help="on CPU with the C kernels: hold the LM head (and a tied embedding table) as 8-bit codes in groups of "
             "128, quantized at load: half of bf16's bytes per decode step, logits moved by the rounding (none: as "
             "the checkpoint has it)")
    # A batch-1 step reads the whole LM head; its 8-bit codes bound where the largest logits can be.
    screen_lm_head: bool = option(
        True, help="on CPU with the C kernels: hold the LM head's 8-bit codes beside it (half of a bf16 head's bytes "
                   "more memory) and, in steps of up to 4 rows whose every request is greedy or samples with a top_k "
                   "up to 64, with no penalties, logprobs or grammar, compute the full head only where the codes say "
                   "the largest logits can be: the same tokens from about half the bytes read")
    # A decode step reads the whole KV context: in bf16 it is half the bytes of fp32 (the model's math stays fp32).
    kv_cache_dtype: str = option(
        "auto", choices=("auto", "float32", "bfloat16"),
        help="the paged KV cache's dtype (auto: bfloat16 under --dtype auto on a CPU with the C kernels, except "
             "for hybrid models, else the model's; bfloat16 for an fp32 model: K/V rounded to nearest "
             "even as they are stored, widened to fp32 where attention reads them; half the KV memory and bytes "
             "read per decode step; prefill and decode workers must agree, or handoffs are refused)")
    # The field report's per-stage precision: prefill on the bf16 checkpoint (its prompt computed at full
    # precision), decode on the same model's 4-bit one (a quarter of the weight bytes each decode step streams).
    kv_from_other_weights: bool = option(
        False, help="accept handed-off KV computed by other weights of this same architecture (the same config, "
                    "tensor names and shapes: e.g. prefill workers serving the model's bf16 checkpoint in front of "
                    "this worker serving its AWQ/GPTQ one); off, only KV made by these very weights is used and "
                    "the rest is recomputed here")
    linear_attention_kernels: bool = option(
        True, help="hybrid models on CUDA: flash-linear-attention's and causal-conv1d's kernels where installed "
                   "and they pass their start-up check (off: PyTorch's forms)")
    num_threads: int | None = option(None, flag="--threads", help="torch threads on CPU (default: all cores)")
    seed: int = option(0, help="the sampling seed of requests that give none")
    # Structured output's bounds (structured.py GrammarLimits): a request beyond one is a 400 naming the flag. The
    # defaults are far above a real tool-use schema; what they stop is one request taking a worker's CPU or memory.
    max_grammar_chars: int = option(
        262144, help="structured output: longest JSON schema, regex, grammar or list of choices, in characters")
    max_grammar_choices: int = option(4096, help="structured output: most strings a choice constraint may list")
    grammar_compile_timeout_s: float = option(
        10.0, help="structured output: a constraint not compiled within this many seconds is refused")
    grammar_compile_memory_mb: int = option(
        1024, help="structured output: memory one constraint's compilation may take (its compile process is "
                   "stopped beyond it), in MiB; also the most its compiled form may hold")
    grammar_cache_mb: int = option(
        512, help="structured output: memory for compiled constraints kept for reuse, least recently used "
                  "dropped first, in MiB")
    grammar_compile_processes: int = option(
        2, help="structured output: processes compiling constraints at once (each started on first use)")
    grammar_mask_budget_ms: float = option(
        100.0, help="structured output: a request whose grammar takes longer than this to work out its allowed "
                    "tokens, on several steps in a row, is ended with an error (its batch goes on)")

    def grammar_limits(self) -> GrammarLimits:
        """The structured-output bounds these flags set."""
        return GrammarLimits(
            max_chars=self.max_grammar_chars, max_choices=self.max_grammar_choices,
            compile_timeout_s=self.grammar_compile_timeout_s, compile_memory_bytes=self.grammar_compile_memory_mb << 20,
            cache_bytes=self.grammar_cache_mb << 20, compile_processes=max(1, self.grammar_compile_processes),
            mask_budget_s=self.grammar_mask_budget_ms / 1000)

    def torch_device(self) -> torch.device:
        """The device to run on."""
        import torch

        if self.device:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def token_budget(self, prefill_on_tiles: bool = False) -> int:
        """Tokens per step. Every decode in the batch waits for the step's prefill chunk, so on a CPU, where a
        chunk is slow, the budget is smaller: a little throughput (weights are re-read per step) for short waits.
        Not where the CPU prefills a bf16 model on AMX tiles (`prefill_on_tiles`, engine/kernels.py): a 2,048-token
        chunk takes about 2 s there, as a 512-token one did in fp32, and 32 prompts at once ran 1.1-1.2x faster
        than in 512-token steps (fewer passes over the weights, and the batch starts decoding together); 2048 is
        also vLLM's CPU default."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return 2048 if prefill_on_tiles or self.torch_device().type == "cuda" else 512

    def prefill_only_budget(self, prefill_on_tiles: bool = False) -> int:
        """Tokens of a step with no decodes in it (see max_prefill_only_tokens); never below token_budget()."""
        if self.max_prefill_only_tokens:
            return max(self.max_prefill_only_tokens, self.token_budget(prefill_on_tiles))
        return self.max_num_batched_tokens or max(2048, self.token_budget(prefill_on_tiles))

    def torch_dtype(self) -> torch.dtype:
        """The model's dtype as configured: the named one, else fp32 on CPU and bf16 on CUDA. Under `--dtype auto` a
        CPU engine may still choose bf16 (engine/precision.py decides from this and a start-up probe)."""
        import torch

        from qwenserve.kv_layout import TORCH_DTYPES

        name = DTYPES.get(self.dtype, self.dtype) if self.dtype else None
        if name:
            try:
                return TORCH_DTYPES[name]
            except KeyError:
                raise ValueError(f"dtype {self.dtype!r} is not supported; use float32, bfloat16 or float16") from None
        return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """What the paged KV cache holds."""

    num_blocks: int
    block_size: int  # tokens per block
    bytes_per_block: int

    @property
    def tokens(self) -> int:
        """Tokens the whole cache holds: the most one request can have."""
        return self.num_blocks * self.block_size

    def gib_for(self, tokens: int) -> float:
        """KV memory (GiB, rounded up to 0.01) whose blocks hold one request of `tokens` tokens."""
        return math.ceil(math.ceil(tokens / self.block_size) * self.bytes_per_block / 2**30 * 100) / 100


def derived_max_model_len(max_positions: int) -> int:
    """max_model_len when none is given: the model's positions, at most DERIVED_MAX_MODEL_LEN_CAP."""
    return min(max_positions, DERIVED_MAX_MODEL_LEN_CAP)


def resolve_max_model_len(requested: int | None, max_positions: int, kv: KVCapacity) -> int:
    """The longest request (prompt + output tokens) the engine serves: one such request must fit in the KV cache,
    or a request the engine accepted could never be scheduled.

    An explicit `requested` beyond the model's positions or the cache raises MaxModelLenError (a setting the user
    chose is never changed behind their back, as vLLM refuses it). A derived one (derived_max_model_len) is lowered
    to what the cache holds; the caller says so with a warning.
    """
    if requested is None:
        return min(derived_max_model_len(max_positions), kv.tokens)
    if requested < 2:
        raise MaxModelLenError(f"max_model_len {requested} leaves no room for a prompt and an output token; use 2 or more")
    if requested > max_positions:
        raise MaxModelLenError(
            f"max_model_len {requested} is more than the model's {max_positions} positions "
            f"(max_position_embeddings in its config.json); lower --max-model-len to at most {max_positions}"
        )
    if requested > kv.tokens:
        raise MaxModelLenError(
            f"max_model_len {requested} does not fit in the KV cache, which holds {kv.tokens} tokens; "
            f"raise --kv-cache-gb to at least {kv.gib_for(requested):.2f} or lower --max-model-len to at most {kv.tokens}"
        )
    return requested
