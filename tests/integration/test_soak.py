"""A short chaos soak end to end (`python -m bench.soak --engine torch --minutes 1`): both
phases on real processes (plain torch servers behind the balancer; the local mesh with two
routers, etcd, Redis and the Kafka broker), every fault of the schedule applied and observed
to recover, and the table written with its shape. The soak's numbers are a benchmark's, not
this test's: it checks that the machinery measures, not what it measured."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench.soak.faults import MESH_FAULTS, SURGE, WORKER_FAULTS, WORKER_KILL, fault_schedule
from bench.soak.table import ROWS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MINUTES, SEED = 1.0, 7
# Low enough that a fault which stops a server's tokens for a second or more breaches it on any
# machine (the tiny model answers in tens of milliseconds), so each phase's scale-out is run.
TARGET_MS = 250
PHASE_KEYS = {
    "p99_ms",
    "error_rate",
    "session_interruption_rate",
    "scale_out_s",
    "s_tier_p99_ms",
    "json_failure_rate",
    "ttft_p99_ms",
    "kv_fragmentation",
    "requests",
    "sessions",
}


@pytest.fixture(scope="module")
def soak(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--engine",
            "torch",
            "--model-dir",
            str(tiny_model_dir),
            "--minutes",
            str(MINUTES),
            "--unloaded-s",
            "8",
            "--rate",
            "0.3",
            "--target-ms",
            str(TARGET_MS),
            "--seed",
            str(SEED),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode in (0, 1), f"the soak failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    return json.loads(out.read_text()), out, run.stdout


def test_the_table_has_both_phases_every_row_and_a_row_per_fault(soak):
    result, out, stdout = soak
    for phase in ("baseline", "ballast"):
        assert PHASE_KEYS <= set(result[phase]), phase
        assert result[phase]["requests"] > 50 and result[phase]["sessions"] > 5
        assert 0 <= result[phase]["error_rate"] <= 1
    assert set(result["faults"]) == set(WORKER_FAULTS + MESH_FAULTS + (SURGE,))
    for kind, pair in result["faults"].items():
        assert pair["ballast"] is not None
        assert (pair["baseline"] is not None) == (kind in WORKER_FAULTS + (SURGE,)), kind
    assert [row[0] for row in result["table"]] == [label for _, label, _ in ROWS]
    assert {g["metric"] for g in result["goals"]} >= {"ballast_error_rate", "vs_baseline_p99_ms"}
    assert result["commit"]["sha"] and result["machine"]["cpus"] >= 1
    assert out.with_name("soak_latency.png").stat().st_size > 10_000
    # Where the CPU went: the baseline's servers; Ballast's workers, routers and the rest.
    assert {"server front", "clients"} <= set(result["baseline"]["cpu_s_by_part"])
    assert {"worker front", "router", "cache", "clients"} <= set(result["ballast"]["cpu_s_by_part"])
    assert 0 < result["ballast"]["machine_busy_share"] <= 1
    samples = json.loads(out.with_name("soak_samples.json").read_text())
    for phase in ("baseline", "ballast"):
        assert len(samples[phase]["soak"]) == result[phase]["requests"]
        assert {s["tier"] for s in samples[phase]["unloaded"]} == {"S"}
    assert "the table (same traffic, same faults)" in stdout


def test_every_scheduled_fault_was_applied_and_observed_to_recover(soak):
    result, _, _ = soak
    duration = MINUTES * 60
    for phase, kinds in (("baseline", WORKER_FAULTS), ("ballast", WORKER_FAULTS + MESH_FAULTS)):
        schedule = fault_schedule(SEED, duration, kinds)
        log = [f for f in result["fault_log"][phase] if f["kind"] != SURGE]
        assert [f["kind"] for f in log] == [f.kind for f in schedule], phase
        for fault, planned in zip(log, schedule):
            # Applied no earlier than planned (one fault waits for the previous to recover).
            assert fault["injected_at"] >= planned.at_s - 0.5
            assert fault["recovered_at"] is not None, f"{phase} {fault['kind']} not observed to recover"
            assert fault["recovered_at"] >= fault["injected_at"] + fault["held_s"]
        assert sum(f["kind"] == WORKER_KILL for f in log) == 3
        assert result["faults"][WORKER_KILL][phase]["applied"] == 3


def test_a_breach_was_followed_by_capacity_serving(soak):
    result, _, _ = soak
    # The stalled server (6 s without a token) and the killed ones breach the baseline clients'
    # p99: it scales out.
    assert result["baseline"]["breach_at_s"] is not None
    for phase in ("baseline", "ballast"):
        if result[phase]["breach_at_s"] is not None:
            assert not math.isnan(result[phase]["scale_out_s"]), phase
