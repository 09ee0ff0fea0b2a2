"""A worker says in its metrics and its log why its streams waited: an engine that did not step
(ballast_worker_engine_stalled_ms, ballast_worker_engine_step_gap) or an event loop that could
not run (ballast_event_loop_lag, ballast_event_loop_lag_worst_ms).

An in-process sim worker against a real etcd. The engine is hung once its stream's first
token has reached the client, and let go once the worker's own gauge says requests waited
past the warning threshold; the loop is held by the test itself (it shares the worker's loop).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
import pytest_asyncio

from ballast.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.worker.app import create_server as create_worker
from services.worker.sim import SimFaults
from tests.component.conftest import make_config
from tests.integration.test_mesh import metric_value

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(120)]

STALL_WARN_S = 0.5
LOOP_WARN_MS = 300
READ_EVERY_S = 0.05
TOKENS = 256


@pytest_asyncio.fixture(loop_scope="session")
async def sim_worker(etcd_server, tiny_model_dir, etcd_prefix):
    config = make_config(
        etcd_server,
        tiny_model_dir,
        etcd_prefix,
        BALLAST__WORKER__ENGINE="sim",
        BALLAST__WORKER__ENGINE_WATCH_INTERVAL_S=str(READ_EVERY_S),
        BALLAST__WORKER__ENGINE_STALL_WARN_S=str(STALL_WARN_S),
        BALLAST__TELEMETRY__LOOP_LAG_INTERVAL_S=str(READ_EVERY_S),
        BALLAST__TELEMETRY__LOOP_LAG_WARN_MS=str(LOOP_WARN_MS),
    )
    app = await create_worker(config)
    yield app
    await app.shutdown(grace_s=1.0)


def metrics(app) -> str:
    return app.telemetry.render()


def gaps_over(text: str, name: str, bound_ms: float) -> float:
    """Observations of histogram `name` above `bound_ms` (a bucket boundary)."""
    return metric_value(text, f"{name}_count") - metric_value(text, f"{name}_bucket", le=f"{bound_ms:g}")


async def until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(READ_EVERY_S)


async def test_an_engine_that_stops_stepping_is_measured_and_logged(sim_worker, caplog):
    caplog.set_level(logging.WARNING, logger="services.worker.engine_watch")
    step_gap = "ballast_worker_engine_step_gap_milliseconds"
    assert gaps_over(metrics(sim_worker), step_gap, 500) == 0
    request = worker_pb2.WorkerGenerateRequest(
        request_id="stall-metrics",
        prompt_ids=[1, 2, 3, 4],
        sampling=common_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0),
    )
    tokens = 0
    async with grpc.aio.insecure_channel(sim_worker.address, options=CHANNEL_OPTIONS) as channel:
        async for event in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=60):
            if not event.HasField("tokens"):
                continue
            if tokens == 0:
                sim_worker.engine.set_faults(SimFaults(hang=True))
                await until(
                    lambda: (
                        metric_value(metrics(sim_worker), "ballast_worker_engine_stalled_ms")
                        >= STALL_WARN_S * 1000 + 100
                    ),
                    "the worker's gauge saw its request wait past the warning threshold",
                )
                sim_worker.engine.set_faults(SimFaults())
            tokens += len(event.tokens.token_ids)
    assert tokens == TOKENS
    text = metrics(sim_worker)
    # The hang was one gap of more than half a second between steps; the steps around it were not.
    assert gaps_over(text, step_gap, 500) == 1
    assert metric_value(text, f"{step_gap}_count") >= 2
    await until(
        lambda: metric_value(metrics(sim_worker), "ballast_worker_engine_stalled_ms") == 0,
        "the gauge, once the watch read the worker idle, says nothing waits",
    )
    warnings = [r.getMessage() for r in caplog.records if r.name == "services.worker.engine_watch"]
    assert len(warnings) == 1 and "computed no step" in warnings[0]


async def test_a_held_event_loop_is_measured_and_logged(sim_worker, caplog):
    caplog.set_level(logging.WARNING, logger="services.common.loop_lag")
    await until(
        lambda: metric_value(metrics(sim_worker), "ballast_event_loop_lag_milliseconds_count") > 0,
        "the worker measured its loop",
    )
    # Held here, on the worker's own loop: its timer, due within READ_EVERY_S, fires at least
    # 0.6 - READ_EVERY_S s late.
    time.sleep(0.6)
    await until(
        lambda: metric_value(metrics(sim_worker), "ballast_event_loop_lag_worst_ms") >= 500,
        "the worker's worst lag shows the held loop",
    )
    assert gaps_over(metrics(sim_worker), "ballast_event_loop_lag_milliseconds", 500) >= 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "services.common.loop_lag"]
    assert warnings and "s late" in warnings[0]
