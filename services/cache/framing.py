"""Framing of blocks on the KVCache streams (Put requests and Get replies alike).

Blocks travel as one byte stream cut into messages of at most `chunk_bytes`: each message
announces the blocks whose first byte it carries (their headers) and holds the next bytes,
back to back. Small blocks share a message and large ones span several, so the message
count follows the bytes moved, not the block count, and no message outgrows the limit.
`Packer` cuts; `Unpacker` reassembles and enforces the rules, raising InvalidArgument.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator, TypeVar

from services.common.errors import InvalidArgument

H = TypeVar("H")


class Packer:
    """Cuts blocks, added in order, into (headers, data) messages of `chunk_bytes` of data."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk = chunk_bytes
        self._headers: list = []
        self._parts: list[memoryview] = []
        self._filled = 0

    def add(self, header: H, payload) -> list[tuple[list[H], bytes]]:
        """Messages this block completes (the rest waits for more blocks or `finish`)."""
        self._headers.append(header)
        view = memoryview(payload).cast("B")
        full = []
        offset = 0
        while offset < len(view):
            take = min(len(view) - offset, self._chunk - self._filled)
            self._parts.append(view[offset : offset + take])
            self._filled += take
            offset += take
            if self._filled == self._chunk:
                full.append((self._headers, b"".join(self._parts)))
                self._headers, self._parts, self._filled = [], [], 0
        return full

    def finish(self) -> tuple[list[H], bytes] | None:
        if not self._headers and not self._parts:
            return None
        message = (self._headers, b"".join(self._parts))
        self._headers, self._parts, self._filled = [], [], 0
        return message


def pack(blocks: Iterable[tuple[H, memoryview]], chunk_bytes: int) -> Iterator[tuple[list[H], bytes]]:
    """(headers, data) messages for `blocks` given as (header, bytes) in order."""
    packer = Packer(chunk_bytes)
    for header, payload in blocks:
        yield from packer.add(header, payload)
    last = packer.finish()
    if last is not None:
        yield last


class Unpacker:
    """Reassembles whole blocks from (headers, data) messages. `size_of(header)` gives a
    block's byte count; a header must arrive with or before its block's first byte."""

    def __init__(self, size_of, max_blocks: int) -> None:
        self._size_of = size_of
        self._max_blocks = max_blocks
        self._announced: deque = deque()
        self._blocks = 0
        self._current = None
        self._buffer = bytearray()
        self._filled = 0

    def feed(self, headers: Iterable, data: bytes) -> list[tuple[object, bytearray]]:
        """Blocks completed by this message, each with its bytes."""
        for header in headers:
            self._blocks += 1
            if self._blocks > self._max_blocks:
                raise InvalidArgument(f"at most {self._max_blocks} blocks per stream")
            self._announced.append(header)
        done = []
        view = memoryview(data)
        offset = 0
        while offset < len(view):
            if self._current is None:
                if not self._announced:
                    raise InvalidArgument("data for a block whose header has not been sent")
                self._current = self._announced.popleft()
                self._buffer = bytearray(self._size_of(self._current))
                self._filled = 0
            take = min(len(view) - offset, len(self._buffer) - self._filled)
            self._buffer[self._filled : self._filled + take] = view[offset : offset + take]
            self._filled += take
            offset += take
            if self._filled == len(self._buffer):
                done.append((self._current, self._buffer))
                self._current, self._buffer = None, bytearray()
        return done

    def pending(self) -> str | None:
        """What is unfinished at the end of the stream (None when nothing)."""
        if self._current is not None:
            return f"a block ended after {self._filled} of {len(self._buffer)} bytes"
        if self._announced:
            return f"{len(self._announced)} announced blocks had no bytes"
        return None
