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


def catch_stop_signals() -> asyncio.Future[str]:
    """Catches SIGTERM and SIGINT from now on; the future holds the first one's name (the
    handlers go once it is done). Made before a process says it is ready: a launcher that
    reads the READY line may signal at once, and a signal that came before the handlers
    would kill the process instead of stopping it."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[str] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s.name))

    def remove_handlers(_: asyncio.Future[str]) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    received.add_done_callback(remove_handlers)
    return received


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
    create_server: Callable[[Any], Awaitable[Any]],
    name: str,
    config: Any,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Starts a service app, prints one READY line (launchers wait for it), stops on signal.
    `on_ready` runs right after the READY line (a keeper process waits for it)."""
    app = await create_server(config)
    settle_startup_garbage()
    stop = catch_stop_signals()
    print(f"READY {name} {app.address} metrics={app.telemetry.port}", flush=True)
    if on_ready is not None:
        on_ready()
    signal_name = await stop
    logging.getLogger(f"ballast.{name}").info("%s received, shutting down", signal_name)
    await app.shutdown()
