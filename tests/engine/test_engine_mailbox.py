"""LoopMailbox: results posted from another thread reach the loop in order, with one wake-up per batch."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable

from qwenserve.engine.engine import LLMEngine
from qwenserve.engine.mailbox import LoopMailbox
from qwenserve.engine.outputs import RequestOutput
from qwenserve.engine.sampling_params import SamplingParams


def test_a_batch_posted_from_another_thread_arrives_in_order_with_one_wake_up() -> None:
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        original = loop.call_soon_threadsafe

        def counting(*args: object) -> asyncio.Handle:
            nonlocal wakes
            wakes += 1
            return original(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        mailbox, got, done = LoopMailbox(loop), [], asyncio.Event()

        def receive(item: int) -> None:
            got.append(item)
            if item == 99:
                done.set()

        # The loop is blocked in this thread's join(): all 100 posts pile up behind the first wake-up.
        producer = threading.Thread(target=lambda: [mailbox.post(receive, i) for i in range(100)])
        producer.start()
        producer.join()
        await asyncio.wait_for(done.wait(), 5)
        mailbox.post(receive, 100)  # after a drain, the next post wakes the loop again
        await asyncio.sleep(0.01)
        return got, wakes

    got, wakes = asyncio.run(main())
    assert got == list(range(101))
    assert wakes == 2


def test_posting_to_a_closed_or_collected_loop_drops_quietly() -> None:
    loop = asyncio.new_event_loop()
    mailbox = LoopMailbox(loop)
    loop.close()
    mailbox.post(print, "never")  # no exception: the consumer is gone
    mailbox.post(print, "never")
    del loop
    gc.collect()
    mailbox.post(print, "never")


def test_the_engine_streams_every_token_through_its_mailbox(make_engine: Callable[..., LLMEngine]) -> None:
    """Concurrent requests on two loops in turn: each stream gets all its tokens and exactly one final output."""
    engine = make_engine("qwen3_gqa4")

    async def one(i: int) -> list[RequestOutput]:
        return [o async for o in engine.generate(f"mbox-{i}", [10 + i, 20, 30], SamplingParams(
            max_tokens=12, temperature=0.0, ignore_eos=True))]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*[one(i) for i in range(8)])

    for outs in asyncio.run(main()) + asyncio.run(main()):
        assert sum(len(o.new_token_ids) for o in outs) == 12
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
