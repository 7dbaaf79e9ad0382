"""A decode stream's watch: the router's bound on how long a worker may stay silent, and its drain deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from qwenserve.v1 import decode_pb2


class StreamStalled(Exception):
    """A decode stream sent nothing for stall_timeout_s, or its worker did not take the call in time."""


class StreamOutOfTime(Exception):
    """The request's deadline (or the router's drain deadline) came while waiting on a worker."""


class StreamWatch:
    """Reads a decode stream; cancels the call when it sends nothing for `stall_s`, when its worker has not taken
    it (its headers) within `accept_s` (None: no such bound), or when the router's drain deadline comes, and then
    makes `read()` and `accepted()` raise StreamStalled or StreamOutOfTime.

    One timer per stream, moved on only when it fires: noting a message is an assignment (an asyncio
    timeout around every read cost more than relaying the message). The request's own deadline is the
    call's gRPC deadline.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall, stall_s: float,
                 drain_deadline: Callable[[], float | None], accept_s: float | None = None) -> None:
        self._call = call
        self._stall_s = stall_s
        self._drain_deadline = drain_deadline
        self._last = time.monotonic()
        self._accept_s = accept_s
        self._accept_by = None if accept_s is None else self._last + accept_s
        self._fired: StreamStalled | StreamOutOfTime | None = None
        # A worker sends its headers when it takes the call (decode workers that announce it: at once).
        self._headers = asyncio.ensure_future(call.initial_metadata())
        self._headers.add_done_callback(self._took_call)
        self._timer = asyncio.get_running_loop().call_later(min(stall_s, accept_s or stall_s), self.check)

    async def read(self) -> decode_pb2.DecodeResponse:
        """The next message, or grpc.aio.EOF."""
        try:
            msg = await self._call.read()
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            self._raise_ours(e)
            raise
        self._last = time.monotonic()
        self._accept_by = None
        return msg

    async def accepted(self) -> None:
        """Wait until the worker has taken the call (its headers came); raises as `read()` does."""
        try:
            await asyncio.shield(self._headers)
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            self._raise_ours(e)
            raise
        if self._fired is not None:  # the call was cancelled by the watch, which ended the wait
            raise self._fired

    def _raise_ours(self, e: BaseException) -> None:
        """Raise what the watch fired for when `e` is its own cancel of the call (a cancel of the task passes on)."""
        # Our own cancel surfaces as CancelledError (or CANCELLED); a cancel of the task itself passes on.
        task = asyncio.current_task()
        ours = not isinstance(e, grpc.aio.AioRpcError) or e.code() == grpc.StatusCode.CANCELLED
        if self._fired is not None and ours and not (task is not None and task.cancelling()):
            raise self._fired from None

    def _took_call(self, headers: asyncio.Future[object]) -> None:
        if not headers.cancelled() and headers.exception() is None:
            self._accept_by = None

    def check(self) -> None:
        """Cancel the call if it is overdue, else look again when it would be (also when a drain starts)."""
        self._timer.cancel()
        due = self._last + self._stall_s
        fired: StreamStalled | StreamOutOfTime = StreamStalled(f"no message for {self._stall_s:g}s")
        if self._accept_by is not None and self._accept_by < due:
            due, fired = self._accept_by, StreamStalled(f"the worker did not take the call within {self._accept_s:g}s")
        drain = self._drain_deadline()
        if drain is not None and drain < due:
            due, fired = drain, StreamOutOfTime()
        left = due - time.monotonic()
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self.check)
            return
        self._fired = fired
        self._call.cancel()

    def close(self) -> None:
        self._timer.cancel()
        self._headers.cancel()
