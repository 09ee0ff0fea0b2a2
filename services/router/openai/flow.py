"""What the HTTP front holds for a client that reads slowly or not at all, and when it gives up.

A streamed answer waits for its client: the connection's socket gets a send buffer of
`router.http_stream_buffer_bytes` and the transport pauses at as much again, and each write
waits (aiohttp drains past 64 KiB written), so a client that stops reading stops the relay,
which stops reading its worker stream. A write that has waited `router.http_stalled_client_s`
means the client read nothing for that long: the connection is dropped and the request
cancelled, which frees its worker slot. A body slower than `router.http_body_timeout_s` is
408 (`BodyTimeout`). `FlowStats` counts what streams hold and how many stalled, for metrics.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios

from aiohttp import web
from opentelemetry.metrics import Observation

from services.router.openai.errors import HttpRefusal

log = logging.getLogger(__name__)

# aiohttp's StreamWriter drains once this much was written since its last drain: what a
# stream may add to the transport's buffer beyond its high-water mark.
AIOHTTP_WRITE_CHUNK = 64 << 10


class BodyTimeout(HttpRefusal):
    """The request's body did not arrive within router.http_body_timeout_s."""

    status = 408
    code = "body_timeout"


class ClientStalled(Exception):
    """The client read nothing for the stall limit: its stream is dropped and cancelled."""


def held_bound(buffer_bytes: int) -> int:
    """The most one stream holds for its client: the socket's send buffer (the kernel
    doubles what is asked for its own bookkeeping), the transport's, and one aiohttp chunk."""
    return 2 * buffer_bytes + buffer_bytes + AIOHTTP_WRITE_CHUNK


def _unsent(transport: asyncio.BaseTransport) -> int:
    """Bytes of the connection in the kernel's send queue (Linux's SIOCOUTQ); 0 elsewhere."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


class FlowStats:
    """The streams open to HTTP clients, what they hold and how many stalled."""

    def __init__(self) -> None:
        self._transports: set[asyncio.BaseTransport] = set()
        self.stalled = 0

    def add(self, transport: asyncio.BaseTransport) -> None:
        self._transports.add(transport)

    def discard(self, transport: asyncio.BaseTransport) -> None:
        self._transports.discard(transport)

    def buffered_bytes(self) -> int:
        """Bytes written for the open streams' clients and not yet sent: in the router and in
        the kernel's send queues. Safe from a scrape thread (it only reads sizes)."""
        total = 0
        for transport in list(self._transports):
            if transport.is_closing():
                continue
            total += transport.get_write_buffer_size() + _unsent(transport)
        return total

    def register(self, meter) -> None:
        def buffered(_options):
            yield Observation(self.buffered_bytes())

        def stalled(_options):
            yield Observation(self.stalled)

        meter.create_observable_gauge(
            "ballast_http_stream_buffered_bytes",
            callbacks=[buffered],
            description="Bytes of streamed HTTP answers written and not yet sent to their clients.",
        )
        meter.create_observable_counter(
            "ballast_http_stalled_clients",
            callbacks=[stalled],
            description="HTTP streams cancelled because their client read nothing for router.http_stalled_client_s.",
        )


class StreamFlow:
    """The flow control of one streamed answer: `attach` once the response is prepared,
    `write` each event, `detach` at the end (in a finally)."""

    def __init__(self, request: web.Request, stats: FlowStats, stalled_s: float, buffer_bytes: int) -> None:
        self._request = request
        self._stats = stats
        self._stalled_s = stalled_s
        self._buffer_bytes = buffer_bytes
        self._transport: asyncio.BaseTransport | None = None

    def attach(self) -> None:
        transport = self._request.transport
        if transport is None:
            return
        self._transport = transport
        # Without these the kernel alone takes megabytes (its buffers grow with the window)
        # for a client that never reads, and the worker goes on generating into them.
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._buffer_bytes)
            except OSError:
                pass
        transport.set_write_buffer_limits(high=self._buffer_bytes)
        self._stats.add(transport)

    async def write(self, response: web.StreamResponse, data: bytes) -> None:
        try:
            async with asyncio.timeout(self._stalled_s):
                await response.write(data)
        except TimeoutError:
            self._stats.stalled += 1
            log.info(
                "%s %s: the client read nothing for %gs; dropping its stream",
                self._request.method,
                self._request.path,
                self._stalled_s,
            )
            if self._transport is not None:
                # Abort, not close: a close would wait to send what the client does not read.
                self._transport.abort()
            raise ClientStalled(f"the client read nothing for {self._stalled_s:g}s") from None

    def detach(self) -> None:
        if self._transport is not None:
            self._stats.discard(self._transport)
            self._transport = None
