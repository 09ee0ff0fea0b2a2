"""A worker the router could not reach gets no new work until etcd replaces or drops it, or the
hold lapses; only connection failures and lost leases count (they also spare the worker's
breaker), not the worker's own error answers."""

import grpc
import pytest

from services.common.errors import BallastError, Draining, ResourceExhausted, Unavailable
from services.common.faults import status_trailers
from services.common.membership import WorkerRecord
from services.router.resilience.failover import WorkerLeaseLost, worker_gone
from services.router.resilience.breaker import BreakerBoard, BreakerConfig, is_connection_lost
from services.router.resilience.health_view import Unroutable, WorkerHealthView
from services.router.resilience.temperature import TemperatureConfig, TemperatureGate
from tests.unit.fake_clock import FakeClock


def record(worker_id: str, lease_id: int) -> WorkerRecord:
    worker = WorkerRecord(id=worker_id, address=f"{worker_id}:1", model="tiny", model_version="v1")
    worker.lease_id = lease_id
    return worker


def view(clock: FakeClock) -> WorkerHealthView:
    return WorkerHealthView(
        BreakerBoard(BreakerConfig(), clock), TemperatureGate(TemperatureConfig()), unreachable_hold_s=10.0, clock=clock
    )


def test_marked_incarnation_is_out_until_the_hold_lapses():
    clock = FakeClock(100.0)
    health = view(clock)
    dead, other = record("w1", 7), record("w2", 9)
    health.mark_unreachable(dead)
    assert health.reason(dead) is Unroutable.UNREACHABLE
    assert health.routable([dead, other]) == [other]
    clock.advance(9.9)
    assert not health.is_routable(dead)
    clock.advance(0.2)
    assert health.is_routable(dead)  # tried again: a passing network fault must not last


def test_the_same_worker_restarted_with_a_new_lease_is_routable_at_once():
    clock = FakeClock(100.0)
    health = view(clock)
    health.mark_unreachable(record("w1", 7))
    assert health.is_routable(record("w1", 8))
    # The mark belonged to the old incarnation and is gone for good.
    assert health.is_routable(record("w1", 7))


def test_leaving_membership_forgets_the_mark_and_success_clears_it():
    clock = FakeClock(100.0)
    health = view(clock)
    dead = record("w1", 7)
    health.mark_unreachable(dead)
    health.update({})
    assert health.is_routable(dead)
    health.mark_unreachable(dead)
    health.mark_reachable(dead)
    assert health.is_routable(dead)


def rpc_error(code: grpc.StatusCode, details: str, trailers: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


def worker_answer(error: BallastError) -> grpc.aio.AioRpcError:
    """The status a worker sends for `error`, trailers included."""
    return rpc_error(error.code, error.message, status_trailers(error))


@pytest.mark.parametrize(
    "details",
    [
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:5: Connection refused",
        "Stream removed (Socket closed)",
        "Stream removed (recvmsg:Connection reset by peer (104))",
        "Socket closed",
    ],
)
def test_connection_failures_count(details):
    assert is_connection_lost(rpc_error(grpc.StatusCode.UNAVAILABLE, details))
    assert worker_gone(rpc_error(grpc.StatusCode.UNAVAILABLE, details))


@pytest.mark.parametrize(
    "error",
    [
        worker_answer(Draining("worker is draining")),
        worker_answer(Unavailable("torch engine is stopping")),
        worker_answer(ResourceExhausted("worker full: 4 in flight, capacity 4")),
        rpc_error(grpc.StatusCode.INTERNAL, "Socket closed"),
    ],
)
def test_answers_from_the_worker_do_not(error):
    assert not is_connection_lost(error)
    assert not worker_gone(error)


def test_a_lost_lease_means_the_worker_is_gone():
    assert worker_gone(WorkerLeaseLost("worker w1 left membership"))
    assert not worker_gone(Unavailable("stream ended without finishing"))
