"""Process entrypoint helpers: logging set-up and waiting for SIGTERM/SIGINT on the loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from typing import Any, Awaitable, Callable


def setup_logging(service: str) -> None:
    level = os.environ.get("BALLAST_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )


async def wait_for_stop_signal() -> str:
    """Returns the name of the first SIGTERM/SIGINT received."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s.name))
    try:
        return await received
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def settle_startup_garbage() -> None:
    """Moves everything the service loaded at start (modules, models, config) out of the
    cyclic collector's sight. Those objects live as long as the process; left in view, every
    full collection under load walks all of them: about 300 ms for a torch worker, a pause of
    every stream in the process. Frozen, a full collection walks only what requests made.
    Only the young generations are collected first (10 ms, not the full 300 ms again): the
    start-up garbage is young, the old generation is the imports themselves."""
    gc.collect(1)
    gc.freeze()


async def serve_until_signal(
    create_server: Callable[[Any], Awaitable[Any]], name: str, config: Any,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Starts a service app, prints one READY line (launchers wait for it), stops on signal.
    `on_ready` runs right after the READY line (a keeper process waits for it)."""
    app = await create_server(config)
    settle_startup_garbage()
    print(f"READY {name} {app.address} metrics={app.telemetry.port}", flush=True)
    if on_ready is not None:
        on_ready()
    signal_name = await wait_for_stop_signal()
    logging.getLogger(f"ballast.{name}").info("%s received, shutting down", signal_name)
    await app.shutdown()
