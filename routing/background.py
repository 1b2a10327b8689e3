"""BackgroundLoop: one coroutine of an object's, run as a task from `start()` until `aclose()`;
`follow_channel`, a Redis channel's messages to a callback, subscribed again after a failure; and
`cancel_swallowed`, for the request path's awaits on Redis."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from routing.state.resp import LeanRedis


class BackgroundLoop:
    """Subclasses define `_run()` (a loop that handles its own errors); `start()` is idempotent and
    `aclose()` cancels the task and waits for it."""

    _task: asyncio.Task | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass


async def follow_channel(client: Any, channel: str, on_message: Callable[[Any], None], *, retry_s: float,
                         subscribed: Callable[[], None], ended: Callable[[BaseException | None], None],
                         subscribe_timeout_s: float | None = None) -> None:
    """Until cancelled: subscribe to `channel` through `client` (an asyncio Redis client) and hand each message's
    data to `on_message`. `subscribed()` once the subscription stands; `ended(error)` once it is gone (what failed,
    or None when the stream just ended; not when cancelled), then the next subscription `retry_s` later. With
    `subscribe_timeout_s`, a subscription not answered within it fails. Through redis-py's pubsub, or a LeanRedis
    client's own (routing.state.resp: each message handed over as it is read)."""
    while True:
        error: BaseException | None = None
        try:
            if isinstance(client, LeanRedis):
                await client.subscribed(channel, on_message, confirmed=subscribed, timeout_s=subscribe_timeout_s)
            else:
                await _subscribed(client, channel, on_message, subscribed, subscribe_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - Redis gone or refusing: told, and subscribed again later
            error = e
        ended(error)
        await asyncio.sleep(retry_s)


async def _subscribed(client: Any, channel: str, on_message: Callable[[Any], None], confirmed: Callable[[], None],
                      timeout_s: float | None) -> None:
    """One subscription through redis-py's pubsub, until its stream ends (returns) or fails (raises)."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        subscribing = pubsub.subscribe(channel)
        await (subscribing if timeout_s is None else asyncio.wait_for(subscribing, timeout_s))
        confirmed()
        async for message in pubsub.listen():
            if message.get("type") == "message":
                on_message(message["data"])
    finally:
        try:
            await pubsub.aclose()
        except Exception:  # noqa: BLE001 - the connection is gone already
            pass


def cancel_swallowed() -> bool:
    """Whether the current task was asked to stop though no CancelledError reached its caller: redis-py's
    asyncio client (8.1 measured: a task cancelled in a loop of script calls ran on after 15 of 20 cancels, of
    PINGs 12) can swallow one mid-call and answer. A request whose client left must not go on: check this after
    each such call on the request path and raise CancelledError (after giving back what the call took)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
