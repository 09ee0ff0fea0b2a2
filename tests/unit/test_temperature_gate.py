"""Temperature gate (hot at the limit, cool only below the lower mark) and the health view."""

import pytest
from pydantic import ValidationError

from services.common.membership import WorkerRecord
from services.router.resilience.breaker import BreakerBoard, BreakerConfig, Outcome
from services.router.resilience.health_view import Unroutable, WorkerHealthView
from services.router.resilience.temperature import TemperatureConfig, TemperatureGate
from tests.unit.fake_clock import FakeClock


def test_hysteresis():
    gate = TemperatureGate(TemperatureConfig())
    readings = [70, 77.9, 78, 77, 75, 74.9, 76, 78.5, 60]
    hot = [gate.observe("w1", t) for t in readings]
    assert hot == [False, False, True, True, True, False, False, True, False]


def test_missing_or_unusable_reading_is_cool():
    gate = TemperatureGate(TemperatureConfig())
    assert gate.observe("w1", 90)
    assert not gate.observe("w1", None)
    assert gate.observe("w1", 90)
    assert not gate.observe("w1", float("nan"))
    assert not gate.is_hot("unknown")


def test_workers_are_independent_and_forgotten():
    gate = TemperatureGate(TemperatureConfig(limit_c=80, resume_below_c=70))
    gate.observe("w1", 85)
    gate.observe("w2", 79)
    gate.observe("w3", 81)
    assert gate.hot_workers() == {"w1", "w3"}
    gate.retain(["w1", "w2"])
    assert gate.hot_workers() == {"w1"}


@pytest.mark.parametrize("fields", [{"limit_c": 75, "resume_below_c": 75}, {"limit_c": 70}])
def test_marks_must_be_ordered(fields):
    with pytest.raises(ValidationError):
        TemperatureConfig(**fields)


def worker(worker_id: str, **fields) -> WorkerRecord:
    return WorkerRecord(id=worker_id, address=f"{worker_id}:1", model="tiny", model_version="v1", **fields)


def make_view(clock: FakeClock) -> WorkerHealthView:
    return WorkerHealthView(
        BreakerBoard(BreakerConfig(min_requests=1, half_open_probes=1), clock), TemperatureGate(TemperatureConfig())
    )


class TestHealthView:
    def test_reasons(self):
        clock = FakeClock()
        view = make_view(clock)
        workers = {
            w.id: w
            for w in [
                worker("ok", temperature_c=None),
                worker("sick", healthy=False),
                worker("leaving", draining=True),
                worker("hot", temperature_c=80.0),
                worker("broken"),
            ]
        }
        view.update(workers)
        view.acquire("broken").record(Outcome.FAULT)
        reasons = {w.id: view.reason(w) for w in workers.values()}
        assert reasons == {
            "ok": None,
            "sick": Unroutable.UNHEALTHY,
            "leaving": Unroutable.DRAINING,
            "hot": Unroutable.HOT,
            "broken": Unroutable.BREAKER_OPEN,
        }
        assert [w.id for w in view.routable(workers.values())] == ["ok"]
        status = view.snapshot(workers)
        assert status["broken"].as_dict()["breaker"]["state"] == "open"
        assert status["hot"].as_dict()["reason"] == "hot" and status["hot"].hot
        assert status["ok"].routable and status["ok"].breaker is None

    def test_hot_worker_returns_below_the_lower_mark(self):
        view = make_view(FakeClock())
        view.update({"w": worker("w", temperature_c=78.0)})
        view.update({"w": worker("w", temperature_c=76.0)})
        assert not view.is_routable(worker("w", temperature_c=76.0))
        view.update({"w": worker("w", temperature_c=74.0)})
        assert view.is_routable(worker("w", temperature_c=74.0))

    def test_half_open_worker_takes_one_probe_at_a_time(self):
        clock = FakeClock()
        view = make_view(clock)
        w = worker("w")
        view.acquire("w").record(Outcome.FAULT)
        clock.advance(5)
        assert view.is_routable(w)
        probe = view.acquire("w")
        assert view.reason(w) is Unroutable.PROBES_BUSY and view.acquire("w") is None
        probe.record(Outcome.SUCCESS)
        assert view.is_routable(w)

    def test_departed_workers_are_forgotten(self):
        view = make_view(FakeClock())
        view.update({"a": worker("a", temperature_c=90.0), "b": worker("b")})
        view.acquire("b").record(Outcome.FAULT)
        view.update({})
        assert len(view.breakers) == 0 and view.temperature.hot_workers() == frozenset()
