"""The event loop a Ballast process runs on, chosen by `runtime.event_loop`.

`uvloop` (the default) is libuv's loop behind the same asyncio API: tasks, futures and
cancellation are asyncio's own, only the loop's machinery (timers, callbacks, sockets) is in
C. A relay pays that machinery a few times per message, so it shows in the router's CPU per
token; `asyncio` is the standard library's loop, for a platform without uvloop or to rule the
loop out when chasing a problem.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Literal, TypeVar

from pydantic import Field

from services.common.config import Section

T = TypeVar("T")

EventLoop = Literal["uvloop", "asyncio"]


class RuntimeConfig(Section):
    event_loop: EventLoop = Field(
        "uvloop",
        description="The event loop of every Ballast process: uvloop (libuv, less CPU per message) or asyncio "
        "(the standard library's).",
    )


def run(main: Coroutine[Any, Any, T], loop: EventLoop) -> T:
    """Runs `main` to its end on a new loop of the kind `loop` names (asyncio.run's semantics)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
