"""A bare relay: the floor under what a router adds.

A grpc.aio server with the Worker service's `Generate` and nothing else: each call is
forwarded as it came to the next worker (round robin) and each event back as it came. No
authentication, tokenization, admission, scheduling, tracing, metrics or failover: what
is left is the extra hop itself (one more gRPC server and client in Python, one more
process on the machine's cores). Benchmarks run it beside the router, on the same workers
and the same load, so "the router adds X" can be split into "any Python gRPC relay adds Y"
and "Ballast's own work adds X - Y".

    python -m bench.bare_relay --targets 127.0.0.1:5001,127.0.0.1:5002 [--port 0]

Prints `READY bare-relay <address>` once it serves; stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from pathlib import Path

import grpc

from ballast.v1 import worker_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.lifecycle import catch_stop_signals
from services.common.processes import ManagedProcess, wait_until_ready

READY = "READY bare-relay "


class BareRelay(worker_pb2_grpc.WorkerServicer):
    """Forwards Worker/Generate to the targets in turn; every other method is unimplemented."""

    def __init__(self, targets: list[str]) -> None:
        self._channels = [grpc.aio.insecure_channel(t, options=CHANNEL_OPTIONS) for t in targets]
        self._stubs = itertools.cycle([worker_pb2_grpc.WorkerStub(c) for c in self._channels])

    async def Generate(self, request, context):
        try:
            async for event in next(self._stubs).Generate(request, timeout=context.time_remaining()):
                yield event
        except grpc.aio.AioRpcError as error:
            # The worker's status, as the worker gave it (else the client would see UNKNOWN).
            await context.abort(error.code(), error.details() or "")

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


async def serve(targets: list[str], port: int) -> None:
    relay = BareRelay(targets)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(relay, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = catch_stop_signals()
    print(f"{READY}127.0.0.1:{bound}", flush=True)
    await stop
    await server.stop(grace=1.0)
    await relay.close()


def start_bare_relay(targets: list[str], log_path: Path, timeout: float = 60.0) -> tuple[ManagedProcess, str]:
    """Starts a bare relay over `targets` in a process of its own; returns it and its address.
    `log_path` must be a new file: the READY line is looked for in all of it."""
    process = ManagedProcess(
        "bare-relay",
        [sys.executable, "-m", "bench.bare_relay", "--targets", ",".join(targets)],
        log_path=log_path,
        env={"PYTHONUNBUFFERED": "1"},
    ).start()
    address: list[str] = []

    def ready() -> bool:
        lines = log_path.read_text(errors="replace").splitlines()
        address[:] = [line[len(READY) :].strip() for line in lines if line.startswith(READY)]
        return bool(address)

    try:
        wait_until_ready(process, ready, timeout, what="serving")
    except BaseException:
        process.stop()
        raise
    return process, address[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", required=True, help="worker addresses, comma separated")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(serve([t for t in args.targets.split(",") if t], args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
