"""Choosing the worker a fault hits by that worker's own state: one in the middle of answering a
stream of the batch at the moment it is chosen, and only while the batch still has a stream
unfinished. A kill or a stop aimed this way hits work in flight on a busy machine and a quiet
one alike; one aimed by the clock, or by how far the client has read, may land after the
workers are done (a client that lags reads its tokens after they were generated)."""

from __future__ import annotations

import asyncio
import random
import time

from tests.integration.test_mesh import metric_value, scrape


def answering_in(text: str) -> float:
    """Requests that have had their first token from the worker less those it finished (any
    outcome), from one scrape of its metrics, counted since it started. A request that failed
    before its first token lowers it, never raises it: as a difference from an earlier reading
    it is a lower bound on the streams the worker is in the middle of answering."""
    return _first_tokens(text) - _finished(text)


async def answering(worker) -> float:
    """`answering_in` for `worker`, scraped now."""
    return answering_in(await scrape(worker.metrics_port))


class Answering:
    """Reads which workers are in the middle of answering a stream of a batch, from their own
    counters: baselines per worker name are read while none of the batch's streams has
    started. A stream counts once its first token came out before the worker's previous
    reading (so it has had time to reach the router, which resumes only a stream it has
    tokens of) and it has not finished by this one. A worker started again counts from zero:
    `restarted` says so."""

    def __init__(self, baselines: dict[str, tuple[float, float]]) -> None:
        self.baselines = baselines  # name -> (first tokens given, requests finished)
        self.first_tokens_seen: dict[str, float] = {}

    @classmethod
    async def read(cls, workers) -> "Answering":
        baselines = {}
        for worker in workers:
            text = await scrape(worker.metrics_port)
            baselines[worker.name] = (_first_tokens(text), _finished(text))
        return cls(baselines)

    def restarted(self, name: str) -> None:
        self.baselines[name] = (0.0, 0.0)
        self.first_tokens_seen.pop(name, None)

    async def now(self, worker) -> tuple[float, float]:
        """(streams of the batch `worker` gave a first token before its previous reading and has
        not finished now, 0 at its first reading; its in-flight gauge), from one scrape."""
        text = await scrape(worker.metrics_port)
        first0, finished0 = self.baselines.get(worker.name, (0.0, 0.0))
        earlier = self.first_tokens_seen.get(worker.name)
        self.first_tokens_seen[worker.name] = _first_tokens(text)
        if earlier is None:
            return 0.0, metric_value(text, "ballast_worker_in_flight")
        return (earlier - first0) - (_finished(text) - finished0), metric_value(text, "ballast_worker_in_flight")


def _first_tokens(text: str) -> float:
    return metric_value(text, "ballast_worker_ttft_milliseconds_count")


def _finished(text: str) -> float:
    return metric_value(text, "ballast_worker_requests_total")


async def worker_answering(candidates, answering: Answering, streams: list[asyncio.Task], rng: random.Random,
                           timeout: float = 60.0):
    """A worker among `candidates` in the middle of answering a stream of the batch now (its
    first token out, not finished, its in-flight gauge > 0) while a stream of the batch is
    still unfinished at the client; returned as soon as it is read so, for the caller to
    fault at once. The candidates are read in a fresh random order each round, so which of
    the answering workers is hit is the seed's choice. None if every stream ended first."""
    candidates = list(candidates)
    deadline = time.monotonic() + timeout
    while not all(s.done() for s in streams):
        rng.shuffle(candidates)
        for worker in candidates:
            started_not_finished, in_flight = await answering.now(worker)
            if started_not_finished >= 1 and in_flight >= 1 and not all(s.done() for s in streams):
                return worker
        assert time.monotonic() < deadline, "no worker took a stream of the batch"
        await asyncio.sleep(0.005)
    return None
