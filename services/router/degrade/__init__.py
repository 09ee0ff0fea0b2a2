"""The router's degradation: the ladder (primary pool, light-model pool, rule engine), the
rule engine, and the durable hand-off of degraded requests (SQLite outbox first, then an
idempotent Kafka producer) for the backfill service."""
