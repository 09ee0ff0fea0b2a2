"""Pure router logic: auth, request validation, worker choice."""

import itertools

import pytest

from ballast.v1 import common_pb2, inference_pb2
from services.common.auth import Authenticator
from services.common.config import AuthConfig
from services.common.errors import InvalidArgument, Unauthenticated
from services.common.membership import WorkerRecord
from services.router.pools import PoolGates, slot_key
from services.router.requests import request_from_pb
from services.router.resilience.breaker import BreakerBoard, BreakerConfig, BreakerState, Outcome
from services.router.resilience.health_view import WorkerHealthView
from services.router.resilience.temperature import TemperatureConfig, TemperatureGate
from services.router.scheduling.scheduler import PoolScheduler, WorkerSlots
from services.router.scheduling.tiers import TierPolicy
from services.router.settings import RouterConfig


def make_request(**fields) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(model="tiny", **fields)
    if not request.WhichOneof("input"):
        request.conversation.messages.add(role="user", content="hello")
    return request


class TestAuth:
    def test_key_maps_to_tenant(self):
        auth = Authenticator(AuthConfig(api_keys={"k1": "acme"}))
        assert auth.tenant_for([("x-api-key", "k1")]) == "acme"
        assert auth.tenant_for([("authorization", "Bearer k1")]) == "acme"

    @pytest.mark.parametrize("metadata", [[], [("x-api-key", "nope")], [("authorization", "k1")]])
    def test_refused(self, metadata):
        with pytest.raises(Unauthenticated):
            Authenticator(AuthConfig(api_keys={"k1": "acme"})).tenant_for(metadata)

    def test_disabled_uses_default_tenant(self):
        assert Authenticator(AuthConfig(enabled=False, default_tenant="dev")).tenant_for([]) == "dev"


class TestValidation:
    config = RouterConfig(default_max_tokens=32, max_tokens_limit=100, max_request_bytes=4096, max_prompt_chars=1000)

    def test_valid_request_gets_defaults_and_an_id(self):
        request = request_from_pb(make_request(), "acme", self.config)
        assert request.request_id
        assert request.tenant == "acme"
        assert request.sampling.max_tokens == self.config.default_max_tokens
        assert request.tier == "AUTO"
        assert request.allow_degraded is True

    @pytest.mark.parametrize(
        "fields, message",
        [
            ({"conversation": inference_pb2.Conversation()}, "messages must not be empty"),
            ({"prompt": ""}, "prompt must not be empty"),
            ({"sampling": common_pb2.SamplingParams(max_tokens=0)}, "max_tokens must be > 0"),
            ({"sampling": common_pb2.SamplingParams(max_tokens=-5)}, "max_tokens must be > 0"),
            ({"sampling": common_pb2.SamplingParams(max_tokens=101)}, "max_tokens must be <= 100"),
            ({"sampling": common_pb2.SamplingParams(temperature=-1)}, "temperature"),
            ({"sampling": common_pb2.SamplingParams(top_p=0)}, "top_p"),
            ({"tier": 7}, "unknown tier 7"),
            ({"prompt": "x" * 1001}, "limit is 1000"),
            ({"prompt": "x" * 5000}, "bytes"),
            ({"request_id": "a\nb"}, "request_id"),
        ],
    )
    def test_bad_input(self, fields, message):
        with pytest.raises(InvalidArgument, match=message):
            request_from_pb(make_request(**fields), "acme", self.config)

    def test_bad_role(self):
        request = inference_pb2.GenerateRequest(model="tiny")
        request.conversation.messages.add(role="wizard", content="hi")
        with pytest.raises(InvalidArgument, match="role"):
            request_from_pb(request, "acme", self.config)

    def test_no_input(self):
        with pytest.raises(InvalidArgument, match="set either conversation or prompt"):
            request_from_pb(inference_pb2.GenerateRequest(model="tiny"), "acme", self.config)

    def test_missing_model(self):
        request = make_request()
        request.model = ""
        with pytest.raises(InvalidArgument, match="model"):
            request_from_pb(request, "acme", self.config)


def worker(id, in_flight=0, capacity=4, model="tiny", healthy=True, draining=False):
    return WorkerRecord(
        id=id,
        address=f"127.0.0.1:{id}",
        model=model,
        model_version="v",
        capacity=capacity,
        in_flight=in_flight,
        healthy=healthy,
        draining=draining,
    )


REQUEST_IDS = itertools.count()


class Members:
    """The membership the pool gates read: the workers etcd lists now, and a version bumped
    on every change (as MembershipWatcher's)."""

    def __init__(self, workers) -> None:
        self._workers = {w.id: w for w in workers}
        self.version = 0

    def workers(self) -> dict[str, WorkerRecord]:
        return dict(self._workers)

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def replace(self, record: WorkerRecord) -> None:
        self._workers[record.id] = record
        self.version += 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gates_over(workers, clock=None) -> PoolGates:
    clock = clock or Clock()
    health = WorkerHealthView(
        BreakerBoard(BreakerConfig(), clock=clock), TemperatureGate(TemperatureConfig()), clock=clock
    )
    return PoolGates(TierPolicy(), Members(workers), health)


def slot_ids(gates: PoolGates) -> set[str]:
    return {key.partition("@")[0] for key in gates._slots("tiny")}


def open_breaker(gates: PoolGates, worker_id: str) -> None:
    """Fails calls to the worker until its breaker opens."""
    board = gates.health.breakers
    while board.state(worker_id) is BreakerState.CLOSED:
        permit = board.try_acquire(worker_id)
        assert permit is not None
        permit.record(Outcome.FAULT)


def dispatch(scheduler: PoolScheduler, workers, **ticket_fields) -> str:
    """Submits one request and returns the worker the scheduler gives it."""
    ticket = scheduler.new_ticket(f"r{next(REQUEST_IDS)}", "t", "A", **ticket_fields)
    assert scheduler.submit(ticket, workers).admitted
    (started,) = scheduler.dispatch(workers).started
    return started[1]


class TestWorkerChoice:
    """Which worker a request goes to: routable workers of its model (pools.py), the least
    loaded first (scheduling/scheduler.py)."""

    def test_fewest_in_flight_wins(self):
        workers = {"1": WorkerSlots(4, 3), "2": WorkerSlots(4, 1), "3": WorkerSlots(4, 2)}
        assert dispatch(PoolScheduler(TierPolicy()), workers) == "2"

    def test_local_count_overrides_stale_published_count(self):
        scheduler = PoolScheduler(TierPolicy())
        workers = {"1": WorkerSlots(4, 0), "2": WorkerSlots(4, 1)}
        for _ in range(3):  # ours, not in worker 1's published count yet
            assert dispatch(scheduler, workers, prefer="1") == "1"
        assert dispatch(scheduler, workers) == "2"

    def test_skips_draining_unhealthy_other_model_and_excluded(self):
        workers = [
            worker("1", draining=True),
            worker("2", healthy=False),
            worker("3", model="big"),
            worker("4", 3),
            worker("5"),
        ]
        gates = gates_over(workers)
        assert gates.idle_worker("tiny", "v").id == "5"
        assert gates.has_capacity("tiny", excluding={slot_key(workers[4])})  # worker 4 is left
        assert not gates.has_capacity("tiny", excluding={slot_key(workers[3]), slot_key(workers[4])})
        assert not gates_over(workers[:3]).has_capacity("tiny")


class TestSlotsBetweenMembershipChanges:
    """The pool gates reuse a pool's slots until the membership changes, while nothing but
    the records decides routability; a breaker or an unreachable mark counts at once."""

    def test_a_new_record_is_seen(self):
        gates = gates_over([worker("1"), worker("2")])
        assert gates._slots("tiny")[slot_key(worker("1"))].in_flight == 0
        gates.membership.replace(worker("1", in_flight=3))
        assert gates._slots("tiny")[slot_key(worker("1"))].in_flight == 3
        gates.membership.replace(worker("2", draining=True))
        assert slot_ids(gates) == {"1"}

    def test_an_opened_breaker_takes_the_worker_out_without_a_membership_change(self):
        clock = Clock()
        gates = gates_over([worker("1"), worker("2")], clock)
        assert slot_ids(gates) == {"1", "2"}
        open_breaker(gates, "1")
        assert slot_ids(gates) == {"2"}
        # Past the cool-down it is half-open: a probe may go.
        clock.now += gates.health.breakers.config.cooldown_s + 1
        assert slot_ids(gates) == {"1", "2"}

    def test_a_closed_breaker_brings_the_worker_back(self):
        clock = Clock()
        gates = gates_over([worker("1"), worker("2")], clock)
        open_breaker(gates, "1")
        assert slot_ids(gates) == {"2"}
        clock.now += gates.health.breakers.config.cooldown_s + 1
        board = gates.health.breakers
        while board.state("1") is not BreakerState.CLOSED:
            permit = board.try_acquire("1")
            assert permit is not None
            permit.record(Outcome.SUCCESS)
        assert board.all_closed()
        assert slot_ids(gates) == {"1", "2"}

    def test_an_unreachable_mark_counts_at_once_and_lapses(self):
        clock = Clock()
        gates = gates_over([worker("1"), worker("2")], clock)
        assert slot_ids(gates) == {"1", "2"}
        gates.health.mark_unreachable(worker("1"))
        assert slot_ids(gates) == {"2"}
        clock.now += gates.health.unreachable_hold_s
        assert gates.health.settled()
        assert slot_ids(gates) == {"1", "2"}


class TestBreakerBoardAllClosed:
    def test_follows_opening_and_forgetting(self):
        board = BreakerBoard(BreakerConfig(), clock=Clock())
        assert board.all_closed()
        while board.state("w") is BreakerState.CLOSED:
            board.try_acquire("w").record(Outcome.FAULT)
        assert not board.all_closed()
        board.retain([])
        assert board.all_closed()

    def test_a_forgotten_breakers_late_permit_keeps_nothing_out(self):
        board = BreakerBoard(BreakerConfig(), clock=Clock())
        permits = [board.try_acquire("w") for _ in range(50)]
        board.retain([])  # the worker left; its calls still end
        for permit in permits:
            permit.record(Outcome.FAULT)
        assert board.all_closed()
        assert board.available("w")


class TestIdempotentSampling:
    config = RouterConfig()

    def test_unseeded_sampling_gets_a_seed_stable_for_the_request_id(self):
        request = make_request(request_id="order-42", sampling=common_pb2.SamplingParams(temperature=0.8))
        first = request_from_pb(request, "acme", self.config)
        again = request_from_pb(request, "acme", self.config)
        assert first.sampling.seed is not None and first.sampling.seed == again.sampling.seed

    def test_derived_seed_differs_by_tenant_and_request(self):
        a = request_from_pb(
            make_request(request_id="r1", sampling=common_pb2.SamplingParams(temperature=1)), "acme", self.config
        )
        b = request_from_pb(
            make_request(request_id="r1", sampling=common_pb2.SamplingParams(temperature=1)), "other", self.config
        )
        c = request_from_pb(
            make_request(request_id="r2", sampling=common_pb2.SamplingParams(temperature=1)), "acme", self.config
        )
        assert len({a.sampling.seed, b.sampling.seed, c.sampling.seed}) == 3

    def test_client_seed_and_greedy_are_left_alone(self):
        seeded = request_from_pb(
            make_request(sampling=common_pb2.SamplingParams(temperature=1, seed=5)), "acme", self.config
        )
        greedy = request_from_pb(make_request(sampling=common_pb2.SamplingParams(temperature=0)), "acme", self.config)
        assert seeded.sampling.seed == 5
        assert greedy.sampling.seed is None
