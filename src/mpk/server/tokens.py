"""A RequestHandle's tokens on the event loop, and cancellation when the client goes away.

The handle's iterator blocks, so each request gets a small daemon thread that waits on it and
hands every token to the loop (call_soon_threadsafe). A thread of its own, not the loop's
default executor: that pool has a handful of workers, and a few dozen waiting streams would
starve everything else that uses it (the drain on SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mpk.engine.requests import RequestHandle, RequestResult

log = logging.getLogger(__name__)
_END = object()
Receive = Callable[[], Awaitable[dict[str, Any]]]


class TokenStream:
    """`async for token in TokenStream(handle)`: the tokens as the engine produces them; ends
    when the request finishes (handle.result() is then ready).

    on_token and on_finish run on the pump thread for every token and at the end, whether or
    not anyone still reads the stream (a disconnected client's request is counted too)."""

    def __init__(self, handle: RequestHandle, on_token: Callable[[], None] | None = None,
                 on_finish: Callable[[RequestResult], None] | None = None) -> None:
        self.handle = handle
        self._on_token = on_token
        self._on_finish = on_finish
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        threading.Thread(target=self._pump, name=f"mpk-{handle.id}", daemon=True).start()

    def _pump(self) -> None:
        for token in self.handle:
            self._put(token)
            self._call(self._on_token)
        self._call(self._on_finish, self.handle.result())
        self._put(_END)

    def _call(self, callback: Callable[..., None] | None, *args: object) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # bookkeeping (metrics) must never stop the stream
            log.exception("request %s: bookkeeping failed", self.handle.id)

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed (process exit): nobody is listening
            pass

    async def __aiter__(self) -> AsyncIterator[int]:
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            yield item  # type: ignore[misc]


class Disconnect:
    """Whether the client went away (set by cancel_on_disconnect)."""

    happened = False


@contextlib.asynccontextmanager
async def cancel_on_disconnect(receive: Receive,
                               handle: RequestHandle) -> AsyncIterator[Disconnect]:
    """While the body runs, a client disconnect cancels `handle` (its slot and KV pages are
    freed at the engine's next launch boundary), and so does leaving the body early."""
    disconnect = Disconnect()

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnect.happened = True
                handle.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield disconnect
    finally:
        watcher.cancel()
        if not handle.done:
            handle.cancel()
