"""Whatever GenerateRequest a gRPC client sends, the call ends within a bound with OK (exactly one final
message with a finish reason) or a client-error status, never UNKNOWN / INTERNAL / UNAVAILABLE; the
cluster serves and reports healthy afterwards.

No call here sets a gRPC deadline: a request without one must still end.
"""

from __future__ import annotations

import grpc
from hypothesis import example, given
from hypothesis import strategies as st

from qwenserve.rpc_errors import detail_of
from qwenserve.untrusted_input import MAX_MESSAGE_CHARS
from qwenserve.v1 import common_pb2, router_pb2
from tests.fuzz.client import (
    REQUEST_BOUND_S,
    FuzzClient,
    Tally,
    assert_still_serving,
    fuzz_settings,
    request_bound,
)
from tests.fuzz.strategies import (
    AUTH_GOOD,
    MODEL_NAME,
    generate_requests,
    grpc_authorized,
    grpc_generation_budget,
    grpc_metadata,
    grpc_refusal_reason,
    request_ids,
)
from tests.support.answers import Answer
from tests.support.deployment import Deployment

# The client's mistakes, and the limits it ran into.
CLIENT_ERRORS = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "NOT_FOUND",
                 "UNAUTHENTICATED", "PERMISSION_DENIED"}
GOOD_METADATA = (("authorization", AUTH_GOOD),)
SAMPLING_FIELDS = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name


def _request(**fields: object) -> router_pb2.GenerateRequest:
    """A normal request (a short prompt, four tokens) with `fields` changed."""
    request = router_pb2.GenerateRequest(prompt="hi")
    request.sampling.max_tokens = 4
    for name, value in fields.items():
        target = request.sampling if name in SAMPLING_FIELDS else request
        if isinstance(value, list):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return request


def check(answer: Answer, request: router_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...],
          bound_s: float, must_refuse: str | None = None) -> None:
    long_id = len(request.request_id) > 1000
    shown = f"request_id of {len(request.request_id)} chars" if long_id else str(request)[:800]
    what = f"\nrequest: {shown}\nmetadata: {metadata}\nanswer: {answer.describe()}"
    assert answer.ended, f"no terminal answer{what}"
    assert answer.elapsed_s < bound_s, f"took {answer.elapsed_s:.1f}s, more than {bound_s:.0f}s{what}"
    assert answer.status == "OK" or answer.status in CLIENT_ERRORS, f"status {answer.status}{what}"
    assert not answer.problems, f"broke the one-terminal-event rule{what}"
    if not grpc_authorized(metadata):
        assert answer.status == "UNAUTHENTICATED", f"a call without a valid key was not refused{what}"
    elif must_refuse:
        assert answer.status in CLIENT_ERRORS, f"not refused although {must_refuse}{what}"
    if answer.status == "OK":
        assert answer.succeeded, f"an accepted request did not finish normally{what}"


def test_any_generate_request_ends_with_ok_or_a_client_error(client: FuzzClient, serving: Deployment) -> None:
    tally = Tally()

    @fuzz_settings(ci_examples=100)
    @given(request=generate_requests(), metadata=grpc_metadata)
    # The reproducers, tried first on every run.
    @example(request=_request(min_tokens=2, stop_token_ids=[2**32 - 1]), metadata=GOOD_METADATA)
    @example(request=_request(temperature=float("inf")), metadata=GOOD_METADATA)
    @example(request=_request(repetition_penalty=float("inf")), metadata=GOOD_METADATA)
    @example(request=_request(model="no-such-model"), metadata=GOOD_METADATA)
    @example(request=_request(deadline_unix_ms=2**63 - 1), metadata=GOOD_METADATA)
    @example(request=router_pb2.GenerateRequest(prompt="no max_tokens: as much as fits"),
             metadata=GOOD_METADATA)
    def check_generate(request: router_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...]) -> None:
        bound = request_bound(grpc_generation_budget(request))
        answer = client.generate(request, metadata, bound)
        tally.add(answer, request)
        check(answer, request, metadata, bound, grpc_refusal_reason(request))

    check_generate()
    tally.check_reach()
    assert_still_serving(serving)


def test_any_request_id_is_served_or_refused_as_invalid_argument(
    client: FuzzClient, serving: Deployment
) -> None:
    @fuzz_settings(ci_examples=40)
    @given(request_id=request_ids)
    @example(request_id="id\nwith newline")
    @example(request_id="ünïcödé")
    @example(request_id="x" * 100_000)
    def check_request_id(request_id: str) -> None:
        request = _request(request_id=request_id)
        bound = request_bound(4)
        answer = client.generate(request, GOOD_METADATA, bound)
        check(answer, request, GOOD_METADATA, bound)
        assert answer.status in ("OK", "INVALID_ARGUMENT"), answer.describe()

    check_request_id()
    assert_still_serving(serving)


def test_list_models_and_get_status_need_a_valid_api_key(client: FuzzClient, serving: Deployment) -> None:
    @fuzz_settings(ci_examples=12)
    @given(metadata=grpc_metadata, method=st.sampled_from(["ListModels", "GetStatus"]))
    def check_key(metadata: tuple[tuple[str, str], ...], method: str) -> None:
        request = router_pb2.ListModelsRequest() if method == "ListModels" else router_pb2.GetStatusRequest()

        async def call() -> str:
            try:
                rpc = getattr(client.stub, method)
                reply = await rpc(request, metadata=metadata, timeout=REQUEST_BOUND_S)
            except grpc.aio.AioRpcError as e:
                return e.code().name
            if method == "ListModels":
                assert [m.id for m in reply.models] == [MODEL_NAME]
            return "OK"

        status = client.run(call())
        expected = "OK" if grpc_authorized(metadata) else "UNAUTHENTICATED"
        assert status == expected, f"{method} with metadata {metadata} answered {status}"

    check_key()
    assert_still_serving(serving)


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _chat(**fields: object) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(chat=common_pb2.ChatInput(
        messages=[common_pb2.ChatMessage(role="user", content="hi")], add_generation_prompt=True, **fields))
    request.sampling.max_tokens = 4
    return request


def _json_field_cases() -> dict[str, router_pb2.GenerateRequest]:
    """The issue's gRPC reproducers: a lone surrogate in tools_json (was UNAVAILABLE, marked retryable), *_json
    nested 100,000 deep (UNKNOWN / UNAVAILABLE from a RecursionError), a megabyte model name (its echo overflowed
    the status metadata: RESOURCE_EXHAUSTED)."""
    tool_call = _chat()
    tool_call.chat.messages.add(role="assistant", tool_calls_json=[_nested(100_000)])
    schema = _request()
    schema.sampling.structured.json_schema = _nested(100_000)  # too large to parse at the router, not to measure
    return {
        "tools_json with a lone surrogate": _chat(tools_json=['{"type": "function", "function": {"name": "\\ud800"}}']),
        "tools_json nested 100k deep": _chat(tools_json=[_nested(100_000)]),
        "chat_template_kwargs_json nested 100k deep": _chat(chat_template_kwargs_json=_nested(100_000)),
        "tool_calls_json nested 100k deep": tool_call,
        "json_schema nested 100k deep": schema,
        "a 1 MB model name": _request(model="m" * (1 << 20)),
    }


def test_json_fields_past_the_limits_and_huge_names_are_invalid_argument_never_retryable(
    client: FuzzClient, serving: Deployment
) -> None:
    async def refusal(request: router_pb2.GenerateRequest) -> grpc.aio.AioRpcError | None:
        try:
            async for _ in client.stub.Generate(request, metadata=GOOD_METADATA, timeout=REQUEST_BOUND_S):
                pass
        except grpc.aio.AioRpcError as e:
            return e
        return None

    for case, request in _json_field_cases().items():
        error = client.run(refusal(request))
        assert error is not None, f"{case}: served"
        detail = detail_of(error)
        shown = f"{case}: {error.code().name} {(error.details() or '')[:300]}"
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and detail is not None, shown
        assert not detail.retryable and len(detail.message) <= MAX_MESSAGE_CHARS, shown
        assert sum(len(k) + len(v) for k, v in error.trailing_metadata() or ()) < 8192, shown
    assert_still_serving(serving)
