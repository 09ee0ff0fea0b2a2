"""The soak's result: a phase's outcome summarized into its row and fault rows, the latency
timeline, every request kept beside the result, and the table printed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from bench.common import percentile, print_table
from bench.soak.drive import PhaseOutcome, Plan
from bench.soak.faults import SURGE, settled_at
from bench.soak.table import FaultRecord, RequestSample, fault_rows, phase_row, table_lines
from bench.soak.traffic import Surge


def surge_record(outcome: PhaseOutcome, surge: Surge) -> FaultRecord:
    """The surge as a fault: from its start until the load had settled after it (TTFT p99
    back within twice what it was before the surge, no errors, over 5 s)."""
    before = [
        s.ttft * 1000.0
        for s in outcome.samples
        if s.ok and s.ttft is not None and surge.start_s - 30 <= s.start < surge.start_s
    ]
    reference = percentile(before, 99) if before else math.inf
    settled = settled_at(outcome.samples, surge.end_s, reference)
    return FaultRecord(SURGE, "traffic", surge.start_s, settled, surge.end_s - surge.start_s)


def summarize(outcome: PhaseOutcome, plan: Plan) -> tuple[dict, dict, list[FaultRecord]]:
    faults = [*outcome.faults, surge_record(outcome, plan.surge)]
    row = phase_row(outcome.samples, outcome.unloaded, outcome.scale_out_s, outcome.fragmentation)
    row["breach_at_s"] = outcome.breach_at
    row["cpu_s_by_part"] = outcome.cpu_s
    row["machine_busy_share"] = outcome.busy_share
    return row, fault_rows(outcome.samples, faults, plan.duration_s), faults


def timeline(samples: list[RequestSample], bucket_s: float = 5.0) -> list[dict]:
    """Per bucket of request starts: the e2e p99 of those that succeeded, requests, errors."""
    buckets: dict[int, list[RequestSample]] = {}
    for sample in samples:
        buckets.setdefault(int(sample.start // bucket_s), []).append(sample)
    return [
        {
            "t": index * bucket_s,
            "p99_ms": percentile([s.e2e_ms for s in group if s.ok], 99),
            "s_p99_ms": percentile([s.e2e_ms for s in group if s.ok and s.tier == "S"], 99),
            "requests": len(group),
            "errors": sum(not s.ok for s in group),
        }
        for index, group in sorted(buckets.items())
    ]


def samples_path(result_path: Path) -> Path:
    return result_path.with_name(result_path.stem + "_samples.json")


def write_samples(path: Path, baseline: PhaseOutcome, ballast: PhaseOutcome) -> Path:
    """Every request of both phases, unloaded and soak, one object each: what the table's
    rows are computed from, kept so a row can be explained after the run."""
    phases = {
        name: {"unloaded": [asdict(s) for s in outcome.unloaded], "soak": [asdict(s) for s in outcome.samples]}
        for name, outcome in (("baseline", baseline), ("ballast", ballast))
    }
    path.write_text(json.dumps(phases, separators=(",", ":")) + "\n")
    return path


def print_soak_table(baseline: dict, ballast: dict, faults: dict) -> None:
    print("\nthe table (same traffic, same faults)")
    print_table(["row", "plain baseline", "Ballast"], table_lines(baseline, ballast))
    rows = []
    for kind, pair in faults.items():
        for phase in ("baseline", "ballast"):
            row = pair[phase]
            if row is not None:
                rows.append(
                    [
                        kind,
                        phase,
                        row["applied"],
                        row["observed"],
                        row["requests_hit"],
                        row["failed"],
                        row["interrupted"],
                        row["recovery_s"],
                    ]
                )
    print("\nper fault type")
    print_table(["fault", "phase", "applied", "observed", "requests hit", "failed", "interrupted", "recovery s"], rows)
