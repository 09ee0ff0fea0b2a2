"""Ballast services: router, worker, cache, backfill, and the code they share."""
