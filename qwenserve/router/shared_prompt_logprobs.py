"""The `n` answers to one prompt share its prompt logprobs: only the first asks a worker for them.

Prompt logprobs are the model's raw distribution at each prompt position, the same for every answer to the
prompt; computing them costs the output layer over the whole vocabulary at every position and keeps the prompt
out of the prefix cache. So `copy_for_choice` drops `prompt_logprobs` from the other answers' requests, and
`SharedPromptLogprobs` puts the first answer's on each other answer's first message before it goes on: what
follows (chunks, bodies, echo) reads them there, as if that answer's worker had sent them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from qwenserve.v1 import common_pb2, router_pb2


class SharedPromptLogprobs:
    """Lends each computing choice's prompt logprobs to the choices that borrow them.

    `lenders` maps a borrowing choice's index to the index of the choice whose worker computes them. Create it
    on the event loop the generations run on.
    """

    def __init__(self, lenders: Mapping[int, int]) -> None:
        self._lender_of = dict(lenders)
        loop = asyncio.get_running_loop()
        self._computed: dict[int, asyncio.Future[list[common_pb2.TokenLogprob]]] = {
            lender: loop.create_future() for lender in set(self._lender_of.values())
        }

    def lend(self, index: int, msg: router_pb2.GenerateResponse) -> None:
        """Note a message of choice `index`: the router puts prompt logprobs on a generation's first message, so a
        lender's first message has all it will lend (none when it failed first: its borrowers go on without)."""
        computed = self._computed.get(index)
        if computed is not None and not computed.done():
            computed.set_result(list(msg.prompt_logprobs))

    def ended(self, index: int) -> None:
        """Choice `index` stopped (cancelled, or failed outside a message): nobody waits for it any longer."""
        computed = self._computed.get(index)
        if computed is not None and not computed.done():
            computed.set_result([])

    async def borrow(self, index: int, msg: router_pb2.GenerateResponse) -> None:
        """Before choice `index`'s first message goes on: give it its lender's prompt logprobs, waiting for them."""
        lender = self._lender_of.pop(index, None)
        if lender is None:
            return
        msg.prompt_logprobs.extend(await self._computed[lender])
