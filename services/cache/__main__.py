"""`ballast-cache`: runs the KV-cache store service until SIGTERM."""

from __future__ import annotations

import sys

from services.cache.app import create_server
from services.common.lifecycle import serve_until_signal
from services.config import BallastConfig
from services.entrypoint import run_main


async def serve(config: BallastConfig) -> None:
    await serve_until_signal(create_server, "cache", config)


def main(argv: list[str] | None = None) -> int:
    return run_main("ballast-cache", __doc__, serve, argv, role="cache")


if __name__ == "__main__":
    sys.exit(main())
