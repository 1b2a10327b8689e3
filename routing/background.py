"""BackgroundLoop: one coroutine of an object's, run as a task from `start()` until `aclose()`."""
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
