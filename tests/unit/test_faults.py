"""One fault taxonomy: a typed error's fault travels with its gRPC status, and `classify`
reads it the same way for failover, breakers, the degradation ladder and the backfill."""

import grpc
import pytest

from services.backfill.replay import ReplayErrorKind, replay_error
from services.common import errors
from services.common.errors import Draining, Fault, NoLiveWorker, RetryBudgetExhausted, Unavailable
from services.common.faults import REASON_KEY, Failure, classify, retry_after_hint, status_trailers
from services.common.grpc_server import bind, new_server
from services.router.degrade.ladder import Reason, degrade_reason
from services.router.resilience.failover import resume_reason
from services.router.resilience.breaker import is_connection_lost

S = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, trailers: tuple = (), details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


def answer(error) -> grpc.aio.AioRpcError:
    """The status a Ballast server sends for `error`."""
    return rpc_error(error.code, status_trailers(error), error.message)


def test_local_errors_classify_by_type():
    assert classify(Draining("x")) == Failure(S.UNAVAILABLE, Fault.DRAINING)
    assert classify(NoLiveWorker("x")) == Failure(S.UNAVAILABLE, Fault.NO_LIVE_WORKER)
    assert classify(RetryBudgetExhausted("x")) == Failure(S.UNAVAILABLE, Fault.RETRY_BUDGET_EXHAUSTED)
    assert classify(errors.InvalidArgument("x")) == Failure(S.INVALID_ARGUMENT, Fault.INVALID_ARGUMENT)
    assert classify(KeyError("bug")) is None and classify(None) is None


def test_remote_errors_classify_by_the_fault_they_carry_whatever_the_text():
    for error in (Draining("no such words"), NoLiveWorker("anything"), Unavailable("draining, really")):
        assert classify(answer(error)) == classify(error)
    # A status no Ballast server sent: UNAVAILABLE is the connection failing.
    assert classify(rpc_error(S.UNAVAILABLE, details="worker is draining")).fault is Fault.UNREACHABLE
    assert classify(rpc_error(S.INTERNAL)).fault is Fault.INTERNAL
    # An unknown fault name falls back to what the code says.
    assert classify(rpc_error(S.RESOURCE_EXHAUSTED, ((REASON_KEY, "new-reason"),))).fault is Fault.OVERLOADED


def test_retry_hint_travels_with_overload():
    error = answer(errors.ResourceExhausted("full", retry_after_s=0.25))
    assert retry_after_hint(error) == 0.25
    assert classify(error).fault is Fault.OVERLOADED
    assert retry_after_hint(answer(Unavailable("x"))) is None


def test_every_consumer_reads_the_same_faults():
    drained, unreachable = answer(Draining("bye")), rpc_error(S.UNAVAILABLE)
    assert resume_reason(drained) == "drained" and resume_reason(answer(Unavailable("x"))) == "worker_lost"
    assert is_connection_lost(unreachable) and not is_connection_lost(drained)
    assert degrade_reason(NoLiveWorker("x")) is Reason.NO_WORKER
    assert degrade_reason(RetryBudgetExhausted("x")) is Reason.RETRY_BUDGET
    assert degrade_reason(Draining("x")) is Reason.WORKER_FAILED
    assert degrade_reason(errors.InvalidArgument("x")) is None
    assert replay_error(answer(NoLiveWorker("x"))).kind is ReplayErrorKind.UNHEALTHY
    assert replay_error(unreachable).kind is ReplayErrorKind.UNHEALTHY
    assert replay_error(answer(RetryBudgetExhausted("x"))).kind is ReplayErrorKind.FAILED
    assert replay_error(answer(errors.ResourceExhausted("x"))).kind is ReplayErrorKind.BUSY


@pytest.mark.parametrize("error", [Draining("worker is draining"), errors.ResourceExhausted("full", 0.5)])
async def test_a_real_server_sends_the_fault(error):
    async def fail(request, context):
        raise error

    server = new_server()
    handler = grpc.method_handlers_generic_handler("test.Faults", {"Fail": grpc.unary_unary_rpc_method_handler(fail)})
    server.add_generic_rpc_handlers((handler,))
    port = bind(server, "127.0.0.1", 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/test.Faults/Fail")(b"", timeout=5)
        assert classify(caught.value) == classify(error)
        assert caught.value.details() == error.message
    finally:
        await server.stop(None)
