"""The soak's reading of each process's own waits from its metrics (bench.soak.ballast.stall_counts),
on the text a Ballast service's telemetry renders."""

from __future__ import annotations

from bench.soak.ballast import stall_counts
from services.common.config import TelemetryConfig
from services.common.telemetry import Telemetry


def test_counts_the_observations_past_each_bound():
    telemetry = Telemetry("worker", TelemetryConfig(enabled=False))
    for now, ms in enumerate((3, 1500, 800, 7000)):
        telemetry.loop_lag.record(ms, now=now)
    gaps = telemetry.latency_histogram("ballast_worker_engine_step_gap", "gaps")
    for ms in (250, 900, 5200, 12000, 4999):
        gaps.record(ms)
    counts = stall_counts(telemetry.render())
    telemetry.stop()
    assert counts == {"loop_lags_over_1s": 2, "loop_lags_over_5s": 1, "engine_gaps_over_5s": 2}


def test_a_router_has_no_engine_gaps():
    telemetry = Telemetry("router", TelemetryConfig(enabled=False))
    counts = stall_counts(telemetry.render())
    telemetry.stop()
    assert counts == {"loop_lags_over_1s": 0, "loop_lags_over_5s": 0}


def test_autoscaled_workers_are_found_by_their_last_ready_line(tmp_path):
    from bench.soak.ballast import autoscaled_metrics_ports

    (tmp_path / "primary-r1-1.log").write_text(
        "loading\nREADY worker 127.0.0.1:4001 metrics=5001\nrestarted by its keeper\n"
        "READY worker 127.0.0.1:4002 metrics=5002\n"
    )
    (tmp_path / "primary-r1-2.log").write_text("loading, never ready\n")
    assert autoscaled_metrics_ports(tmp_path) == {"primary-r1-1": 5002}
    assert autoscaled_metrics_ports(tmp_path / "absent") == {}
