"""The `main()` every service shares: parse the arguments, load the root config and check
its TLS files, its own and those towards etcd, Redis and Kafka (failing fast, naming the
field), then serve."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Awaitable, Callable

from services.common import event_loop
from services.common.config import ConfigError
from services.common.lifecycle import setup_logging
from services.common.tls.backing import check_backing_tls
from services.common.tls.material import check_identity
from services.config import load_config


def run_main(
    prog: str,
    description: str | None,
    serve: Callable[[Any], Awaitable[None]],
    argv: list[str] | None,
    launch: Callable[[Any], int] | None = None,
    role: str | None = None,
) -> int:
    """The shared `main()`: parse args, load typed config (fail fast naming the field), serve.
    `launch(config)`, when given, runs the service instead of `serve` on a fresh event loop.
    `role`: the role this service's TLS certificate must name."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="ballast.yaml (default: $BALLAST_CONFIG)")
    args = parser.parse_args(argv)
    setup_logging(prog.removeprefix("ballast-"))
    try:
        config = load_config(args.config)
        # Before anything starts (a worker loads its model first): a bad certificate would
        # otherwise surface only at the first handshake, as a peer's UNAVAILABLE.
        check_identity(config.tls, role)
        for section in ("etcd", "redis", "kafka"):
            check_backing_tls(getattr(config, section).tls, f"{section}.tls")
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if launch is not None:
        return launch(config)
    event_loop.run(serve(config), config.runtime.event_loop)
    return 0
