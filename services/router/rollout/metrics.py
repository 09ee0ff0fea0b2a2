"""Rollout metrics: requests per version, mirror comparisons, gate decisions, rejected documents."""

from __future__ import annotations

from opentelemetry.metrics import Meter

from services.common.telemetry import LATENCY_BUCKETS_MS

SHARE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class RolloutMetrics:
    def __init__(self, meter: Meter) -> None:
        self.version_requests = meter.create_counter(
            "ballast_rollout_version_requests",
            description="Requests routed during a rollout, by model, version and role (stable, candidate).",
        )
        self.fallbacks = meter.create_counter(
            "ballast_rollout_version_fallbacks",
            description="Requests moved to the other version before their first token, by model and role left.",
        )
        self.mirrors = meter.create_counter(
            "ballast_rollout_mirror_requests",
            description="Mirrored copies by model and outcome (compared, candidate_error, "
            "dropped_busy, dropped_no_worker, primary_failed).",
        )
        self.mirror_latency = meter.create_histogram(
            "ballast_rollout_mirror_ttft",
            unit="ms",
            description="Time to first token of mirrored requests, by model and side (primary, candidate).",
            explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS_MS),
        )
        self.token_agreement = meter.create_histogram(
            "ballast_rollout_mirror_token_agreement",
            description="Share of token positions where the candidate's answer equals the primary's.",
            explicit_bucket_boundaries_advisory=list(SHARE_BUCKETS),
        )
        self.business_score = meter.create_histogram(
            "ballast_rollout_mirror_business_score",
            description="Score of the candidate's answer against the primary's from the business hook.",
        )
        self.decisions = meter.create_counter(
            "ballast_rollout_gate_decisions",
            description="SLO gate decisions by model, decision (promote, rollback) and whether "
            "this router wrote it (written) or found it made (lost_race).",
        )
        self.rejected = meter.create_counter(
            "ballast_rollout_rejected_documents",
            description="Invalid rollout documents seen in etcd (the previous rollout stays), by model.",
        )
