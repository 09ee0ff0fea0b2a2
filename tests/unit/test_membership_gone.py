"""A worker's record leaving etcd wakes whoever waits on it, and says whether the worker left
draining (an orderly goodbye after its streams ended) or not (lease lost)."""

from __future__ import annotations

from services.common.config import EtcdConfig
from services.common.membership import MembershipWatcher, WorkerRecord
from services.common.telemetry import DependencyStatus


def record(worker_id: str, draining: bool) -> WorkerRecord:
    return WorkerRecord(id=worker_id, address=f"{worker_id}:1", model="tiny", model_version="v1", draining=draining)


def test_gone_events_say_whether_the_worker_left_draining():
    watcher = MembershipWatcher(EtcdConfig(), DependencyStatus())
    watcher._workers = {"a": record("a", draining=True), "b": record("b", draining=False)}
    a, b, c = watcher.gone_event("a"), watcher.gone_event("b"), watcher.gone_event("never-seen")
    assert not a.is_set() and not b.is_set() and c.is_set()
    watcher._mark_gone({"a": watcher._workers.pop("a"), "b": watcher._workers.pop("b")})
    assert a.is_set() and a.draining
    assert b.is_set() and not b.draining
