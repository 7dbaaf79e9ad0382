"""A request the router has checked and tokenized: what every stage call and the fronts' answers are made
from (`Router.prepare()` makes it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.handoff_binding import new_handoff_token
from qwenserve.router.chat_output import ChatShape
from qwenserve.router.request_ids import internal_id
from qwenserve.tenancy.content_filter import ContentFilter
from qwenserve.v1 import common_pb2


@dataclass(slots=True)
class PreparedRequest:
    """A validated request: exact prompt ids and engine sampling settings."""

    request_id: str  # the client's: echoed in every answer
    prompt_ids: list[int]
    sampling: SamplingParams
    wire_sampling: common_pb2.SamplingParams
    stop: list[str]
    skip_special_tokens: bool
    cache_salt: str
    deadline: float | None  # time.monotonic() deadline
    echo_prompt: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when prepare() began, for the queue-time metric
    internal_id: str = ""  # what the stages know it by (unique even when client ids repeat); made if empty
    chat: ChatShape | None = None  # a chat answer: how its text is split (None: text as generated)
    content_filter: ContentFilter | None = None  # the tenant's words that must never be sent (the fronts set it)
    priority: int = 0  # the tenant's tier: lower is admitted first by the engines (the gatekeeper sets it)
    # The secret its KV handoff is bound to: only prefill and the decode worker it goes to learn it.
    handoff_token: str = field(default_factory=new_handoff_token, repr=False)

    def __post_init__(self) -> None:
        if not self.internal_id:
            self.internal_id = internal_id(self.request_id)
