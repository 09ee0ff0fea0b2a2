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
    started. A worker started again counts from zero: `restarted` says so."""

    def __init__(self, baselines: dict[str, float]) -> None:
        self.baselines = baselines

    @classmethod
    async def read(cls, workers) -> "Answering":
        return cls({w.name: await answering(w) for w in workers})

    def restarted(self, name: str) -> None:
        self.baselines[name] = 0.0

    async def now(self, worker) -> tuple[float, float]:
        """(streams of the batch `worker` is in the middle of answering, its in-flight gauge),
        both from one scrape."""
        text = await scrape(worker.metrics_port)
        return answering_in(text) - self.baselines.get(worker.name, 0.0), metric_value(text, "ballast_worker_in_flight")


def _first_tokens(text: str) -> float:
    return metric_value(text, "ballast_worker_ttft_milliseconds_count")


def _finished(text: str) -> float:
    return metric_value(text, "ballast_worker_requests_total")


def token_counter(received: list[int], index: int):
    """An `on_tokens` callback for `collect` that adds the tokens of stream `index` to
    `received[index]`."""

    def on_tokens(tokens) -> None:
        received[index] += len(tokens.token_ids)

    return on_tokens


def all_begun(received: list[int], streams: list[asyncio.Task]) -> bool:
    """Every stream of the batch has had a token at the client, or has ended. Only then does a
    fault resume each stream it breaks: the router resumes a stream it has relayed tokens of,
    and retries one it has none of, and a busy router may relay a worker's first tokens late."""
    return all(count > 0 or stream.done() for count, stream in zip(received, streams))


async def worker_answering(
    candidates,
    answering: Answering,
    streams: list[asyncio.Task],
    rng: random.Random,
    received: list[int] | None,
    timeout: float = 120.0,
):
    """A worker among `candidates` in the middle of answering a stream of the batch now (its
    first token out, not finished, its in-flight gauge > 0) while a stream of the batch is
    still unfinished at the client and every stream has begun there (`all_begun`); returned
    as soon as it is read so, for the caller to fault at once. `received[i]`: tokens stream i
    has had at the client (see `token_counter`); None for a caller that counts a stream moved
    from the start as hit too, which then does not wait for every stream to begin (on a busy
    machine the router may start the last streams of a batch after a worker finished the
    first). The candidates are read in a fresh random order each round, so which of the
    answering workers is hit is the seed's choice. None if every stream ended first."""
    candidates = list(candidates)
    deadline = time.monotonic() + timeout
    while not all(s.done() for s in streams):
        if received is None or all_begun(received, streams):
            rng.shuffle(candidates)
            for worker in candidates:
                started_not_finished, in_flight = await answering.now(worker)
                if started_not_finished >= 1 and in_flight >= 1 and not all(s.done() for s in streams):
                    return worker
        assert time.monotonic() < deadline, "no worker took a stream of the batch"
        await asyncio.sleep(0.005)
    return None
