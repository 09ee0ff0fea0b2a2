"""A local durable outbox: degraded requests wait here (SQLite, WAL) until Kafka acknowledges them.

Every hand-off is committed here first, so a crash after the client saw its ticket loses
nothing; a drainer then produces rows in id order and deletes them once delivered. The outbox
is bounded by rows and bytes: when full it refuses new rows (OutboxFull) instead of growing
until the disk fills. One process owns a file at a time (an exclusive lock beside it), so two
router replicas can never drain the same rows.

Synchronous and thread-safe; async callers run it in a thread (see handoff.HandOff).
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

Synchronous = Literal["FULL", "NORMAL"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- AUTOINCREMENT: ids never reused, so order holds after deletes
    key BLOB,
    value BLOB NOT NULL,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL
)
"""


class OutboxError(Exception):
    """The outbox cannot be used (locked by another process, closed, or the disk failed)."""


class OutboxFull(OutboxError):
    """Adding the row would pass the outbox's row or byte bound."""


@dataclass(frozen=True)
class OutboxItem:
    id: int
    key: bytes | None
    value: bytes
    created_at: float


@dataclass(frozen=True)
class OutboxDepth:
    rows: int
    bytes: int


class Outbox:
    """Bounded FIFO of (key, value) rows in one SQLite file in WAL mode."""

    def __init__(
        self,
        path: str | Path,
        max_rows: int = 100_000,
        max_bytes: int = 256 << 20,
        synchronous: Synchronous = "FULL",
    ) -> None:
        if max_rows < 1 or max_bytes < 1:
            raise ValueError("max_rows and max_bytes must be >= 1")
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError(f"synchronous must be FULL or NORMAL (got {synchronous!r})")
        self.path = Path(path)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise OutboxError(
                f"outbox {self.path} is in use by another process; give each router replica its own path"
            ) from None
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, one transaction per batch.
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=5.0)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise OutboxError(f"outbox {self.path}: SQLite refused WAL mode (got {mode!r})")
            # FULL: each commit is fsynced, so a power loss cannot drop an acknowledged hand-off;
            # NORMAL survives process crashes only.
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute(_SCHEMA)
            rows, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM outbox").fetchone()
        except BaseException:
            self._release_lock()
            raise
        self._rows = int(rows)
        self._bytes = int(size)
        self._closed = False

    # -- writing --------------------------------------------------------------------------

    def append(self, items: Sequence[tuple[bytes | None, bytes]]) -> list[int | None]:
        """Adds rows in one transaction (one fsync for the batch).

        Returns each row's id, or None for a row refused because the outbox is full; rows are
        judged in order, so a refused row never overtakes an accepted one.
        """
        now = time.time()
        with self._lock:
            self._check_open()
            ids: list[int | None] = []
            rows, size = self._rows, self._bytes
            cursor = self._db.cursor()
            cursor.execute("BEGIN IMMEDIATE")
            try:
                for key, value in items:
                    item_size = len(value) + (len(key) if key else 0)
                    if rows + 1 > self.max_rows or size + item_size > self.max_bytes:
                        ids.append(None)
                        continue
                    cursor.execute(
                        "INSERT INTO outbox (key, value, size, created_at) VALUES (?, ?, ?, ?)",
                        (key, value, item_size, now),
                    )
                    ids.append(cursor.lastrowid)
                    rows += 1
                    size += item_size
                cursor.execute("COMMIT")
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            self._rows, self._bytes = rows, size
            return ids

    def append_one(self, key: bytes | None, value: bytes) -> int:
        """Adds one row; raises OutboxFull when it does not fit."""
        (row_id,) = self.append([(key, value)])
        if row_id is None:
            raise OutboxFull(self.full_message())
        return row_id

    def full_message(self) -> str:
        return (
            f"outbox {self.path} is full ({self._rows} rows, {self._bytes} bytes; "
            f"limits {self.max_rows} rows, {self.max_bytes} bytes)"
        )

    # -- draining -------------------------------------------------------------------------

    def peek(self, limit: int = 100) -> list[OutboxItem]:
        """The oldest rows, in the order they were added."""
        with self._lock:
            self._check_open()
            cursor = self._db.execute("SELECT id, key, value, created_at FROM outbox ORDER BY id LIMIT ?", (limit,))
            return [OutboxItem(row[0], row[1], row[2], row[3]) for row in cursor.fetchall()]

    def delete(self, ids: Sequence[int]) -> int:
        """Removes delivered rows; returns how many were there."""
        if not ids:
            return 0
        with self._lock:
            self._check_open()
            cursor = self._db.cursor()
            cursor.execute("BEGIN IMMEDIATE")
            try:
                removed_rows = removed_bytes = 0
                for start in range(0, len(ids), 500):
                    chunk = list(ids[start : start + 500])
                    marks = ",".join("?" * len(chunk))
                    count, size = cursor.execute(
                        f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM outbox WHERE id IN ({marks})", chunk
                    ).fetchone()
                    cursor.execute(f"DELETE FROM outbox WHERE id IN ({marks})", chunk)
                    removed_rows += count
                    removed_bytes += size
                cursor.execute("COMMIT")
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            self._rows -= removed_rows
            self._bytes -= removed_bytes
            return removed_rows

    # -- state ----------------------------------------------------------------------------

    def depth(self) -> OutboxDepth:
        """Rows and bytes waiting (kept in memory: cheap enough for a metric callback)."""
        return OutboxDepth(self._rows, self._bytes)

    def journal_mode(self) -> str:
        with self._lock:
            self._check_open()
            return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    def _check_open(self) -> None:
        if self._closed:
            raise OutboxError(f"outbox {self.path} is closed")

    def _release_lock(self) -> None:
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)

    def close(self) -> None:
        """Checkpoints and closes the file, then lets another process open it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._db.close()
            finally:
                self._release_lock()

    def __enter__(self) -> "Outbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
