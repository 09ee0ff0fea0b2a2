"""`ballast-worker`: runs one model replica until SIGTERM, then drains.

With `worker.respawn` on, it runs under a keeper that starts a fresh replica at once when
one dies (services/worker/keeper.py)."""

from __future__ import annotations

import sys
from typing import Callable

from services.common import event_loop
from services.config import BallastConfig
from services.common.lifecycle import serve_until_signal
from services.entrypoint import run_main
from services.worker.app import create_server


def tune_process(config: BallastConfig) -> None:
    """Process-wide settings of a worker process (not of a worker built inside another one)."""
    # Two threads share the GIL here: the compute thread, busy for as long as streams run, and
    # the event loop that takes requests and sends tokens. The loop waits for the GIL up to
    # the switch interval each time it wakes (5 ms by default: a token just computed waited
    # that long to leave while the next step ran).
    sys.setswitchinterval(config.worker.gil_switch_ms / 1000)


async def serve(config: BallastConfig, on_ready: Callable[[], None] | None = None) -> None:
    tune_process(config)
    await serve_until_signal(create_server, "worker", config, on_ready)


def launch(config: BallastConfig) -> int:
    if not config.worker.respawn:
        event_loop.run(serve(config), config.runtime.event_loop)
        return 0
    from services.worker.keeper import Keeper, RespawnPolicy, preload

    def serve_child(ready: Callable[[], None]) -> int:
        event_loop.run(serve(config, ready), config.runtime.event_loop)
        return 0

    preload(config.worker.engine)
    policy = RespawnPolicy.from_settings(config.worker)
    return Keeper(serve_child, policy).run()


def main(argv: list[str] | None = None) -> int:
    return run_main("ballast-worker", __doc__, serve, argv, launch=launch, role="worker")


if __name__ == "__main__":
    sys.exit(main())
