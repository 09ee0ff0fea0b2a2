"""Orders the torch engine's model work on its one compute thread: most urgent first, and
every sequence's next decode step in one batched forward pass.

Each request's coroutine asks for work and awaits the answer: `call` runs one function
(a KV restore, a grammar compile), `prefill` runs a chunk of a sequence's context, `decode`
asks for one more token of a sequence. The dispatcher runs one job at a time on the compute
thread. It picks the job with the best (priority, arrival); all decode steps waiting at that
moment form one job, ranked by its most urgent step, and run as one batch (at most
`max_batch`, most urgent first); waiting prefills of the most urgent priority likewise, up to
`max_prefill_tokens` and to what the measured cost per token says fits in `prefill_budget_ms`
(one forward pass is never cut short, so its length is what a new S-tier prompt may wait). So a
new S-tier prompt waits for at most the forward pass in progress, not behind every running
sequence's step; N running sequences cost one forward pass per token instead of N; and the
streams of a dead worker, resumed here all at once, re-read their contexts together.

Priority is a small integer, lower first (the worker maps tiers S, A, B to 0, 1, 2).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

from services.common.errors import Unavailable
from services.common.tasks import stop_task

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(order=True)
class _Call:
    priority: int
    order: int
    fn: Callable[..., Any] = field(compare=False)
    args: tuple = field(compare=False)
    future: asyncio.Future = field(compare=False)


@dataclass(order=True)
class DecodeStep:
    """One sequence's next token: run `token` on `seq`, then sample with `sample`."""

    priority: int
    order: int
    seq: Any = field(compare=False)
    token: int = field(compare=False)
    sample: Any = field(compare=False)
    future: asyncio.Future = field(compare=False, default=None)


@dataclass(order=True)
class PrefillStep:
    """A chunk of one sequence's context: run `ids` on `seq`; sample after it when `sample`."""

    priority: int
    order: int
    seq: Any = field(compare=False)
    ids: Sequence[int] = field(compare=False)
    sample: Any = field(compare=False)
    future: asyncio.Future = field(compare=False, default=None)


# Runs a batch of steps on the compute thread; per step, its result (the next token) or the
# exception that step failed with (one bad step does not fail its batch-mates).
BatchRunner = Callable[[Sequence[Any]], Sequence[Any]]


class StepScheduler:
    def __init__(
        self,
        run_batch: BatchRunner,
        max_batch: int = 64,
        thread_name: str = "torch-engine",
        run_prefills: BatchRunner | None = None,
        max_prefill_tokens: int = 2048,
        prefill_budget_ms: float = 20.0,
    ) -> None:
        """`run_batch` runs decode steps, `run_prefills` prefill steps (without it, `prefill`
        is not available)."""
        self._run_batch = run_batch
        self._run_prefills = run_prefills
        self._max_batch = max(1, max_batch)
        self._max_prefill_tokens = max(1, max_prefill_tokens)
        self._prefill_budget_ms = prefill_budget_ms
        self._ms_per_prefill_token: float | None = None  # moving average, from batches run
        self._prefills: list[PrefillStep] = []
        self._thread_name = thread_name
        self._calls: list[_Call] = []
        self._decodes: list[DecodeStep] = []
        self._order = itertools.count()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self.batches = 0
        self.batched_steps = 0
        # Batches and calls the compute thread finished, prefill and decode alike: moves while
        # a long prefill yields no token, stops when the compute thread hangs.
        self.completed = 0

    @property
    def running(self) -> bool:
        return self._executor is not None

    def start(self) -> None:
        if self._executor is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="step-dispatch")

    async def stop(self) -> None:
        """Fails every job, waiting or in progress, with Unavailable; returns once the job on
        the compute thread has finished."""
        executor, self._executor = self._executor, None
        task, self._task = self._task, None
        if task is not None:
            await stop_task(task)
        _fail([*self._calls, *self._decodes, *self._prefills], Unavailable("torch engine is stopping"))
        self._calls.clear()
        self._decodes.clear()
        self._prefills.clear()
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    async def call(self, fn: Callable[..., T], *args: Any, priority: int = 1) -> T:
        """Runs `fn(*args)` on the compute thread, in priority order."""
        future = self._enqueue()
        heapq.heappush(self._calls, _Call(priority, next(self._order), fn, args, future))
        return await future

    async def decode(self, seq: Any, token: int, sample: Any, priority: int = 1) -> int:
        """Runs `token` on `seq` in the next decode batch; the token sampled after it."""
        future = self._enqueue()
        self._decodes.append(DecodeStep(priority, next(self._order), seq, token, sample, future))
        return await future

    async def prefill(self, seq: Any, ids: Sequence[int], sample: Any, priority: int = 1) -> Any:
        """Runs `ids` on `seq` with other waiting prefills; what the prefill runner gives."""
        if self._run_prefills is None:
            raise RuntimeError("this scheduler has no prefill runner")
        future = self._enqueue()
        self._prefills.append(PrefillStep(priority, next(self._order), seq, ids, sample, future))
        return await future

    def _enqueue(self) -> asyncio.Future:
        if self._executor is None or self._wake is None:
            raise Unavailable("torch engine is not running")
        self._wake.set()
        return asyncio.get_running_loop().create_future()

    # --- dispatcher ---------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                self._drop_abandoned()
                heads = [
                    (job.priority, job.order, kind)
                    for kind, job in (
                        ("call", self._calls[0] if self._calls else None),
                        ("decode", min(self._decodes) if self._decodes else None),
                        ("prefill", min(self._prefills) if self._prefills else None),
                    )
                    if job is not None
                ]
                if not heads:
                    break
                kind = min(heads)[2]
                if kind == "call":
                    await self._run_call(heapq.heappop(self._calls))
                elif kind == "decode":
                    await self._run_decodes()
                else:
                    await self._run_prefill_batch()
                # The streams just answered ask for their next step as soon as they run: let
                # them, so they join the next batch. Picking at once would start a batch of the
                # few steps already waiting, and the two groups would then alternate for good,
                # each pass half as full as it could be.
                await asyncio.sleep(0)

    def _drop_abandoned(self) -> None:
        """Forgets jobs whose requester stopped waiting (a cancelled stream)."""
        if any(job.future.done() for job in self._calls):
            self._calls = [job for job in self._calls if not job.future.done()]
            heapq.heapify(self._calls)
        self._decodes = [step for step in self._decodes if not step.future.done()]
        self._prefills = [step for step in self._prefills if not step.future.done()]

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        executor = self._executor
        if executor is None:
            raise Unavailable("torch engine is stopping")
        try:
            result = await asyncio.get_running_loop().run_in_executor(executor, _no_stop_iteration, fn, args)
        except Exception:  # the thread finished the job, with an error
            self.completed += 1
            raise
        self.completed += 1
        return result

    async def _run_call(self, job: _Call) -> None:
        try:
            result = await self._on_thread(job.fn, *job.args)
        except asyncio.CancelledError:
            _fail([job], Unavailable("torch engine is stopping"))
            raise
        except BaseException as exc:  # handed to the requester, who raises it
            if not job.future.done():
                job.future.set_exception(exc)
            return
        if not job.future.done():
            job.future.set_result(result)

    async def _run_decodes(self) -> None:
        self._decodes.sort()
        batch, self._decodes = self._decodes[: self._max_batch], self._decodes[self._max_batch :]
        self.batches += 1
        self.batched_steps += len(batch)
        await self._run_steps(batch, self._run_batch)

    async def _run_prefill_batch(self) -> None:
        """The most urgent waiting prefills, as many as fit `max_prefill_tokens` (at least one).
        Only of the most urgent priority: a prefill's cost grows with every token batched with
        it, and an S-tier prompt must not carry B-tier prompts through its forward pass."""
        self._prefills.sort()
        limit = self._max_prefill_tokens
        if self._ms_per_prefill_token:
            limit = min(limit, int(self._prefill_budget_ms / self._ms_per_prefill_token))
        batch, tokens = [], 0
        for step in self._prefills:
            if batch and (tokens + len(step.ids) > limit or step.priority != batch[0].priority):
                break
            batch.append(step)
            tokens += len(step.ids)
        self._prefills = self._prefills[len(batch) :]
        started = time.perf_counter()
        await self._run_steps(batch, self._run_prefills)
        per_token = 1000 * (time.perf_counter() - started) / max(1, tokens)
        previous = self._ms_per_prefill_token
        self._ms_per_prefill_token = per_token if previous is None else 0.8 * previous + 0.2 * per_token

    async def _run_steps(self, batch: list, runner: BatchRunner) -> None:
        try:
            results = await self._on_thread(runner, batch)
        except asyncio.CancelledError:
            _fail(batch, Unavailable("torch engine is stopping"))
            raise
        except BaseException as exc:
            log.exception("a batch of %d steps failed", len(batch))
            results = [exc] * len(batch)
        if len(results) != len(batch):  # a runner bug: never leave a stream waiting forever
            results = [RuntimeError(f"a batch of {len(batch)} steps gave {len(results)} results")] * len(batch)
        for step, result in zip(batch, results):
            if step.future.done():
                continue
            if isinstance(result, BaseException):
                step.future.set_exception(result)
            else:
                step.future.set_result(result)


def _no_stop_iteration(fn: Callable[..., T], args: tuple) -> T:
    """Runs fn(*args). A StopIteration becomes a RuntimeError: asyncio cannot put the former
    into a future, and the job's requester would wait forever."""
    try:
        return fn(*args)
    except StopIteration as exc:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} raised StopIteration") from exc


def _fail(jobs: Sequence[_Call | DecodeStep], error: BaseException) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(error)
