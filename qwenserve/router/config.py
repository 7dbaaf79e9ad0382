"""The router's configuration: where its workers are and how it treats requests (one value, read by the
router, its fleet of workers and the calls to them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RouterConfig:
    """Where the workers are and how the router treats requests."""

    tokenizer_address: str
    # Worker entries: a pod's ip:port, or a name:port (dns:///name:port) standing for every address it resolves to.
    prefill_addresses: list[str]
    decode_addresses: list[str]
    model_name: str = "qwen"
    # The longest request accepted, prompt + output tokens. start() lowers it to the smallest max_model_len the
    # engine workers report (GetInfo), as does a worker that reports later: what a worker would have to refuse
    # is refused here, before any work.
    max_model_len: int = 4096
    # Prompts shorter than this are prefilled on the decode worker itself (no handoff).
    local_prefill_threshold: int = 0
    prefill_attempts: int = 3
    # How long a worker's connection may take to become ready before another worker is tried.
    connect_timeout_s: float = 5.0
    # Default deadline of a tokenizer call (the client's deadline wins when it is sooner).
    rpc_timeout_s: float = 30.0
    # Default deadline of a prefill call, plus an allowance per prompt token: a long prompt on a CPU may
    # legitimately take minutes (10 tokens/s is far below any engine's prefill rate).
    prefill_timeout_s: float = 300.0
    prefill_timeout_per_token_s: float = 0.1
    # A decode stream that sends nothing for this long is failed over; a worker busy on the request's long
    # prompt sends empty heartbeats meanwhile (decode_worker.HEARTBEAT_S).
    stall_timeout_s: float = 30.0
    # Keepalive pings on every channel: a worker that does not answer one within the timeout is cut off.
    keepalive_s: float = 10.0
    keepalive_timeout_s: float = 10.0
    # How long start() waits for the other workers' limits once a decode worker has reported its own.
    worker_info_wait_s: float = 30.0
    # How often worker names are resolved again: a new pod gets traffic, a removed one drains, this soon.
    resolve_interval_s: float = 5.0
    # A request for a stage with no worker at all (scaled to zero) is held this long for one to appear (the
    # operator starts one when it sees the held count); 0: answered at once (no_decode_worker).
    cold_start_wait_s: float = 0.0
    # At most this many requests in flight per decode worker, counted from before prefill: more wait here
    # (first come, first served, at most max_queue_wait_s), so no stream stalls for a decode slot after its
    # first token (stream_slots.py). 0: no bound.
    max_streams_per_decode_worker: int = 0
    max_queue_wait_s: float = 60.0
    priority_aging_s: float = 5.0  # a waiting request's tier improves by one level per this many seconds
    # Chat answers: "qwen3" splits <think> blocks into reasoning ("none" leaves them in the text); "hermes"
    # parses <tool_call> blocks into tool calls when the request offers tools ("none" refuses tools).
    reasoning_parser: str = "qwen3"
    tool_call_parser: str = "hermes"
    # The vocabulary's <think> and </think> ids; None: the model has no thinking tokens (nothing is split).
    think_token_ids: tuple[int, int] | None = None
    # Sampling settings a request leaves out, from the model's generation_config.json (generation_defaults.py).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
