"""The backfill service: replays degraded requests on the full model."""
