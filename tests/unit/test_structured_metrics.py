"""StructuredMetrics: outcomes by status and repairs by kind."""

from __future__ import annotations

import json

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.router.structured import StructuredMetrics, check_schema, repair

SCHEMA = check_schema(
    json.dumps(
        {
            "type": "object",
            "properties": {"price": {"type": "number"}, "id": {"type": "string"}},
            "required": ["price", "id"],
            "additionalProperties": False,
        }
    )
)


def test_outcomes_and_repair_kinds_are_counted():
    reader = InMemoryMetricReader()
    metrics = StructuredMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    for text in ('{"price": 1, "id": "a"}', '{"price": "2", "x": 1', "no json at all"):
        metrics.record(repair(text, SCHEMA), model="tiny", schema=SCHEMA.name)
    points = {
        m.name: sorted((tuple(sorted(p.attributes.items())), p.value) for p in m.data.data_points)
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert points["ballast_structured_outcomes"] == [
        ((("model", "tiny"), ("schema", SCHEMA.name), ("status", status)), 1)
        for status in ("failed", "repaired", "valid")
    ]
    kinds = {dict(labels)["kind"]: n for labels, n in points["ballast_structured_repairs"]}
    assert kinds == {"truncated": 1, "coerced": 1, "dropped": 1, "filled": 1}


def test_schema_label_is_its_title_or_a_short_hash():
    from services.router.structured import check_schema

    assert check_schema('{"title": "product", "type": "object"}').name == "product"
    unnamed = check_schema('{"type": "object"}').name
    assert unnamed.startswith("sha256:") and len(unnamed) == len("sha256:") + 12
