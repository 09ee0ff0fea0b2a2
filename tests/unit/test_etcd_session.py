"""The etcd session's pure parts: what a resync reports, the reconnect waits, and when a kept
lease is granted again (etcd itself is in tests/integration/test_etcd_session.py)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import EtcdConfig
from services.common.etcd_session import Change, EtcdSession, KeptLease, next_wait, reconnect_backoff


@dataclass
class KV:
    key: bytes
    value: bytes
    lease: int = 0
    mod_revision: int = 1


def test_a_resync_reports_new_changed_and_gone_keys_and_nothing_unchanged():
    watch = EtcdSession(EtcdConfig()).watch_prefix(b"/p/")
    snapshot, changes = watch._resync([KV(b"/p/a", b"1", 0, 5), KV(b"/p/b", b"2", 7, 6)])
    assert {c.key: c.value for c in changes} == {b"/p/a": b"1", b"/p/b": b"2"}
    assert snapshot[b"/p/b"] == Change(b"/p/b", b"2", 7, 6)

    _, changes = watch._resync([KV(b"/p/a", b"1", 0, 5), KV(b"/p/c", b"3", 0, 9), KV(b"/p/b", b"2b", 7, 8)])
    assert {c.key: c.value for c in changes} == {b"/p/b": b"2b", b"/p/c": b"3"}

    _, changes = watch._resync([KV(b"/p/c", b"3", 0, 9)])
    assert sorted((c.key, c.deleted) for c in changes) == [(b"/p/a", True), (b"/p/b", True)]
    assert set(watch.snapshot()) == {b"/p/c"}


def test_reconnect_waits_double_to_a_cap_and_start_over_after_a_good_connection():
    backoff = reconnect_backoff(EtcdConfig(reconnect_backoff_s=0.5))
    assert [next_wait(backoff) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    backoff.streak = 0
    assert next_wait(backoff) == 0.5
    # A first wait above the usual cap is kept as the cap.
    assert next_wait(reconnect_backoff(EtcdConfig(reconnect_backoff_s=8.0))) == 8.0


class FakeLeases:
    """Stands in for the session's lease calls: which leases etcd holds."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.next_id = 100

    async def grant(self, ttl_s: int) -> int:
        self.next_id += 1
        self.held.add(self.next_id)
        return self.next_id

    async def refresh(self, lease_id: int) -> int:
        return 3 if lease_id in self.held else 0

    async def revoke(self, lease_id: int) -> bool:
        self.held.discard(lease_id)
        return True


async def test_a_kept_lease_is_refreshed_while_held_and_granted_again_once_lost():
    etcd = FakeLeases()
    told: list[int] = []
    lease = KeptLease(etcd, 3, on_granted=told.append)  # type: ignore[arg-type]
    first = await lease.ensure()
    assert await lease.ensure() == first and told == [first] and lease.grants == 1

    etcd.held.clear()  # expired while its owner was away
    second = await lease.ensure()
    assert second != first and told == [first, second] and lease.grants == 2

    await lease.revoke()
    assert second not in etcd.held and lease.id is None
    lease.forget()  # nothing held: nothing to do
    assert lease.id is None
