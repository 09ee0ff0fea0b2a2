"""Load steps sized from what the same run measured, so that a step meant to breach a latency
target breaches it on a fast machine and on a slow one alike.

A fixed load (say 6 closed-loop clients) against a fixed target (300 ms p99 TTFT) breaches
only on machines about as fast as the one it was tuned on. Instead, measure the pool's service
time first (sequential requests, nothing queued), then size the step: C closed-loop clients on
S slots, each request holding a slot for `service_ms`, queue for about (C / S - 1) x service_ms
before their first token. Where even that does not breach (the machine sped up mid-run), the
load grows until it does (`ClosedLoopLoad.grow`), within a bound.

Used by `bench/scale.py` and the autoscaling integration tests.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc

from ballast.v1 import inference_pb2_grpc
from services.cli.client import chat_request

MOST_CLIENTS = 48
"""No load step uses more closed-loop clients than this: a bound on what a test can offer."""


def clients_for_queue_wait(service_ms: float, wait_ms: float, slots: int = 1, most: int = MOST_CLIENTS) -> int:
    """Closed-loop clients whose queueing alone keeps each request waiting about `wait_ms`
    for a slot, on `slots` slots that each hold a request for `service_ms`."""
    if service_ms <= 0 or wait_ms < 0 or slots < 1:
        raise ValueError(f"need service_ms > 0, wait_ms >= 0, slots >= 1; got {service_ms}, {wait_ms}, {slots}")
    needed = math.ceil(slots * (wait_ms / service_ms + 1))
    return max(1, min(most, needed))


async def median_service_ms(one_request: Callable[[], Awaitable[object]], requests: int = 8) -> float:
    """The median wall time of `requests` sequential requests (none queues behind another);
    the first is a warm-up and is not counted."""
    await one_request()
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        await one_request()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


@dataclass
class Samples:
    """Clients' TTFTs as (finished at, ms), plus degraded and failed counts."""

    ttft: list[tuple[float, float]] = field(default_factory=list)
    degraded: int = 0
    errors: int = 0


async def timed_stream(stub, request, metadata, samples: Samples, timeout: float = 30.0) -> None:
    """One stream; its TTFT goes to `samples` unless it was a degraded answer (a rule-engine
    answer says nothing about the pool's latency) or it failed."""
    started, first, degraded = time.perf_counter(), None, False
    try:
        async for event in stub.Generate(request, metadata=metadata, timeout=timeout):
            if first is None and event.HasField("tokens"):
                first = time.perf_counter()
            if event.HasField("finished") and event.finished.degradation:
                degraded = True
    except grpc.aio.AioRpcError:
        samples.errors += 1
        await asyncio.sleep(0.1)  # a refused client backs off instead of spinning
        return
    if degraded:
        samples.degraded += 1
    elif first is not None:
        samples.ttft.append((time.time(), (first - started) * 1000))


class ClosedLoopLoad:
    """Closed-loop clients of one prompt, each sending its next request when the last ended,
    until `finish()`; `grow(n)` adds clients while it runs."""

    def __init__(
        self,
        stub: inference_pb2_grpc.InferenceStub,
        metadata,
        prompt: str,
        max_tokens: int,
        samples: Samples | None = None,
    ) -> None:
        self.stub, self.metadata = stub, metadata
        self.prompt, self.max_tokens = prompt, max_tokens
        self.samples = samples if samples is not None else Samples()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def clients(self) -> int:
        return len(self._tasks)

    def grow(self, clients: int) -> None:
        for _ in range(clients):
            self._tasks.append(asyncio.create_task(self._client()))

    async def _client(self) -> None:
        while not self._stop.is_set():
            request = chat_request(self.prompt, max_tokens=self.max_tokens, raw_prompt=True)
            await timed_stream(self.stub, request, self.metadata, self.samples)

    async def finish(self, timeout: float = 40.0) -> None:
        self._stop.set()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
        for task in self._tasks:
            task.cancel()


async def grow_until(
    load: ClosedLoopLoad,
    breached: Callable[[], bool],
    patience_s: float,
    most: int = MOST_CLIENTS,
    interval: float = 0.05,
) -> bool:
    """Waits for `breached()`; each `patience_s` without it doubles the clients, up to `most`.
    False if it still has not breached after a full patience at `most` clients."""
    while True:
        deadline = time.monotonic() + patience_s
        while time.monotonic() < deadline:
            if breached():
                return True
            await asyncio.sleep(interval)
        if load.clients >= most:
            return breached()
        load.grow(min(load.clients, most - load.clients))
