"""Degradation shared by router and backfill: the ladder, the rule engine, the durable Kafka
hand-off of degraded requests (SQLite outbox first, then an idempotent producer) and the
protobuf codecs both sides agree on."""
