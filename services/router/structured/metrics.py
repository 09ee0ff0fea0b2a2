"""Metrics of structured output: outcomes by status and schema, repairs by kind."""

from __future__ import annotations

from opentelemetry.metrics import Meter

from services.router.structured.repair import StructuredResult


class StructuredMetrics:
    def __init__(self, meter: Meter) -> None:
        self.outcomes = meter.create_counter(
            "ballast_structured_outcomes",
            description="Answers with a response_format, by status (valid, repaired, failed).",
        )
        self.repairs = meter.create_counter(
            "ballast_structured_repairs",
            description="Repairs made to structured answers, by kind "
            "(extracted, syntax, truncated, filled, coerced, dropped).",
        )

    def record(self, result: StructuredResult, model: str = "", schema: str = "") -> None:
        self.outcomes.add(1, {"status": result.status.value, "model": model, "schema": schema})
        counts: dict[str, int] = {}
        for change in result.repairs:
            counts[change.kind.value] = counts.get(change.kind.value, 0) + 1
        for kind, n in counts.items():
            self.repairs.add(n, {"kind": kind, "model": model})
