"""One stream relayed to an HTTP client as server-sent events.

Both SSE endpoints (a streamed completion, a session's backfilled answers) relay the same way:
a pump task moves the source's items into a bounded queue (cancelling it cancels the source:
the request on its worker, the subscription on the backfill); while no item comes, `: keep-alive`
comments go out; the 200 is held back until the caller opens the response (or the first
keep-alive), so a refusal before it keeps its own status; after it, an error is a
`data: {"error"}` event, and every stream ends with `data: [DONE]`. Writes go through the
stream's `flow.StreamFlow`: they wait for a slow client, and one that reads nothing for too
long gets its stream dropped (`ClientStalled`), which cancels the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Iterable

from aiohttp import web

from services.common.errors import BallastError
from services.router.openai.errors import error_reply
from services.router.openai.flow import StreamFlow

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def sse_event(value: dict) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


def error_response(error: BaseException) -> web.Response:
    reply = error_reply(error)
    return web.json_response(reply.body, status=reply.status, headers=reply.headers)


@dataclass(frozen=True)
class _End:
    error: BaseException | None = None


class SseRelay:
    """Relays `source` to the client of `request`; `on_open(response)` writes whatever goes
    first once the 200 is sent. Use `next()` until it returns None, then `finish()`; always
    `close()` (in a finally)."""

    def __init__(
        self,
        request: web.Request,
        source: AsyncIterator,
        keepalive_s: float,
        buffer: int,
        on_open: Callable[[web.StreamResponse], Awaitable[None]] | None = None,
        name: str = "sse",
        flow: StreamFlow | None = None,
    ) -> None:
        self._request = request
        self._flow = flow
        self._keepalive_s = keepalive_s
        self._on_open = on_open
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=buffer)
        self._pump = asyncio.create_task(_pump(source, self._queue), name=name)
        self.response: web.StreamResponse | None = None
        self.error: BaseException | None = None

    async def next(self):
        """The source's next item, or None at its end (then `error` says how it ended)."""
        while True:
            try:
                item = await asyncio.wait_for(self._queue.get(), self._keepalive_s)
            except TimeoutError:
                await self.write(KEEPALIVE)
                continue
            if isinstance(item, _End):
                self.error = item.error
                return None
            return item

    async def open(self) -> web.StreamResponse:
        """Sends the 200 and SSE headers (once): from here on, errors are events."""
        if self.response is None:
            self.response = web.StreamResponse(headers=SSE_HEADERS)
            await self.response.prepare(self._request)
            if self._flow is not None:
                self._flow.attach()
            if self._on_open is not None:
                await self._on_open(self.response)
        return self.response

    async def write(self, data: bytes) -> None:
        """Writes to the client, waiting while it is slow; raises ClientStalled (the
        connection dropped) when it read nothing for the flow's stall limit."""
        response = self.response or await self.open()
        if self._flow is None:
            await response.write(data)
        else:
            await self._flow.write(response, data)

    async def finish(self, last: Iterable[dict] = ()) -> web.StreamResponse:
        """Ends the stream: on an error, its own status if nothing was sent yet, else an error
        event; otherwise the `last` events. Then `data: [DONE]`."""
        if self.error is not None:
            if self.response is None:
                return error_response(self.error)
            await self.write(sse_event(error_reply(self.error).body))
        else:
            for event in last:
                await self.write(sse_event(event))
        await self.write(DONE)
        await self.response.write_eof()
        return self.response

    async def close(self) -> None:
        """Stops the pump (and with it the source) if it still runs."""
        if self._flow is not None:
            self._flow.detach()
        if not self._pump.done():
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump


async def _pump(source: AsyncIterator, queue: asyncio.Queue) -> None:
    """Moves the source's items into `queue`, then an `_End` (with the error, if any).
    Cancelling it cancels the source."""
    try:
        async with contextlib.aclosing(source):
            async for item in source:
                await queue.put(item)
    except (BallastError, Exception) as error:
        if not isinstance(error, BallastError):
            log.exception("bug in a streamed request")
        await queue.put(_End(error))
        return
    await queue.put(_End())
