"""The SQLite outbox: bounded, in order, durable across reopen and crash, WAL, one owner."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap

import pytest

from services.router.degrade.outbox import Outbox, OutboxError, OutboxFull


def test_rows_come_back_in_order_and_leave_when_deleted(tmp_path):
    with Outbox(tmp_path / "o.sqlite") as outbox:
        ids = outbox.append([(b"s1", b"a"), (None, b"b"), (b"s1", b"c")])
        assert ids == sorted(ids)
        items = outbox.peek(10)
        assert [(i.key, i.value) for i in items] == [(b"s1", b"a"), (None, b"b"), (b"s1", b"c")]
        assert outbox.delete([items[0].id, items[2].id]) == 2
        assert [i.value for i in outbox.peek(10)] == [b"b"]
        assert outbox.depth().rows == 1 and outbox.depth().bytes == 1


def test_ids_are_never_reused_so_order_survives_deletes(tmp_path):
    with Outbox(tmp_path / "o.sqlite") as outbox:
        first = outbox.append_one(None, b"1")
        outbox.delete([first])
        second = outbox.append_one(None, b"2")
        assert second > first


def test_bounded_by_rows(tmp_path):
    with Outbox(tmp_path / "o.sqlite", max_rows=3) as outbox:
        assert outbox.append([(None, b"x")] * 5) == [1, 2, 3, None, None]
        with pytest.raises(OutboxFull, match="3 rows"):
            outbox.append_one(None, b"y")
        outbox.delete([1])
        assert outbox.append_one(None, b"z") == 4
        assert outbox.depth().rows == 3


def test_bounded_by_bytes_counting_key_and_value(tmp_path):
    with Outbox(tmp_path / "o.sqlite", max_bytes=10) as outbox:
        outbox.append_one(b"kk", b"vvvv")  # 6 bytes
        with pytest.raises(OutboxFull):
            outbox.append_one(b"kk", b"vvv")  # would be 11
        # A later, smaller row still fits: refusal is per row, never a silent drop of others.
        assert outbox.append_one(None, b"1234") is not None
        assert outbox.depth().bytes == 10


def test_survives_reopen_with_depth_restored(tmp_path):
    path = tmp_path / "o.sqlite"
    with Outbox(path) as outbox:
        outbox.append([(b"k", b"one"), (b"k", b"two")])
    with Outbox(path) as outbox:
        assert [i.value for i in outbox.peek(10)] == [b"one", b"two"]
        assert outbox.depth().rows == 2 and outbox.depth().bytes == 8


def test_committed_rows_survive_a_killed_process(tmp_path):
    path = tmp_path / "o.sqlite"
    script = textwrap.dedent(f"""
        import os
        from services.router.degrade.outbox import Outbox
        outbox = Outbox({str(path)!r})
        outbox.append([(b"k", b"%d" % i) for i in range(50)])
        os._exit(9)  # no close, no checkpoint: as if the process crashed
    """)
    result = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert result.returncode == 9
    with Outbox(path) as outbox:
        assert [i.value for i in outbox.peek(100)] == [b"%d" % i for i in range(50)]


def test_wal_mode(tmp_path):
    with Outbox(tmp_path / "o.sqlite", synchronous="NORMAL") as outbox:
        assert outbox.journal_mode() == "wal"
        outbox.append_one(None, b"x")
        assert (tmp_path / "o.sqlite-wal").exists()
    # Another reader sees WAL mode persisted in the file itself.
    db = sqlite3.connect(tmp_path / "o.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_one_owner_at_a_time(tmp_path):
    path = tmp_path / "o.sqlite"
    first = Outbox(path)
    with pytest.raises(OutboxError, match="in use by another process"):
        Outbox(path)
    first.close()
    Outbox(path).close()


def test_closed_outbox_refuses(tmp_path):
    outbox = Outbox(tmp_path / "o.sqlite")
    outbox.close()
    outbox.close()  # idempotent
    with pytest.raises(OutboxError, match="closed"):
        outbox.append_one(None, b"x")


def test_bad_limits_are_rejected(tmp_path):
    with pytest.raises(ValueError):
        Outbox(tmp_path / "o.sqlite", max_rows=0)
    with pytest.raises(ValueError):
        Outbox(tmp_path / "o.sqlite", synchronous="OFF")
