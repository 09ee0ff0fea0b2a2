"""Kafka topics and record headers of the degradation and backfill flow."""

from __future__ import annotations

# Degraded requests, written by routers (key: session id, or the ticket without a session).
DEGRADED_TOPIC = "ballast.degraded.v1"
# Better answers, written by the backfill service after storing them (key: session id / ticket).
BACKFILLED_TOPIC = "ballast.backfilled.v1"
# Degraded requests the backfill service gave up on, with why in the headers.
DEADLETTER_TOPIC = "ballast.degraded.dlq.v1"

# Every record says what it holds, so a consumer in any language can decode it.
CONTENT_TYPE_HEADER = "content-type"
DEGRADED_CONTENT_TYPE = b"application/x-protobuf; messageType=ballast.v1.DegradedRequest"
BACKFILLED_CONTENT_TYPE = b"application/x-protobuf; messageType=ballast.v1.BackfilledAnswer"

# Dead-letter headers: the error, the attempts made and where the record came from.
DLQ_ERROR_HEADER = "ballast-error"
DLQ_ATTEMPTS_HEADER = "ballast-attempts"
DLQ_SOURCE_HEADER = "ballast-source"
