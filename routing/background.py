"""BackgroundLoop: one coroutine of an object's, run as a task from `start()` until `aclose()`; and
`cancel_swallowed`, for the request path's awaits on Redis."""
from __future__ import annotations

import asyncio


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


def cancel_swallowed() -> bool:
    """Whether the current task was asked to stop though no CancelledError reached its caller: redis-py's
    asyncio client (8.1 measured: a task cancelled in a loop of script calls ran on after 15 of 20 cancels, of
    PINGs 12) can swallow one mid-call and answer. A request whose client left must not go on: check this after
    each such call on the request path and raise CancelledError (after giving back what the call took)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
