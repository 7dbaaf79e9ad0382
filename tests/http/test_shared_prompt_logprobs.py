"""`n` answers to one prompt with prompt_logprobs: the workers compute the prompt's logprobs once, for the first
answer, and every answer shows them, streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from qwenserve.engine.sampling_params import SamplingParams
from qwenserve.router.openai_answer import Answer, Generations
from qwenserve.router.openai_request import parse_completion
from qwenserve.router.prepared_request import PreparedRequest
from qwenserve.v1 import common_pb2, router_pb2

PROMPTS = [[11, 12, 13, 14], [21, 22, 23]]


def _prompt_logprobs(ids: list[int]) -> list[common_pb2.TokenLogprob]:
    """What a worker would compute for `ids`: one entry per position after the first, a function of the prompt."""
    return [common_pb2.TokenLogprob(token_id=t, logprob=-0.1 * t, rank=1) for t in ids[1:]]


class FakeWorkers:
    """Answers each generation with two tokens; prompt logprobs on the first message, when asked for them."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    async def run(self, prep: PreparedRequest) -> AsyncIterator[router_pb2.GenerateResponse]:
        asks = prep.wire_sampling.HasField("prompt_logprobs")
        self.asked.append(asks)
        # A copy that computes nothing must still wait for the one that does, however late that one is.
        await asyncio.sleep(0 if not asks else 0.05)
        first = router_pb2.GenerateResponse(request_id=prep.request_id, token_ids=[7], text="a")
        if asks:
            first.prompt_logprobs.extend(_prompt_logprobs(prep.prompt_ids))
        yield first
        yield router_pb2.GenerateResponse(request_id=prep.request_id, token_ids=[8], text="b",
                                          finish_reason=common_pb2.FINISH_REASON_LENGTH)


def _answer(n: int) -> Answer:
    parsed = parse_completion({"prompt": PROMPTS, "n": n, "max_tokens": 2, "prompt_logprobs": 1})
    preps = [PreparedRequest(f"req-{p}", ids, SamplingParams(max_tokens=2, prompt_logprobs=1),
                             parsed.prompts[p].sampling, [], True, "", None) for p, ids in enumerate(PROMPTS)]
    return Answer(parsed, "cmpl-1", "m", preps, lambda t: b"x")


async def _run(n: int) -> tuple[Answer, FakeWorkers, list[int]]:
    answer, workers = _answer(n), FakeWorkers()
    generations = Generations(workers.run, answer.runs(), None, answer.prompt_logprob_lenders())
    with_logprobs = []  # the choices whose streamed chunk would carry them
    async for index, msg in generations.events():
        answer.choices[index].add(msg)
        if answer.choices[index].delta(msg).get("prompt_logprobs"):
            with_logprobs.append(index)
    return answer, workers, with_logprobs


def test_n_copies_ask_the_workers_for_prompt_logprobs_once_per_prompt_and_all_show_them() -> None:
    single, _, _ = asyncio.run(_run(1))
    answer, workers, streamed = asyncio.run(_run(4))
    assert workers.asked.count(True) == len(PROMPTS) and len(workers.asked) == 4 * len(PROMPTS)
    assert sorted(streamed) == list(range(4 * len(PROMPTS)))  # each choice's first chunk, as with n=1
    for choice in answer.choices:
        alone = single.choices[choice.prompt_index]
        assert choice.full()["prompt_logprobs"] == alone.full()["prompt_logprobs"]
        assert len(choice.full()["prompt_logprobs"]) == len(PROMPTS[choice.prompt_index])


def test_without_prompt_logprobs_no_copy_waits_for_another() -> None:
    parsed = parse_completion({"prompt": "x", "n": 3, "max_tokens": 2})
    prep = PreparedRequest("r", [1, 2], SamplingParams(max_tokens=2), parsed.prompts[0].sampling, [], True, "", None)
    assert Answer(parsed, "cmpl-2", "m", [prep], None).prompt_logprob_lenders() == {}
