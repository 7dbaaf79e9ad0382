"""Whatever GenerateRequest a gRPC client sends, the call ends within a bound with OK (exactly one final
message with a finish reason) or a client-error status, never UNKNOWN / INTERNAL / UNAVAILABLE; the
cluster serves and reports healthy afterwards.

No call here sets a gRPC deadline: a request without one must still end.
"""

from __future__ import annotations

import grpc
from hypothesis import example, given
from hypothesis import strategies as st

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

    @fuzz_settings(ci_examples=150)
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
