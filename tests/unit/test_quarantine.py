"""Poison containment's pure parts: the fingerprint, the store and its clock, when a worker
lost counts against a request, the router's decision to quarantine, and how a quarantined
request is answered (not degraded, not retried, 422 over HTTP, parked by the backfill)."""

from __future__ import annotations

import grpc
import pytest

from ballast.v1 import backfill_pb2, common_pb2, inference_pb2
from services.backfill.parked import ParkedTicket, read_parked
from services.backfill.processor import Processor
from services.backfill.replay import ReplayErrorKind, replay_error
from services.backfill.settings import BackfillSettings
from services.common.errors import NoLiveWorker, Quarantined, WorkerLost
from services.common.faults import REASON_KEY, classify, status_trailers
from services.common.quarantine import (
    InvalidQuarantineEntry,
    QuarantineEntry,
    QuarantineStore,
    degraded_fingerprint,
    fingerprint,
    quarantine_key,
    request_fingerprint,
)
from services.router.degrade.ladder import RULES_RUNG, decide
from services.router.openai.errors import error_reply
from services.router.requests import InferenceRequest, Message
from services.router.resilience.breaker import Outcome, outcome_of
from services.router.resilience.quarantine import (
    Implication,
    Losses,
    LossTally,
    QuarantineConfig,
    RouterQuarantine,
    implication,
    incarnation_of,
)
from services.common.generation import Sampling


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def request(request_id="r1", tenant="acme", prompt=None, messages=(("user", "boom"),), schema=""):
    return InferenceRequest(
        request_id=request_id,
        session_id="",
        tenant=tenant,
        model="tiny",
        sampling=Sampling(max_tokens=8),
        tier="A",
        messages=tuple(Message(role, content) for role, content in messages),
        prompt=prompt,
        response_format=schema,
    )


def entry(fp="a" * 64, since=1000.0, ttl_s=60.0, **kw) -> QuarantineEntry:
    return QuarantineEntry(
        fingerprint=fp, tenant=kw.get("tenant", "acme"), reason="worker_lost", since=since, workers_lost=2, ttl_s=ttl_s
    )


# -- fingerprint ----------------------------------------------------------------------------


def test_the_fingerprint_ignores_the_request_id_and_keeps_tenant_input_and_schema_apart():
    base = request_fingerprint(request())
    assert request_fingerprint(request(request_id="retry-2")) == base
    assert len(base) == 64 and all(c in "0123456789abcdef" for c in base)
    assert request_fingerprint(request(tenant="other")) != base
    assert request_fingerprint(request(schema='{"type":"object"}')) != base
    assert request_fingerprint(request(messages=(("user", "boom!"),))) != base
    # A prompt is not the same input as a conversation holding that text.
    assert fingerprint("acme", "boom", (), "") != fingerprint("acme", None, [("user", "boom")], "")
    # Text cannot shift from one part into the next.
    assert fingerprint("ac", "meboom", (), "") != fingerprint("acme", "boom", (), "")


def test_the_backfill_reads_the_same_fingerprint_from_a_degraded_record():
    pb = inference_pb2.GenerateRequest(request_id="r9", model="tiny", response_format='{"type":"object"}')
    pb.conversation.messages.add(role="user", content="boom")
    record = backfill_pb2.DegradedRequest(ticket="bf1-" + "0" * 32, tenant="acme", request=pb)
    assert degraded_fingerprint(record) == request_fingerprint(request(schema='{"type":"object"}'))
    prompt_record = backfill_pb2.DegradedRequest(tenant="acme", request=inference_pb2.GenerateRequest(prompt="boom"))
    assert degraded_fingerprint(prompt_record) == request_fingerprint(request(prompt="boom", messages=()))


def test_the_etcd_key_and_entry_round_trip_without_prompt_text():
    assert quarantine_key("/ballast/", "ab" * 32) == "/ballast/quarantine/" + "ab" * 32
    held = entry()
    raw = held.to_json()
    assert QuarantineEntry.from_json(raw) == held
    assert b"boom" not in raw
    for bad in (
        b"not json",
        b"{}",
        b'{"fingerprint": "short", "tenant": "t", "reason": "r", "since": 1, "workers_lost": 2, "ttl_s": 5}',
    ):
        with pytest.raises(InvalidQuarantineEntry):
            QuarantineEntry.from_json(bad)


# -- the store ------------------------------------------------------------------------------


def test_the_store_holds_an_entry_until_its_ttl_lapses():
    clock = Clock(1000.0)
    store = QuarantineStore(clock=clock)
    assert store.is_empty()
    store.add(entry(since=1000.0, ttl_s=60.0))
    assert store.get("a" * 64) is not None and len(store) == 1
    clock.now = 1059.0
    assert store.remaining_s(store.get("a" * 64)) == pytest.approx(1.0)
    clock.now = 1060.0
    assert store.get("a" * 64) is None and len(store) == 0
    # One that lapsed before it arrived (an old etcd value) is not held at all.
    store.add(entry(since=900.0, ttl_s=60.0))
    assert store.is_empty()


def test_the_store_is_bounded_and_drops_the_entry_that_lapses_first():
    store = QuarantineStore(max_entries=2, clock=Clock(1000.0))
    store.add(entry("a" * 64, ttl_s=30))
    store.add(entry("b" * 64, ttl_s=10))
    store.add(entry("c" * 64, ttl_s=20))
    assert {e.fingerprint[0] for e in store.entries()} == {"a", "c"}
    store.remove("a" * 64)
    assert [e.fingerprint[0] for e in store.entries()] == ["c"]


def test_merging_a_snapshot_keeps_entries_held_only_here():
    store = QuarantineStore(clock=Clock(1000.0))
    store.add(entry("a" * 64))
    store.merge([entry("b" * 64)])
    assert len(store) == 2


# -- which losses count, and the decision -----------------------------------------------------


@pytest.mark.parametrize(
    "lost, tokens, accepted, confirm_asked, counts",
    [
        (True, 0, True, False, Implication.TAKEN_ON),  # died taking the request on: the request may be why
        (True, 5, True, False, Implication.NONE),  # died while streaming: the worker's fault, not each stream's
        # Lost before its accepted event was read: never had the call, or died faster than that.
        (True, 0, False, False, Implication.UNCONFIRMED),
        (True, 5, False, False, Implication.NONE),
        (False, 0, True, False, Implication.NONE),  # a live worker's error
        # Asked to confirm: its engine sees the request only after the router read the
        # accepted event, so lost before that the request cannot be why.
        (True, 0, False, True, Implication.NONE),
        (True, 0, True, True, Implication.TAKEN_ON),
    ],
)
def test_a_worker_lost_counts_against_a_request_only_when_it_died_before_a_token(
    lost, tokens, accepted, confirm_asked, counts
):
    assert implication(lost, tokens, accepted, confirm_asked) is counts


def test_a_request_is_queued_from_max_prefill_batch_requests_ahead_of_it():
    quarantine = RouterQuarantine(QuarantineConfig(max_prefill_batch=3))
    assert [quarantine.queued(ahead) for ahead in range(5)] == [False, False, False, True, True]


def test_a_loss_while_queued_is_excused_once_per_fingerprint_in_the_window():
    """Two faults in a row on a request that waited in both lines quarantine nothing: the first
    queued loss is excused, the second counts (1 of 2). A query of death that stood far back in
    every line still is quarantined, one worker later than at the head."""
    clock = Clock(1000.0)
    quarantine = RouterQuarantine(QuarantineConfig(ttl_s=600), clock=clock, monotonic=clock)
    queued = request("queued", messages=(("user", "where is it?"),))
    quarantine.worker_lost(queued, "worker_lost", "w1", queued=True)
    quarantine.worker_lost(queued, "stalled", "w2", queued=True)
    quarantine.check(queued)
    poison = request("poison")
    quarantine.worker_lost(poison, "worker_lost", "w1", queued=True)
    quarantine.worker_lost(poison, "worker_lost", "w2", queued=True)
    with pytest.raises(Quarantined) as refused:
        quarantine.worker_lost(poison, "worker_lost", "w3", queued=True)
    # Counted: the two losses after the excused one.
    assert "cost 2 workers" in refused.value.message


def test_the_excuse_comes_back_after_the_window_or_once_the_request_streamed():
    clock = Clock(0.0)
    tally = LossTally(window_s=600, max_entries=2, clock=clock)
    assert tally.excuse("fp") and not tally.excuse("fp")
    clock.now = 601.0
    assert tally.excuse("fp")
    assert tally.has_lost_workers("fp")  # its next attempts ask for a confirm, its first token forgives
    tally.forget("fp")  # forgiven: it streamed after a loss
    assert not tally.has_lost_workers("fp")
    assert tally.excuse("fp")
    assert tally.excuse("a") and tally.excuse("b")  # bounded: "fp" is forgotten first
    assert tally.excuse("fp")


def test_the_tally_forgets_losses_older_than_its_window_and_is_bounded():
    clock = Clock(0.0)
    tally = LossTally(window_s=10.0, max_entries=2, clock=clock)
    assert tally.add("x", "w1") == Losses(taken_on=1)
    clock.now = 5.0
    assert tally.add("x", "w2", taken_on=False) == Losses(taken_on=1, unconfirmed=1)
    assert tally.has_lost_workers("x") and not tally.has_lost_workers("y")
    clock.now = 16.0
    assert not tally.has_lost_workers("x")
    assert tally.add("x", "w3").total == 1
    tally.add("y", "w1")
    tally.add("z", "w1")
    assert len(tally) == 2
    assert tally.add("x", "w4").total == 1  # the stalest fingerprint was dropped


def test_the_tally_counts_a_worker_once_however_many_copies_it_lost_and_a_new_life_again():
    tally = LossTally(window_s=10.0, max_entries=10, clock=Clock(0.0))
    assert tally.add("x", "w1", taken_on=False, incarnation="a") == Losses(unconfirmed=1)
    for _ in range(50):  # fifty copies of one prompt in prefill when the worker died
        assert tally.add("x", "w1", taken_on=False, incarnation="a") == Losses(unconfirmed=1)
    # One copy it had taken on makes the worker's loss a confirmed one, still one loss.
    assert tally.add("x", "w1", taken_on=True, incarnation="a") == Losses(taken_on=1)
    assert tally.add("x", "w1", taken_on=False, incarnation="a") == Losses(taken_on=1)
    # Restarted under its keeper (a new lease) and killed again: another loss.
    assert tally.add("x", "w1", taken_on=True, incarnation="b") == Losses(taken_on=2)


def test_a_worker_lost_with_many_copies_of_a_popular_request_does_not_quarantine_it():
    quarantine = RouterQuarantine(QuarantineConfig(ttl_s=600), clock=Clock(1000.0), monotonic=Clock(0.0))
    for i in range(20):
        quarantine.worker_lost(request(f"copy-{i}"), "lease_lost", "w1", incarnation="7@1.000")
    quarantine.check(request("another-copy"))  # one worker lost: not quarantined
    # The same prompt taken on by a second worker that dies too: the second loss quarantines.
    with pytest.raises(Quarantined):
        quarantine.worker_lost(request("copy-20"), "worker_lost", "w2", incarnation="9@2.000")


def test_a_loss_is_keyed_by_the_worker_lease_and_start():
    class Record:
        lease_id = 0x2B
        started_at = 1700000000.25

    assert incarnation_of(Record()) == "2b@1700000000.250"


class Counter:
    def __init__(self) -> None:
        self.events: list[str] = []

    def add(self, amount, labels) -> None:
        self.events.append(labels["event"])


def test_a_request_is_quarantined_on_its_second_worker_lost_and_refused_under_a_new_id():
    counter = Counter()
    clock = Clock(1000.0)
    quarantine = RouterQuarantine(QuarantineConfig(ttl_s=600), counter=counter, clock=clock, monotonic=clock)
    poison = request("first")
    quarantine.check(poison)  # nothing held yet
    quarantine.worker_lost(poison, "worker_lost", "w1")  # the first loss: one more worker may try
    quarantine.check(poison)
    with pytest.raises(Quarantined) as refused:
        quarantine.worker_lost(poison, "worker_lost", "w2")
    assert refused.value.retry_after_s == pytest.approx(600)
    assert "boom" not in refused.value.message
    with pytest.raises(Quarantined):
        quarantine.check(request("retry-with-a-new-id"))
    quarantine.check(request("other", messages=(("user", "hello"),)))
    assert counter.events == ["quarantined", "refused"]
    clock.now += 600
    quarantine.check(request("after-the-ttl"))


def test_unconfirmed_losses_need_one_taken_on_to_quarantine():
    """A worker lost before its accepted event was read counts, but never quarantines alone: a
    cut network swallows every attempt unconfirmed. After any loss, the request's attempts ask
    their workers to confirm, so the next loss is known for sure."""
    clock = Clock(1000.0)
    quarantine = RouterQuarantine(QuarantineConfig(ttl_s=600), clock=clock, monotonic=clock)
    poison = request("first")
    assert not quarantine.wants_confirmation(poison)
    quarantine.worker_lost(poison, "worker_lost", "w1", taken_on=False)
    assert quarantine.wants_confirmation(request("retry-with-a-new-id"))
    assert not quarantine.wants_confirmation(request("other", messages=(("user", "hello"),)))
    quarantine.worker_lost(poison, "worker_lost", "w2", taken_on=False)
    quarantine.check(poison)  # two unconfirmed losses: not quarantined
    with pytest.raises(Quarantined):
        quarantine.worker_lost(poison, "worker_lost", "w3", taken_on=True)
    # An unconfirmed loss and then one taken on: two workers, quarantined.
    other = request("other", messages=(("user", "crash please"),))
    quarantine.worker_lost(other, "worker_lost", "w1", taken_on=False)
    with pytest.raises(Quarantined):
        quarantine.worker_lost(other, "worker_lost", "w2", taken_on=True)
    clock.now += 601
    assert not quarantine.wants_confirmation(poison)


def test_an_attempt_after_a_failed_one_asks_for_a_confirm_even_when_nothing_was_counted():
    """A stream lost mid-answer (its loss counts for nothing) and resumed may land on a worker
    dying in the same event: that attempt asks its worker to confirm, so losing it before the
    confirm counts for nothing either. A first attempt of a fresh request asks nothing."""
    clock = Clock(1000.0)
    quarantine = RouterQuarantine(QuarantineConfig(ttl_s=600), clock=clock, monotonic=clock)
    fresh = request("fresh")
    assert not quarantine.wants_confirmation(fresh)
    assert quarantine.wants_confirmation(fresh, follows_failure=True)
    assert len(quarantine.tally) == 0  # asking counts nothing against it
    disabled = RouterQuarantine(QuarantineConfig(enabled=False))
    assert not disabled.wants_confirmation(fresh, follows_failure=True)


def test_a_request_that_streams_after_a_loss_is_forgiven_and_a_poison_is_not():
    """A worker killed with several requests in prefill implicates each of them: when one of
    them (or a copy under a new id) then relays a token, its loss is forgiven, so a popular
    request is not quarantined after two such deaths. A poison relays no token in between."""
    clock = Clock(1000.0)
    quarantine = RouterQuarantine(QuarantineConfig(ttl_s=600), clock=clock, monotonic=clock)
    popular = request("first")
    quarantine.worker_lost(popular, "worker_lost", "w1")
    assert quarantine.wants_confirmation(popular)
    quarantine.passed(request("first"))  # its retry streamed on another worker
    assert not quarantine.wants_confirmation(popular)
    quarantine.worker_lost(request("later-copy"), "worker_lost", "w2")  # a copy, minutes later
    quarantine.check(request("yet-another-copy"))  # one loss in the tally: not quarantined
    # Forgiving one fingerprint forgives no other.
    poison = request("p", messages=(("user", "crash please"),))
    quarantine.worker_lost(poison, "worker_lost", "w3")
    quarantine.passed(request("x", messages=(("user", "hello"),)))
    with pytest.raises(Quarantined):
        quarantine.worker_lost(poison, "worker_lost", "w4")


def test_a_disabled_quarantine_never_refuses():
    quarantine = RouterQuarantine(QuarantineConfig(enabled=False, max_workers_lost=1))
    quarantine.worker_lost(request(), "stalled", "w1")
    quarantine.check(request())


# -- how the error travels ------------------------------------------------------------------


def test_a_quarantined_request_is_not_degraded_not_retried_and_not_a_worker_fault():
    error = Quarantined("quarantined", retry_after_s=12.5)
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and not error.retriable
    assert decide(error, True, (RULES_RUNG,)) is None
    assert outcome_of(error) is Outcome.IGNORE
    assert dict(status_trailers(error)) == {REASON_KEY: "quarantined", "retry-after-ms": "12500"}
    reply = error_reply(error)
    assert reply.status == 422 and reply.body["error"]["code"] == "quarantined"
    assert reply.headers["Retry-After"] == "13"


def test_a_worker_lost_under_a_request_still_degrades_but_is_not_no_live_worker():
    lost = WorkerLost("gone")
    assert classify(lost).fault is not classify(NoLiveWorker("none")).fault
    assert decide(lost, True, (RULES_RUNG,)) is not None


class RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, fault: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata((REASON_KEY, fault)), "details")


@pytest.mark.parametrize(
    "code, fault, kind",
    [
        (grpc.StatusCode.FAILED_PRECONDITION, "quarantined", ReplayErrorKind.QUARANTINED),
        (grpc.StatusCode.UNAVAILABLE, "worker_lost", ReplayErrorKind.FAILED),
        (grpc.StatusCode.UNAVAILABLE, "no_live_worker", ReplayErrorKind.UNHEALTHY),
    ],
)
def test_the_backfill_parks_quarantined_replays_and_counts_one_that_lost_its_worker(code, fault, kind):
    assert replay_error(RpcError(code, fault)).kind is kind


# -- the backfill parks poison before replaying it ----------------------------------------------


class Producer:
    resets = 0

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def renew_if_stale(self) -> bool:
        return False

    async def send(self, topic, value, key, headers) -> None:
        self.sent.append((topic, value))


class Replayer:
    def __init__(self) -> None:
        self.calls = 0

    async def replay(self, record):
        self.calls += 1
        raise AssertionError("a quarantined request must not be replayed")


class Parked:
    def __init__(self) -> None:
        self.added: list[tuple] = []

    async def add(self, *args) -> None:
        self.added.append(args)


async def test_a_quarantined_record_is_parked_without_a_replay():
    from services.backfill.consumer import Record

    pb = inference_pb2.GenerateRequest(request_id="r1", model="tiny")
    pb.conversation.messages.add(role="user", content="boom")
    degraded = backfill_pb2.DegradedRequest(
        ticket="bf1-" + "1" * 32, tenant="acme", request=pb, level=common_pb2.DEGRADATION_RULES
    )
    store = QuarantineStore()
    import time

    store.add(QuarantineEntry(degraded_fingerprint(degraded), "acme", "worker_lost", time.time(), 2, 600))
    producer, replayer, parked = Producer(), Replayer(), Parked()
    processor = Processor(
        BackfillSettings(), store=None, replayer=replayer, producer=producer, quarantine=store, parked=parked
    )
    record = Record("ballast.degraded", 0, 7, b"k", degraded.SerializeToString(), ())
    assert await processor._replay(record, degraded) is None
    assert replayer.calls == 0
    assert [topic for topic, _ in producer.sent] == [BackfillSettings().deadletter_topic]
    ticket, tenant, cause, attempts, _error = parked.added[0]
    assert (ticket, tenant, cause, attempts) == (degraded.ticket, "acme", "quarantined", 0)


def test_parked_entries_read_back_and_bad_values_are_skipped():
    good = ParkedTicket("bf1-x", "acme", "quarantined", 0, 5.0)
    assert read_parked([good.to_json().encode(), b"junk"]) == [good]


def test_status_lists_quarantined_fingerprints_and_parked_tickets_without_prompts():
    from services.cli.poison_view import describe

    lines = describe(
        [entry("f" * 64, since=900.0, ttl_s=600.0)],
        [ParkedTicket("bf1-abc", "acme", "quarantined", 0, 990.0)],
        now=1000.0,
    )
    assert lines[0] == "quarantine: 1 fingerprint(s) refused"
    assert "ffffffffffffffff" in lines[1] and "2 workers lost" in lines[1] and "500s left" in lines[1]
    assert lines[2].startswith("backfill parked (latest 1)") and "bf1-abc" in lines[3] and "quarantined" in lines[3]
    assert describe([], None)[-1] == "backfill parked: (redis not readable)"
    assert describe([], [])[-1] == "backfill parked: none"
