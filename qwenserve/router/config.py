"""The router's configuration: where one model's workers are and how the router treats requests (one value,
read by the router, its fleet of workers and the calls to them).

The options (fields declared with `option`) are the router stage's flags and `QWENSERVE_<FLAG>` variables: the
stage's config nests this class (`qwenserve/stages/router.py`), and the stage sets the per-model fields (the
addresses, the name, the vocabulary's think ids, the sampling defaults) for each model it serves, from its own
flags or from --models-file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qwenserve.flags import option
from qwenserve.stage_secret import StageSecret


@dataclass(slots=True)
class RouterConfig:
    """Where the workers are and how the router treats requests."""

    # -- one model's wiring: not flags, set per model by the stage; repr=False keeps them out of the stage's
    # config line, where they would show empty --
    tokenizer_address: str = field(default="", repr=False)
    # Worker entries: a pod's ip:port, or a name:port (dns:///name:port) standing for every address it resolves to.
    prefill_addresses: list[str] = field(default_factory=list, repr=False)
    decode_addresses: list[str] = field(default_factory=list, repr=False)
    model_name: str = field(default="qwen", repr=False)
    # The vocabulary's <think> and </think> ids; None: the model has no thinking tokens (nothing is split).
    think_token_ids: tuple[int, int] | None = field(default=None, repr=False)
    # Sampling settings a request leaves out, from the model's generation_config.json (generation_defaults.py).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict, repr=False)
    # The deployment's stage secret (--stage-secret-file): every call to a stage proves the router is one of its own.
    stage_secret: StageSecret | None = field(default=None, repr=False)
    # The model has a fallback: a prefill's first token waits until a decode worker has taken the call (its headers),
    # so a request whose decode stage is stopped or gone goes to the fallback with nothing sent to the client yet.
    first_token_waits_for_decode: bool = field(default=False, repr=False)

    # -- options (flags) --
    # The longest request accepted, prompt + output tokens; None until the stage sets the checkpoint's context.
    # start() lowers it to the smallest max_model_len the engine workers report (GetInfo), as does a worker that
    # reports later: what a worker would have to refuse is refused here, before any work.
    max_model_len: int | None = option(
        None, help="longest request, prompt + output tokens, as the engines' --max-model-len (default: the model's)")
    local_prefill_threshold: int = option(
        0, help="prompts shorter than this many tokens are prefilled on the decode worker")
    connect_timeout_s: float = option(
        5.0, help="a worker whose connection is not ready within this many seconds is skipped")
    # A long prompt on a CPU may legitimately take minutes (10 tokens/s is far below any engine's prefill rate).
    prefill_timeout_s: float = option(
        300.0, help="deadline of one prefill call (plus 0.1 s a prompt token) when the request has none sooner")
    tokenizer_timeout_s: float = option(
        30.0, help="deadline of one tokenizer call (and of a worker's GetInfo) when the request has none sooner")
    # A worker busy on the request's long prompt sends empty heartbeats meanwhile (decode_worker.HEARTBEAT_S).
    stall_timeout_s: float = option(
        30.0, help="a decode stream silent this long (first token included) fails over to another worker")
    # Decode workers send a call's headers as soon as they take it (EngineInfo.sends_headers_on_accept), so this
    # bound is on the worker's event loop, not on a long prompt or a busy engine.
    accept_timeout_s: float = option(
        5.0, help="a decode worker that has not taken a call within this many seconds is taken for stopped: the "
                  "request fails over, or goes to the model's fallback")
    # A new pod gets traffic, a removed one drains, this soon.
    resolve_interval_s: float = option(
        5.0, help="how often --prefill / --decode names (a headless Service) are resolved again to their pods")
    # The operator starts a worker when it sees the held count; 0: answered at once (no_decode_worker).
    cold_start_wait_s: float = option(
        0.0, help="hold a request this long while the decode stage has no pod (scaled to zero) for one to start; "
                  "then 503 with Retry-After (0: at once)")
    # Counted from before prefill (stream_slots.py).
    max_streams_per_decode_worker: int = option(
        0, help="at most this many requests in flight per decode worker, counted before prefill; more wait here "
                "(tier priority, then arrival), so no stream stalls for a decode slot after its first token (0: no bound)")
    max_queue_wait_s: float = option(
        60.0, help="a request waiting longer than this for a decode stream slot gets 503 with Retry-After")
    priority_aging_s: float = option(
        5.0, help="requests waiting for a decode stream slot go by tier priority, one level better per this many "
                  "seconds waited, as in the engines")
    reasoning_parser: str = option(
        "qwen3", choices=("qwen3", "none"),
        help="chat answers: a <think> block goes to reasoning_content (none: it stays in the content)")
    tool_call_parser: str = option(
        "hermes", choices=("hermes", "none"),
        help="chat requests with tools: <tool_call> blocks become tool_calls (none: tools are refused)")

    # -- fixed settings (no flags) --
    prefill_attempts: int = 3
    prefill_timeout_per_token_s: float = 0.1  # added to prefill_timeout_s per prompt token
    # Keepalive pings on every channel: a worker that does not answer one within the timeout is cut off.
    keepalive_s: float = 10.0
    keepalive_timeout_s: float = 10.0
    # How long start() waits for the other workers' limits once a decode worker has reported its own.
    worker_info_wait_s: float = 30.0
