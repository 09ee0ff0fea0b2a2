"""`ballast-worker`: runs one model replica until SIGTERM, then drains.

With `worker.respawn` on, it runs under a keeper that starts a fresh replica at once when
one dies (services/worker/keeper.py)."""

from __future__ import annotations

import asyncio
import sys
from typing import Callable

from services.common.config import BallastConfig
from services.common.lifecycle import run_main, serve_until_signal
from services.worker.app import create_server


async def serve(config: BallastConfig, on_ready: Callable[[], None] | None = None) -> None:
    await serve_until_signal(create_server, "worker", config, on_ready)


def launch(config: BallastConfig) -> int:
    if not config.worker.respawn:
        asyncio.run(serve(config))
        return 0
    from services.worker.keeper import Keeper, RespawnPolicy, preload

    def serve_child(ready: Callable[[], None]) -> int:
        asyncio.run(serve(config, ready))
        return 0

    preload(config.worker.engine)
    policy = RespawnPolicy(config.worker.respawn_max, config.worker.respawn_window_s)
    return Keeper(serve_child, policy).run()


def main(argv: list[str] | None = None) -> int:
    return run_main("ballast-worker", __doc__, serve, argv, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
