"""The flow of requests through a stream: the input feed its senders share and the gate that bounds them.

This module has no Airflow imports.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow_vllm_batch.serving.wire import RequestLine


class Gate:
    """A bound on requests in flight that can move while they are (a neighbourly stream's).

    Lowering it cancels nothing: the requests over it finish, and no sender starts another
    until the count is under it.

    :param limit: the first bound.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        """Wait until a request may start under the bound, and count it."""
        while self.active >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
        self.active += 1

    def release(self) -> None:
        """A request ended."""
        self.active -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        """Move the bound (the senders it lets start are woken)."""
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        room = self.limit - self.active
        while room > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1


class Feed:
    """The requests to send, read a chunk at a time in a worker thread, shared by the sender tasks.

    A sender takes the next request with :meth:`take` (no await, no per-request queue
    hand-off) and awaits :meth:`next` only when none is buffered. Reading is one task at a
    time, started ahead once fewer than a chunk is left, so the senders rarely wait; at
    most two chunks are read ahead of what is in flight (the input is read lazily).

    :param read: ``read(size)`` returns up to the next ``size`` requests (a list, possibly
        empty when every line was skipped or blank), or None at the end of the input; it
        runs in a worker thread so that a network-backed reader does not block the loop.
    :param chunk: lines per read.
    """

    def __init__(self, read: Callable[[int], list[RequestLine] | None], chunk: int) -> None:
        self._read = read
        self._chunk = chunk
        self._buffered: collections.deque[RequestLine] = collections.deque()
        self._reading: asyncio.Task[None] | None = None
        self._ended = False

    def take(self) -> RequestLine | None:
        """Return a buffered request, or None if there is none now (then await :meth:`next`)."""
        if not self._buffered:
            return None
        # Read ahead once a chunk is begun: with the senders all answered at once, waiting until
        # the buffer runs dry would park most of them on the read (measured: 0.8 waits per request).
        if len(self._buffered) < self._chunk and self._reading is None and not self._ended:
            self._reading = asyncio.create_task(self._read_ahead())
        return self._buffered.popleft()

    async def next(self) -> RequestLine | None:
        """Return the next request, reading more if needed, or None at the end of the input.

        :raises BadRequestLineError: a line read is not a request line (raised to every sender that waits).
        """
        while not self._buffered:
            if self._reading is None:
                if self._ended:
                    return None
                self._reading = asyncio.create_task(self._read_ahead())
            # Shielded: one sender cancelled while waiting must not cancel the read the others wait for.
            await asyncio.shield(self._reading)
        return self._buffered.popleft()

    async def _read_ahead(self) -> None:
        # On an error this task is left in place, done with it: every sender that waits for it raises it.
        chunk = await asyncio.to_thread(self._read, self._chunk)
        if chunk is None:
            self._ended = True
        else:
            self._buffered.extend(chunk)
        self._reading = None

    def close(self) -> None:
        """Cancel a read still under way (the run stopped); its thread finishes its chunk and is dropped."""
        if self._reading is None:
            return
        if self._reading.done():
            if not self._reading.cancelled():
                self._reading.exception()  # raised to a sender already, or moot: the run stopped for another error
        else:
            self._reading.cancel()


async def all_or_first_error(coroutines: list[Coroutine[Any, Any, None]]) -> None:
    """Run the coroutines as tasks; on the first error cancel the rest and raise it.

    ``asyncio.TaskGroup`` does this from Python 3.11; the provider supports 3.10.
    """
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
