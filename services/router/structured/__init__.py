"""Structured output in the router: check the request's JSON Schema, then validate and repair
the answer against it (VALID / REPAIRED / FAILED), and count the outcomes."""

from services.router.structured.metrics import StructuredMetrics
from services.router.structured.repair import (
    Repair,
    RepairKind,
    Status,
    StructuredResult,
    placeholder_answer,
    repair,
)
from services.router.structured.schema import Schema, check_schema

__all__ = [
    "Repair",
    "RepairKind",
    "Schema",
    "Status",
    "StructuredMetrics",
    "StructuredResult",
    "check_schema",
    "placeholder_answer",
    "repair",
]
