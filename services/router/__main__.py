"""`ballast-router`: serves the public Inference API until SIGTERM."""

from __future__ import annotations

import sys

from services.common.lifecycle import serve_until_signal
from services.config import BallastConfig
from services.entrypoint import run_main
from services.router.app import create_server


async def serve(config: BallastConfig) -> None:
    await serve_until_signal(create_server, "router", config)


def main(argv: list[str] | None = None) -> int:
    return run_main("ballast-router", __doc__, serve, argv, role="router")


if __name__ == "__main__":
    sys.exit(main())
