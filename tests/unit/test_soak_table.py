"""The chaos soak's arithmetic: the table, the fault rows, the goals and the README block."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from bench.soak.drive import PhaseOutcome, rolling_ttft_p99
from bench.soak.result import surge_record, timeline
from bench.soak.clients import FAILED_JSON_CHARS, RoundRobinTransport, json_outcome, record_json
from bench.soak.readme import BEGIN, END, render, replace_block
from bench.soak.table import (
    ABSOLUTE_GOALS,
    JSON_FAILED,
    JSON_REPAIRED,
    JSON_VALID,
    FaultRecord,
    RequestSample,
    comparison_goals,
    fault_rows,
    fault_table,
    measured_for_goals,
    phase_row,
    session_interruption_rate,
)
from bench.goals import judge
from bench.soak.traffic import SCHEMAS, Surge


def sample(session="a", start=0.0, e2e_s=0.1, ok=True, tier="B", ttft=0.02, cut=False, json_outcome=""):
    return RequestSample(
        session=session,
        turn=0,
        tier=tier,
        start=start,
        end=start + e2e_s,
        ok=ok,
        ttft=ttft if ok or cut else None,
        cut=cut,
        json_outcome=json_outcome,
    )


def test_phase_row_counts_errors_sessions_tiers_and_json():
    samples = [
        sample("a", 0, 0.1),
        sample("a", 1, 0.2),
        sample("b", 2, 0.3, ok=False, cut=True),
        sample("c", 3, 0.05, tier="S"),
        sample("c", 4, 0.5, json_outcome=JSON_FAILED),
        sample("d", 5, 0.1, json_outcome=JSON_VALID),
        sample("d", 6, 0.1, json_outcome=JSON_REPAIRED),
        sample("e", 7, 1.0, ok=False),
    ]
    unloaded = [sample("u", 0, 0.025, tier="S"), sample("u", 1, 0.025, tier="S")]
    row = phase_row(samples, unloaded, scale_out_s=2.5, fragmentation=[0.1, 0.3])
    assert row["requests"] == 8 and row["sessions"] == 5
    assert row["error_rate"] == pytest.approx(2 / 8)
    assert row["cut_rate"] == pytest.approx(1 / 8)
    assert row["session_interruption_rate"] == pytest.approx(2 / 5)
    # Latency counts successes only: the 1 s failure is not the p99.
    assert row["p99_ms"] == pytest.approx(500)
    assert row["s_tier_p99_ms"] == pytest.approx(50)
    assert row["s_tier_unloaded_p99_ms"] == pytest.approx(25)
    assert row["s_tier_ratio"] == pytest.approx(2.0)
    assert row["json_requests"] == 3
    assert row["json_failure_rate"] == pytest.approx(1 / 3)
    assert row["json_repaired_rate"] == pytest.approx(1 / 3)
    assert row["scale_out_s"] == 2.5 and row["kv_fragmentation"] == pytest.approx(0.2)


def test_no_scale_out_and_no_samples_read_as_not_measured():
    row = phase_row([], [], scale_out_s=None, fragmentation=[])
    assert math.isnan(row["scale_out_s"]) and math.isnan(row["error_rate"]) and math.isnan(row["kv_fragmentation"])
    assert math.isnan(session_interruption_rate([]))


def test_fault_rows_count_requests_in_flight_from_injection_to_recovery():
    samples = [
        sample("a", 0, 1.0),
        sample("b", 4, 2.0, ok=False, cut=True),
        sample("c", 5.5, 0.2, ok=False),
        sample("d", 9, 0.5),
        sample("e", 20, 0.5),
    ]
    faults = [
        FaultRecord("worker_kill", "w1", injected_at=5.0, recovered_at=8.0),
        FaultRecord("worker_kill", "w2", injected_at=8.5, recovered_at=10.5),
        FaultRecord("kafka_down", "kafka", injected_at=18.0, recovered_at=None, held_s=5),
    ]
    rows = fault_rows(samples, faults, phase_end=30.0)
    kill = rows["worker_kill"]
    assert kill["applied"] == 2 and kill["observed"] == 2
    assert kill["requests_hit"] == 3 and kill["failed"] == 2 and kill["interrupted"] == 1
    assert kill["recovery_s"] == pytest.approx(3.0) and kill["recovery_max_s"] == pytest.approx(3.0)
    unobserved = rows["kafka_down"]
    assert unobserved["observed"] == 0 and math.isnan(unobserved["recovery_s"])
    assert unobserved["requests_hit"] == 1  # until the phase ended
    table = fault_table({"worker_kill": kill}, rows)
    assert table["kafka_down"]["baseline"] is None and table["worker_kill"]["baseline"] == kill


def _row(**values):
    base = {
        "p99_ms": 100.0,
        "ttft_p99_ms": 50.0,
        "error_rate": 0.0,
        "session_interruption_rate": 0.0,
        "scale_out_s": 1.0,
        "s_tier_p99_ms": 30.0,
        "kv_fragmentation": 0.05,
        "json_failure_rate": 0.0,
        "s_tier_ratio": 1.1,
    }
    return {**base, **values}


def test_goals_compare_every_row_and_judge_ballast_absolutely():
    baseline = _row(p99_ms=300.0, error_rate=0.02, scale_out_s=40.0, kv_fragmentation=math.nan)
    ballast = _row(s_tier_p99_ms=35.0)
    goals = comparison_goals(baseline)
    # vLLM's own server gives no fragmentation: that row is not compared.
    assert "vs_baseline_kv_fragmentation" not in {g.metric for g in goals}
    judged = judge((*ABSOLUTE_GOALS, *goals), measured_for_goals(baseline, ballast))
    by_metric = {g["metric"]: g for g in judged["goals"]}
    assert by_metric["vs_baseline_p99_ms"]["met"] and by_metric["vs_baseline_error_rate"]["met"]
    assert not by_metric["vs_baseline_s_tier_p99_ms"]["met"]  # 35 ms against 30 ms
    assert by_metric["vs_baseline_json_failure_rate"]["met"]  # a tie at 0
    assert by_metric["ballast_s_tier_ratio"]["met"] and not judged["met"]
    measured = comparison_goals(_row())
    assert "vs_baseline_kv_fragmentation" in {g.metric for g in measured}


def test_json_outcome_is_judged_against_the_schema_not_the_server():
    schema = SCHEMAS["ticket_triage"]
    assert json_outcome('{"category": "billing", "urgent": true}', schema) == JSON_VALID
    assert (
        json_outcome('{"category": "billing"', schema, repaired_document='{"category": "billing", "urgent": false}')
        == JSON_REPAIRED
    )
    assert json_outcome('{"category": "billing"', schema, repaired_document='{"category": 3}') == JSON_FAILED
    assert json_outcome('{"category": "food", "urgent": true}', schema) == JSON_FAILED
    assert json_outcome("anything", None) == ""


def test_a_sample_keeps_the_text_of_a_failed_json_answer_only():
    schema = SCHEMAS["ticket_triage"]
    failed, valid = sample(), sample()
    record_json(failed, '{"category": "food", "urgent": true}' + " " * 1000, schema)
    record_json(valid, '{"category": "billing", "urgent": true}', schema)
    assert failed.json_outcome == JSON_FAILED and failed.failed_json.startswith('{"category": "food"')
    assert len(failed.failed_json) == FAILED_JSON_CHARS
    assert valid.json_outcome == JSON_VALID and valid.failed_json == ""
    # What is kept is what failed: the server's repaired document when it sent one.
    repaired = sample()
    record_json(repaired, '{"category": "bil', schema, repaired_document='{"category": "bil", "urgent": false}')
    assert repaired.failed_json == '{"category": "bil", "urgent": false}'


def test_round_robin_transport_rotates_over_the_ports_in_rotation():
    seen = []
    transport = RoundRobinTransport()
    transport._inner = httpx.MockTransport(lambda request: (seen.append(request.url.port), httpx.Response(200))[1])

    async def send(count):
        async with httpx.AsyncClient(transport=transport) as client:
            for _ in range(count):
                await client.get("http://balanced/health")

    transport.set_ports([1001, 1002])
    asyncio.run(send(4))
    transport.set_ports([1003])
    asyncio.run(send(2))
    assert seen == [1001, 1002, 1001, 1002, 1003, 1003]
    transport.set_ports([])
    with pytest.raises(httpx.ConnectError):
        asyncio.run(send(1))


def test_rolling_p99_needs_enough_recent_samples():
    samples = [sample(start=t * 0.1, e2e_s=0.1, ttft=0.01 * (t + 1)) for t in range(20)]
    assert rolling_ttft_p99(samples, now=2.1) == pytest.approx(200)
    assert rolling_ttft_p99(samples[:5], now=2.1) is None
    assert rolling_ttft_p99(samples, now=30.0) is None  # nothing ended in the last 8 s


def test_timeline_and_surge_record():
    outcome = PhaseOutcome(samples=[sample(start=t, ttft=0.02) for t in range(0, 40)] + [sample(start=20.5, ok=False)])
    buckets = timeline(outcome.samples)
    assert [b["t"] for b in buckets] == [0, 5, 10, 15, 20, 25, 30, 35]
    assert buckets[4]["errors"] == 1 and buckets[4]["requests"] == 6
    plan = type("Plan", (), {"surge": Surge(15, 22, 3.0)})
    record = surge_record(outcome, plan.surge)
    assert record.kind == "surge" and record.injected_at == 15
    assert record.recovered_at == pytest.approx(27.0)  # 22-27 is the first clean 5 s window


def test_readme_block_is_rendered_from_the_result_and_replaced_in_place():
    result = {
        "engine": "vllm",
        "minutes": 10,
        "workers": 2,
        "sessions_planned": 120,
        "machine": {"cpus": 2},
        "commit": {"sha": "abcdef1234567"},
        "baseline": _row(error_rate=0.02),
        "ballast": {
            **_row(degraded_rate=0.1),
            "cpu_s_by_part": {"engine": 300.0, "router": 60.0, "etcd": 40.0},
            "machine_busy_share": 0.97,
        },
        "faults": {
            "worker_kill": {
                "baseline": {"requests_hit": 9, "failed": 3, "interrupted": 2, "recovery_s": 31.0},
                "ballast": {"requests_hit": 8, "failed": 0, "interrupted": 0, "recovery_s": 0.6},
            },
            "etcd_restart": {
                "baseline": None,
                "ballast": {"requests_hit": 2, "failed": 0, "interrupted": 0, "recovery_s": math.nan},
            },
        },
        "goals": [{"name": "Ballast error rate", "met": True}],
    }
    block = render(result)
    assert block.startswith(BEGIN) and block.endswith(END)
    assert "| client-visible errors | 2 % | 0 % |" in block
    assert "| worker kill | 9 hit, 3 failed, 2 cut off, recovered in 31 s |" in block
    assert "| etcd restart | no such part | 2 hit, 0 failed, 0 cut off, not seen serving again |" in block
    assert "abcdef1234" in block and "Every goal met." in block
    assert "Ballast answered 10 % of its successful requests degraded" in block
    assert "plain not measured" in block
    assert "Ballast 400 CPU-s, of which the engines 300 (75%); router 60, etcd 40; cores busy 97 %" in block
    readme = f"# Ballast\n\nintro\n\n{BEGIN}\nold\n{END}\n\nrest\n"
    updated = replace_block(readme, block)
    assert updated.startswith("# Ballast\n\nintro\n\n") and updated.endswith("\n\nrest\n") and "old" not in updated
    assert replace_block(updated, block) == updated
    with pytest.raises(ValueError):
        replace_block("no block here", block)
    json.dumps(result)  # the result stays plain JSON
