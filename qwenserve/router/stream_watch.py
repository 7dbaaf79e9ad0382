"""A decode stream's watch: the router's bound on how long a worker may stay silent, and its drain deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from qwenserve.v1 import decode_pb2


class StreamStalled(Exception):
    """A decode stream sent nothing for stall_timeout_s."""


class StreamOutOfTime(Exception):
    """The request's deadline (or the router's drain deadline) came while waiting on a worker."""


class StreamWatch:
    """Reads a decode stream; cancels the call when it sends nothing for `stall_s` or the router's drain
    deadline comes, and then makes `read()` raise StreamStalled or StreamOutOfTime.

    One timer per stream, moved on only when it fires: noting a message is an assignment (an asyncio
    timeout around every read cost more than relaying the message). The request's own deadline is the
    call's gRPC deadline.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall, stall_s: float,
                 drain_deadline: Callable[[], float | None]) -> None:
        self._call = call
        self._stall_s = stall_s
        self._drain_deadline = drain_deadline
        self._last = time.monotonic()
        self._fired: type[Exception] | None = None
        self._timer = asyncio.get_running_loop().call_later(stall_s, self.check)

    async def read(self) -> decode_pb2.DecodeResponse:
        """The next message, or grpc.aio.EOF."""
        try:
            msg = await self._call.read()
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            # Our own cancel surfaces as CancelledError (or CANCELLED); a cancel of the task itself passes on.
            task = asyncio.current_task()
            ours = not isinstance(e, grpc.aio.AioRpcError) or e.code() == grpc.StatusCode.CANCELLED
            if self._fired is None or not ours or (task is not None and task.cancelling()):
                raise
            raise self._fired() from None
        self._last = time.monotonic()
        return msg

    def check(self) -> None:
        """Cancel the call if it is overdue, else look again when it would be (also when a drain starts)."""
        self._timer.cancel()
        due, why = self._last + self._stall_s, StreamStalled
        drain = self._drain_deadline()
        if drain is not None and drain < due:
            due, why = drain, StreamOutOfTime
        left = due - time.monotonic()
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self.check)
            return
        self._fired = why
        self._call.cancel()

    def close(self) -> None:
        self._timer.cancel()
