"""The faults the chaos suite injects, as coroutines to await while a load runs."""

from __future__ import annotations

import asyncio
import signal

from tests.support.deployment import Deployment
from tests.support.redis_server import RedisServer


async def kill_and_restart(deployment: Deployment, name: str, down_s: float) -> None:
    """kill -9 the child `name`, leave it dead `down_s` seconds, start it again and wait until it serves."""
    process = deployment.cluster.child(name).process
    assert process is not None
    process.send_signal(signal.SIGKILL)
    await asyncio.to_thread(process.wait)
    await asyncio.sleep(down_s)
    deployment.respawn(name)  # on this (the main) thread: the child dies with the thread that started it
    await asyncio.to_thread(deployment.wait_serving, name)


async def stop_then_continue(deployment: Deployment, name: str, stopped_s: float) -> None:
    """SIGSTOP the child `name` (a hung process: connections open, nothing answered); SIGCONT after
    `stopped_s`."""
    process = deployment.cluster.child(name).process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(stopped_s)
    finally:
        process.send_signal(signal.SIGCONT)


async def redis_outage(redis: RedisServer, dead_s: float = 4.0, stopped_s: float = 6.0) -> None:
    """Redis killed, restarted after `dead_s`; two seconds later stopped for `stopped_s`, then continued."""
    redis.kill()
    await asyncio.sleep(dead_s)
    await asyncio.to_thread(redis.start)
    await asyncio.sleep(2.0)
    redis.pause()
    try:
        await asyncio.sleep(stopped_s)
    finally:
        redis.resume()
