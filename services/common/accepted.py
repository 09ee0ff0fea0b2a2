"""The header a worker sends the moment it takes a Generate call, before its engine sees it.

With it a caller tells a worker that died while taking its request on (the header came, then
the stream broke) from one that was already gone when it called (no header: the connection was
refused or reset first). The router's poison containment counts only the first kind against
a request (services.router.resilience.quarantine).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc

ACCEPTED_KEY = "ballast-accepted"
ACCEPTED_METADATA = ((ACCEPTED_KEY, "1"),)
# The call has ended when this is asked: its headers are in hand or never came.
_READ_TIMEOUT_S = 1.0


class HeadedCall(Protocol):
    """A gRPC call, or anything that carries a worker's headers like one (a Relay call)."""

    async def initial_metadata(self) -> Any: ...


async def was_accepted(call: HeadedCall | None) -> bool:
    """Whether the (ended) call's worker sent the accepted header."""
    if call is None:
        return False
    try:
        metadata = await asyncio.wait_for(call.initial_metadata(), _READ_TIMEOUT_S)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        return False
    return any(key == ACCEPTED_KEY for key, _value in (metadata or ()))
