"""Failover through the generation runner, with fake workers instead of servers.

`FakeWorkers` implements `WorkerChannels`, the one way the runner reaches a worker: each
call plays the next step of a script (stream every token owed, die after n tokens as a
SIGKILLed worker's stream does, refuse before taking the request on, answer as a draining
worker). A fake worker numbers its tokens from `len(generated_ids)` and derives each id from
its position, as a seeded engine does, so a stream resumed on another worker continues
exactly where the first left it only if the runner sent the right prompt, tokens and
`max_tokens`. Everything else is the router's own: the scheduler and its slots, the
breakers, the retry budget, the failover decision, the resume plan, the membership view
(filled in place of etcd's watch).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider

from ballast.v1 import common_pb2, worker_pb2
from services.common.accepted import ACCEPTED_METADATA
from services.common.config import EtcdConfig
from services.common.errors import Draining, NoLiveWorker, Quarantined
from services.common.faults import status_trailers
from services.common.generation import Sampling
from services.common.membership import MembershipWatcher, WorkerRecord
from services.common.telemetry import DependencyStatus
from services.common.tier import Tier
from services.router.events import Finished, Resumed, Started, Tokens
from services.router.generation import GenerationRunner
from services.router.metrics import RouterMetrics, SchedulerMetrics
from services.router.model_registry import ModelRegistry
from services.router.pools import PoolGates
from services.router.request_run import RequestRun
from services.router.requests import InferenceRequest
from services.router.resilience.breaker import BreakerBoard
from services.router.resilience.health_view import WorkerHealthView
from services.router.resilience.retry_budget import RetryBudget
from services.router.resilience.temperature import TemperatureGate
from services.router.scheduling.tiers import TierPolicy
from services.router.settings import RouterConfig
from services.worker.tiny_model import BOS, CHAT_TEMPLATE, IM_END, corpus, train_tokenizer

MODEL, VERSION = "tiny", "v1"
MAX_TOKENS = 12


def token_at(position: int) -> int:
    """The id a fake worker generates at `position`: the same on every worker, as a seed makes it."""
    return 1000 + position


# -- the script a fake worker call plays --------------------------------------------------------


@dataclass(frozen=True)
class Serve:
    """Streams every token owed, then finishes."""


@dataclass(frozen=True)
class DieAfter:
    """Takes the request on, streams `tokens` tokens, then the connection is lost."""

    tokens: int


@dataclass(frozen=True)
class Refuse:
    """The connection fails before the worker takes the request on (no accepted header)."""


@dataclass(frozen=True)
class DieWhen:
    """Takes the request on and sends nothing until `lost` is set: then the connection is lost
    (a worker killed with the request waiting for its first token)."""

    lost: asyncio.Event


@dataclass(frozen=True)
class DrainAfter:
    """Streams `tokens` tokens, then ends the stream with the draining status."""

    tokens: int


def rpc_error(code: grpc.StatusCode, details: str, trailers: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


class FakeCall:
    """What `WorkerStub.Generate` returns, played from one step of the script."""

    def __init__(self, address: str, request: worker_pb2.WorkerGenerateRequest, step) -> None:
        self.address, self.request, self.step = address, request, step
        self.accepted = False
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    async def initial_metadata(self):
        return ACCEPTED_METADATA if self.accepted else grpc.aio.Metadata()

    def __aiter__(self):
        return self._events()

    async def _events(self):
        if isinstance(self.step, Refuse):
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
        self.accepted = True
        if isinstance(self.step, DieWhen):
            await self.step.lost.wait()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")
        start = len(self.request.generated_ids)
        owed = self.request.sampling.max_tokens
        stop_after = {DieAfter: getattr(self.step, "tokens", owed), DrainAfter: getattr(self.step, "tokens", owed)}
        limit = min(owed, stop_after.get(type(self.step), owed))
        for offset in range(limit):
            await asyncio.sleep(0)  # a real stream yields to the loop between messages
            position = start + offset
            yield worker_pb2.WorkerGenerateEvent(
                tokens=common_pb2.Tokens(text=f" t{position}", token_ids=[token_at(position)], first_index=position)
            )
        if isinstance(self.step, DieAfter):
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")
        if isinstance(self.step, DrainAfter):
            error = Draining("worker is draining")
            raise rpc_error(error.code, error.message, status_trailers(error))
        yield worker_pb2.WorkerGenerateEvent(
            finished=worker_pb2.WorkerFinished(
                reason=common_pb2.FINISH_REASON_LENGTH,
                usage=common_pb2.Usage(prompt_tokens=len(self.request.prompt_ids), completion_tokens=limit),
            )
        )


class FakeStub:
    def __init__(self, workers: "FakeWorkers", address: str) -> None:
        self._workers, self._address = workers, address

    def Generate(self, request, timeout=None, metadata=None) -> FakeCall:
        call = FakeCall(self._address, request, self._workers.next_step())
        self._workers.calls.append(call)
        return call

    async def GetModelInfo(self, _request, timeout=None) -> worker_pb2.ModelInfo:
        return self._workers.model_info


class FakeWorkers:
    """`WorkerChannels` without servers: every call, to whichever worker, plays the next step of
    `script`, and `Serve` once the script is played out."""

    def __init__(self, script: list, model_info: worker_pb2.ModelInfo) -> None:
        self.script = list(script)
        self.model_info = model_info
        self.calls: list[FakeCall] = []
        self.active: dict[str, int] = {}

    def next_step(self):
        return self.script.pop(0) if self.script else Serve()

    def stub(self, address: str) -> FakeStub:
        return FakeStub(self, address)

    def link(self, address: str):
        raise AssertionError("the fake workers publish relay=false: every call is a Generate call")

    @contextmanager
    def in_use(self, address: str) -> Iterator[FakeStub]:
        self.active[address] = self.active.get(address, 0) + 1
        try:
            yield self.stub(address)
        finally:
            self.active[address] -= 1


# -- the runner, with the router's own parts around the fakes ----------------------------------------


@pytest.fixture(scope="module")
def model_info() -> worker_pb2.ModelInfo:
    return worker_pb2.ModelInfo(
        model=MODEL,
        model_version=VERSION,
        max_context=2048,
        tokenizer_json=train_tokenizer(corpus(), 512).to_str().encode(),
        chat_template=CHAT_TEMPLATE,
        bos_token=BOS,
        eos_token=IM_END,
    )


def membership(*worker_ids: str) -> MembershipWatcher:
    watcher = MembershipWatcher(EtcdConfig(), DependencyStatus())
    watcher._workers = {
        worker_id: WorkerRecord(
            id=worker_id,
            address=f"{worker_id}:50051",
            model=MODEL,
            model_version=VERSION,
            capacity=4,
            lease_id=index + 1,
        )
        for index, worker_id in enumerate(worker_ids)
    }
    return watcher


def runner(workers: FakeWorkers, watcher: MembershipWatcher, config: RouterConfig | None = None) -> GenerationRunner:
    config = config or RouterConfig()
    meter = MeterProvider().get_meter("test")
    metrics = RouterMetrics(
        SimpleNamespace(meter=meter, latency_histogram=lambda name, _description: meter.create_histogram(name))
    )
    health = WorkerHealthView(
        BreakerBoard(config.breaker), TemperatureGate(config.temperature), unreachable_hold_s=config.unreachable_hold_s
    )
    pools = PoolGates(TierPolicy.from_mapping(config.scheduling), watcher, health, SchedulerMetrics(metrics))
    return GenerationRunner(
        config,
        watcher,
        workers,
        ModelRegistry(workers, config.worker_connect_timeout_s),
        health,
        RetryBudget(config.retry),
        pools,
        metrics,
    )


def request_run(request_id: str = "r-1", prompt: str = "where is my order?") -> RequestRun:
    request = InferenceRequest(
        request_id, "", "tenant", MODEL, Sampling(MAX_TOKENS, temperature=0.0), "A", prompt=prompt
    )
    return RequestRun(request, Tier.A, "explicit", 1.0, time.monotonic() + 30, time.perf_counter())


async def play(script: list, model_info, worker_ids=("w1", "w2")) -> tuple[list, FakeWorkers, RequestRun]:
    workers = FakeWorkers(script, model_info)
    run = request_run()
    events = [event async for event in runner(workers, membership(*worker_ids)).run(run)]
    return events, workers, run


def streamed(events: list) -> list[int]:
    return [token for event in events if isinstance(event, Tokens) for token in event.token_ids]


# -- the cases ----------------------------------------------------------------------------------------


async def test_an_unbroken_stream_is_one_call_and_every_token_once(model_info):
    events, workers, _ = await play([Serve()], model_info)
    assert isinstance(events[0], Started)
    assert streamed(events) == [token_at(i) for i in range(MAX_TOKENS)]
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == MAX_TOKENS
    assert len(workers.calls) == 1


async def test_a_worker_lost_mid_stream_is_resumed_on_another_with_nothing_lost_or_repeated(model_info):
    events, workers, run = await play([DieAfter(5)], model_info)
    first, second = workers.calls
    assert first.address != second.address  # not the worker that died
    # The second worker got the prompt again, the five tokens already sent, and what is owed.
    assert list(second.request.prompt_ids) == list(first.request.prompt_ids)
    assert list(second.request.generated_ids) == [token_at(i) for i in range(5)]
    assert second.request.sampling.max_tokens == MAX_TOKENS - 5
    assert streamed(events) == [token_at(i) for i in range(MAX_TOKENS)]
    (resumed,) = [event for event in events if isinstance(event, Resumed)]
    assert resumed.next_index == 5 and resumed.reason == "worker_lost"
    assert events.index(resumed) == 1 + 5  # after Started and the first worker's five tokens
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.completion_tokens == MAX_TOKENS and finished.resumes == 1
    assert run.state.resumes == 1


async def test_losses_one_after_another_resume_each_time_from_where_the_stream_stood(model_info):
    events, workers, _ = await play([DieAfter(3), DieAfter(4)], model_info, worker_ids=("w1", "w2", "w3"))
    assert [len(call.request.generated_ids) for call in workers.calls] == [0, 3, 7]
    assert len({call.address for call in workers.calls}) == 3
    assert streamed(events) == [token_at(i) for i in range(MAX_TOKENS)]
    assert [event.next_index for event in events if isinstance(event, Resumed)] == [3, 7]


async def test_a_worker_refusing_before_it_takes_the_request_is_retried_elsewhere_without_a_resume(model_info):
    events, workers, run = await play([Refuse()], model_info)
    first, second = workers.calls
    assert first.address != second.address
    assert list(second.request.generated_ids) == [] and second.request.sampling.max_tokens == MAX_TOKENS
    assert not [event for event in events if isinstance(event, Resumed)]
    assert streamed(events) == [token_at(i) for i in range(MAX_TOKENS)]
    assert run.state.resumes == 0


async def test_a_draining_worker_hands_the_stream_on_as_drained(model_info):
    events, workers, _ = await play([DrainAfter(6)], model_info)
    assert len(workers.calls) == 2
    (resumed,) = [event for event in events if isinstance(event, Resumed)]
    assert resumed.reason == "drained" and resumed.next_index == 6
    assert streamed(events) == [token_at(i) for i in range(MAX_TOKENS)]


async def test_when_every_worker_refuses_the_client_gets_no_live_worker_after_one_try_each(model_info):
    workers = FakeWorkers([Refuse(), Refuse(), Refuse()], model_info)
    run = request_run()
    events = []
    with pytest.raises(NoLiveWorker):
        async for event in runner(workers, membership("w1", "w2")).run(run):
            events.append(event)
    assert len(workers.calls) == 2  # each worker once; the third step was never asked for
    assert len({call.address for call in workers.calls}) == 2
    assert not streamed(events)


async def test_every_call_leaves_its_worker_channel_free(model_info):
    _, workers, _ = await play([DieAfter(2), Refuse()], model_info, worker_ids=("w1", "w2", "w3"))
    assert set(workers.active.values()) == {0}


async def test_a_request_lost_in_prefill_twice_across_calls_is_served_when_it_streamed_in_between(model_info):
    """Two workers each die with a copy of the same request taken on and no token out (a worker
    killed with several requests in prefill implicates them all). Its retry streamed after the
    first loss, so the second copy is not quarantined: it is retried and served."""
    workers = FakeWorkers([DieAfter(0), Serve(), DieAfter(0), Serve()], model_info)
    shared = runner(workers, membership("w1", "w2", "w3"))
    for request_id in ("first-copy", "second-copy"):
        events = [event async for event in shared.run(request_run(request_id))]
        assert streamed(events) == [token_at(i) for i in range(MAX_TOKENS)]
    assert len(workers.calls) == 4


async def test_a_request_that_kills_two_workers_in_a_row_is_quarantined(model_info):
    workers = FakeWorkers([DieAfter(0), DieAfter(0)], model_info)
    with pytest.raises(Quarantined):
        async for _event in runner(workers, membership("w1", "w2", "w3")).run(request_run()):
            pass
    assert len(workers.calls) == 2


async def test_every_attempt_after_a_failed_one_asks_its_worker_to_confirm(model_info):
    """A stream lost mid-answer counts nothing against its request, yet its next worker may be
    dying in the same event: every attempt after a failed one asks for a confirm, the first
    does not (resilience/quarantine.py)."""
    workers = FakeWorkers([DieAfter(3), Refuse()], model_info)
    shared = runner(workers, membership("w1", "w2", "w3"))
    asked: list[bool] = []
    wants = shared.quarantine.wants_confirmation

    def recording(request, follows_failure=False):
        asked.append(follows_failure)
        return wants(request, follows_failure=follows_failure)

    shared.quarantine.wants_confirmation = recording
    events = [event async for event in shared.run(request_run())]
    assert streamed(events) == [token_at(i) for i in range(MAX_TOKENS)]
    assert asked == [False, True, True]


async def test_a_worker_lost_with_a_queue_counts_against_the_head_of_its_line_only(model_info):
    """One worker holds two requests waiting for their first token when it dies, with room for
    one in its prefill (`max_prefill_batch: 1`). The request at the head may have killed it and
    has the loss counted; the one behind it is marked queued, and its loss excused. Both are
    served on the next worker."""
    lost = asyncio.Event()
    workers = FakeWorkers([DieWhen(lost), DieWhen(lost)], model_info)
    watcher = membership("w1", "w2")
    w2 = watcher._workers.pop("w2")  # one worker at first: both requests go to it
    config = RouterConfig(quarantine={"max_prefill_batch": 1})
    shared = runner(workers, watcher, config)
    head_run, queued_run = request_run("head", "where is my order?"), request_run("queued", "when does it ship?")

    async def served(run: RequestRun) -> list[int]:
        return streamed([event async for event in shared.run(run)])

    counted: list[tuple[str, bool]] = []
    worker_lost = shared.quarantine.worker_lost

    def recording(request, reason, worker_id, taken_on=True, incarnation="", queued=False):
        counted.append((request.request_id, queued))
        return worker_lost(request, reason, worker_id, taken_on, incarnation, queued)

    shared.quarantine.worker_lost = recording
    head = asyncio.create_task(served(head_run))
    while len(workers.calls) < 1:
        await asyncio.sleep(0)
    queued = asyncio.create_task(served(queued_run))
    while len(workers.calls) < 2:
        await asyncio.sleep(0)
    watcher._workers["w2"] = w2
    lost.set()
    whole = [token_at(i) for i in range(MAX_TOKENS)]
    assert await head == whole and await queued == whole
    assert [call.address for call in workers.calls] == ["w1:50051", "w1:50051", "w2:50051", "w2:50051"]
    # Both lost with the worker before a token; the second stood behind the head.
    assert counted == [("head", False), ("queued", True)]
