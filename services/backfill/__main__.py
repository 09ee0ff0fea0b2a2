"""`ballast-backfill`: runs the backfill service until SIGTERM."""

from __future__ import annotations

import sys

from services.backfill.app import create_server
from services.common.lifecycle import serve_until_signal
from services.config import BallastConfig
from services.entrypoint import run_main


async def serve(config: BallastConfig) -> None:
    await serve_until_signal(create_server, "backfill", config)


def main(argv: list[str] | None = None) -> int:
    return run_main("ballast-backfill", __doc__, serve, argv, role="backfill")


if __name__ == "__main__":
    sys.exit(main())
