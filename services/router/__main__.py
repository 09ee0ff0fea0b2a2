"""`ballast-router`: serves the public Inference API until SIGTERM."""

from __future__ import annotations

import sys

from services.common.lifecycle import serve_until_signal
from services.config import BallastConfig
from services.entrypoint import run_main
from services.router.app import create_server
from services.router.process_group import config_for_slot, current_slot, run_group


async def serve(config: BallastConfig, argv: list[str] | None = None) -> None:
    """One router; or, with router.processes > 1, the parent of that many (started with `argv`)."""
    slot = current_slot()
    if slot is None and config.router.processes > 1:
        await run_group(config, sys.argv[1:] if argv is None else argv)
        return
    if slot is not None:
        config = config_for_slot(config, slot)
    await serve_until_signal(create_server, "router", config)


def main(argv: list[str] | None = None) -> int:
    return run_main("ballast-router", __doc__, lambda config: serve(config, argv), argv, role="router")


if __name__ == "__main__":
    sys.exit(main())
