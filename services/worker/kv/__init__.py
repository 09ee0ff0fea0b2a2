"""Session KV persistence for workers: restore a session's prefix from the cache service
instead of recomputing it, and save each turn's KV blocks in the background.

`start_session_kv` wires it into a worker: metrics always (the engine's in-memory session
reuse reports through them), and a `SessionKV` client when `worker.cache_address` is set.
"""

from __future__ import annotations

import logging
from typing import Any

from services.cache.client import KVCacheClient
from services.common.telemetry import Telemetry
from services.common.tls.settings import TLSConfig
from services.worker.engine import ChunkedPrefill, KvAttachable
from services.worker.kv.metrics import KVMetrics
from services.worker.kv.session import DEPENDENCY, KVSettings, SessionKV

__all__ = ["DEPENDENCY", "KVMetrics", "KVSettings", "SessionKV", "start_session_kv"]

log = logging.getLogger(__name__)


async def start_session_kv(
    worker_config: Any, engine: Any, telemetry: Telemetry, health: Any = None, tls: TLSConfig | None = None
) -> SessionKV | None:
    """Attaches KV metrics (and persistence, when configured) to an engine that supports it."""
    if not isinstance(engine, KvAttachable):
        if worker_config.cache_address:
            log.warning("engine %s cannot persist KV; worker.cache_address is ignored", type(engine).__name__)
        return None
    metrics = KVMetrics(telemetry)
    session = None
    if worker_config.cache_address:
        session = SessionKV(
            KVCacheClient(worker_config.cache_address, tls=tls),
            KVSettings.from_worker_config(worker_config),
            metrics,
            telemetry.dependencies,
            health,
            prefill_chunk=engine.prefill_chunk if isinstance(engine, ChunkedPrefill) else 512,
        )
    if not engine.attach_kv(metrics, session) and session is not None:
        log.warning("this model's KV cannot be stored in blocks; KV persistence is off")
        await session.stop(0)
        return None
    if session is not None:
        await session.start()
    return session
