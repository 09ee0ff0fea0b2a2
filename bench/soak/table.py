"""The soak's arithmetic: from what the clients saw and what the faults did, the table.

Everything here is pure: samples in, numbers out, so the table is unit-tested on made-up
samples. A request's latency counts only when it succeeded (a failure is counted as an error,
not as a fast answer); times are seconds since the phase began.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from bench.common import percentile
from bench.goals import LOWER, Goal

# A JSON answer's fate: valid as streamed; repaired by the server (the delivered document
# validates only after a repair, and a repair that filled in a value is still "repaired");
# failed (what the client got does not validate).
JSON_VALID, JSON_REPAIRED, JSON_FAILED = "valid", "repaired", "failed"


@dataclass
class RequestSample:
    session: str
    turn: int
    tier: str
    start: float
    end: float
    ok: bool
    ttft: float | None = None
    error: str = ""
    # Failed after its first token: the user saw an answer cut off.
    cut: bool = False
    degraded: bool = False
    json_outcome: str = ""
    tokens: int = 0
    # Times the stream moved (server-side resumes plus client retries with the same id).
    resumes: int = 0
    # What the client received, kept only for a JSON answer that failed its schema (the
    # evidence of why; bounded).
    failed_json: str = ""

    @property
    def e2e_ms(self) -> float:
        return (self.end - self.start) * 1000.0

    def overlaps(self, start: float, end: float) -> bool:
        return self.start <= end and self.end >= start


@dataclass
class FaultRecord:
    kind: str
    target: str
    injected_at: float
    # When the part it hit served again (None: not observed before the phase ended).
    recovered_at: float | None = None
    # How long the fault was held (a stall, a broker down); 0 for an instant one.
    held_s: float = 0.0
    note: str = ""

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.injected_at

    def window(self, phase_end: float) -> tuple[float, float]:
        return self.injected_at, self.recovered_at if self.recovered_at is not None else phase_end


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else math.nan


def session_interruption_rate(samples: Sequence[RequestSample]) -> float:
    """Sessions with a turn that failed (before or during its answer), over sessions seen."""
    sessions: dict[str, bool] = {}
    for sample in samples:
        sessions[sample.session] = sessions.get(sample.session, False) or not sample.ok
    return _rate(sum(sessions.values()), len(sessions))


def phase_row(
    samples: Sequence[RequestSample],
    unloaded_s: Sequence[RequestSample],
    scale_out_s: float | None,
    fragmentation: Sequence[float],
) -> dict:
    """One phase's line of the table. `unloaded_s`: the S requests sent before the load."""
    ok = [s for s in samples if s.ok]
    ok_s = [s for s in ok if s.tier == "S"]
    json_done = [s for s in samples if s.json_outcome]
    unloaded = [s.e2e_ms for s in unloaded_s if s.ok]
    s_p99, s_unloaded = percentile([s.e2e_ms for s in ok_s], 99), percentile(unloaded, 99)
    return {
        "requests": len(samples),
        "sessions": len({s.session for s in samples}),
        "p99_ms": percentile([s.e2e_ms for s in ok], 99),
        "p50_ms": percentile([s.e2e_ms for s in ok], 50),
        "ttft_p99_ms": percentile([s.ttft * 1000.0 for s in ok if s.ttft is not None], 99),
        "error_rate": _rate(sum(not s.ok for s in samples), len(samples)),
        "cut_rate": _rate(sum(s.cut for s in samples), len(samples)),
        "session_interruption_rate": session_interruption_rate(samples),
        "degraded_rate": _rate(sum(s.degraded for s in ok), len(ok)),
        "resumed_requests": sum(s.resumes > 0 for s in samples),
        # What the failures were, as the client saw them (gRPC status or exception type).
        "errors_by_kind": dict(Counter(s.error or "unknown" for s in samples if not s.ok)),
        "scale_out_s": math.nan if scale_out_s is None else scale_out_s,
        "s_tier_p99_ms": s_p99,
        "s_tier_unloaded_p99_ms": s_unloaded,
        "s_tier_ratio": s_p99 / s_unloaded if s_unloaded and not math.isnan(s_unloaded) else math.nan,
        "json_requests": len(json_done),
        "json_failure_rate": _rate(sum(s.json_outcome == JSON_FAILED for s in json_done), len(json_done)),
        "json_repaired_rate": _rate(sum(s.json_outcome == JSON_REPAIRED for s in json_done), len(json_done)),
        "kv_fragmentation": (sum(fragmentation) / len(fragmentation)) if fragmentation else math.nan,
    }


def fault_rows(samples: Sequence[RequestSample], faults: Iterable[FaultRecord], phase_end: float) -> dict:
    """Per fault type: how many were applied and observed, the requests in flight during
    each (from injection to recovery), how many of those failed or were cut off, and the
    recovery seconds (the worst and the median over that type's faults)."""
    by_kind: dict[str, list[FaultRecord]] = defaultdict(list)
    for fault in faults:
        by_kind[fault.kind].append(fault)
    rows = {}
    for kind, records in by_kind.items():
        hit: set[int] = set()
        for record in records:
            start, end = record.window(phase_end)
            hit.update(i for i, s in enumerate(samples) if s.overlaps(start, end))
        recoveries = sorted(r.recovery_s for r in records if r.recovery_s is not None)
        rows[kind] = {
            "applied": len(records),
            "observed": len(recoveries),
            "requests_hit": len(hit),
            "failed": sum(not samples[i].ok for i in hit),
            "interrupted": sum(samples[i].cut for i in hit),
            "recovery_s": recoveries[len(recoveries) // 2] if recoveries else math.nan,
            "recovery_max_s": recoveries[-1] if recoveries else math.nan,
        }
    return rows


def fault_table(baseline: dict, ballast: dict) -> dict:
    """{kind: {"baseline": row or None, "ballast": row or None}}: one row per fault type,
    both phases side by side (a fault one phase has no part for is None there)."""
    return {
        kind: {"baseline": baseline.get(kind), "ballast": ballast.get(kind)}
        for kind in sorted(set(baseline) | set(ballast))
    }


# Each row of the table: (key, what a reader sees, unit).
ROWS = (
    ("p99_ms", "p99 end to end", "ms"),
    ("ttft_p99_ms", "p99 time to first token", "ms"),
    ("error_rate", "client-visible errors", "%"),
    ("session_interruption_rate", "sessions interrupted", "%"),
    ("scale_out_s", "breach to added capacity serving", "s"),
    ("s_tier_p99_ms", "S-tier p99 end to end", "ms"),
    ("kv_fragmentation", "KV-cache fragmentation", "%"),
    ("json_failure_rate", "JSON answers failing their schema", "%"),
)

# Ballast's goals in absolute terms (the issue's), judged on the Ballast phase.
ABSOLUTE_GOALS = (
    Goal("Ballast error rate", "ballast_error_rate", 0.001, LOWER),
    Goal("Ballast sessions interrupted", "ballast_session_interruption_rate", 0.0, LOWER),
    Goal("Ballast S-tier p99 over its own unloaded p99", "ballast_s_tier_ratio", 1.3, LOWER, "x"),
    Goal("Ballast JSON answers failing their schema", "ballast_json_failure_rate", 0.0, LOWER),
    Goal("Ballast breach to added capacity serving", "ballast_scale_out_s", 5.0, LOWER, " s"),
)


# Rows a baseline may have no number for: vLLM's own server exports the share of KV blocks in
# use but not the tokens they hold, so its fragmentation cannot be computed from outside.
MAY_BE_UNMEASURED = ("kv_fragmentation",)


def compared_rows(baseline: dict) -> list[tuple[str, str, str]]:
    return [
        (key, label, unit) for key, label, unit in ROWS if not (key in MAY_BE_UNMEASURED and math.isnan(baseline[key]))
    ]


def comparison_goals(baseline: dict) -> tuple[Goal, ...]:
    """Ballast no worse than the baseline on every row the baseline has a number for: its
    value minus the baseline's at most 0 (a row where both are 0, such as no JSON failures
    on either side, is a tie)."""
    return tuple(
        Goal(f"{label}: Ballast minus baseline", f"vs_baseline_{key}", 0.0, LOWER)
        for key, label, _ in compared_rows(baseline)
    )


def measured_for_goals(baseline: dict, ballast: dict) -> dict:
    measured = {
        f"ballast_{key}": ballast[key]
        for key in ("error_rate", "session_interruption_rate", "s_tier_ratio", "json_failure_rate", "scale_out_s")
    }
    for key, _, _ in compared_rows(baseline):
        measured[f"vs_baseline_{key}"] = ballast[key] - baseline[key]
    return measured


def format_value(value: float, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit == "%":
        return f"{value * 100:.3g} %"
    if unit == "ms":
        return f"{value:.0f} ms"
    return f"{value:.2f} s"


def table_lines(baseline: dict, ballast: dict) -> list[tuple[str, str, str]]:
    """(row, baseline, Ballast) as text, for the printed table and the README."""
    return [(label, format_value(baseline[key], unit), format_value(ballast[key], unit)) for key, label, unit in ROWS]


def samples_to_json(samples: Sequence[RequestSample]) -> list[dict]:
    return [asdict(s) for s in samples]
