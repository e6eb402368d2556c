"""The durable outbox: what a killed worker process leaves for the next one (docs/outbox.md).

One SQLite file (WAL, 0600) holds each run's identity (``instances``: a later process delivers *as
that instance*), each attempt about to run (``launched``) and each finish decided (``finishes``),
fsync'd before the step they record; an acknowledged finish's rows go without fsync (a lost delete
only re-sends the same ``message_id``). One process at a time: see ``_outbox_lock``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs

from ..._realtime import monotonic
from ...errors import OrbitError
from ...models import AttemptRef, Capability, Finish, Outcome, Registration
from ._outbox_lock import instance_offset, open_private

__all__ = ["Outbox", "OutboxError", "Pending"]

#: ``PRAGMA application_id``: marks the file as ours ("ORBT").
APPLICATION_ID = 0x4F524254
SCHEMA_VERSION = 1
#: SQLite's busy timeout (Python's default), read at each open so a test can lower it.
BUSY_TIMEOUT = 5.0
#: How often a bounded wait for an instance's lock tries again.
_POLL = 0.05

_open_lock = threading.Lock()
#: (st_dev, st_ino) of every lock file this process has open: see ``_outbox_lock``.
_open_files: set[tuple[int, int]] = set()

_SCHEMA = """
CREATE TABLE instances (
    instance_id TEXT PRIMARY KEY,
    instance_secret TEXT NOT NULL,
    queue_id TEXT NOT NULL,
    capabilities TEXT NOT NULL,
    capacity INTEGER NOT NULL
);
CREATE TABLE launched (
    attempt_id TEXT PRIMARY KEY,
    instance_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    lease_secret TEXT NOT NULL,
    handler TEXT NOT NULL
);
CREATE TABLE finishes (
    attempt_id TEXT PRIMARY KEY,
    message_id TEXT NOT NULL,
    outcome TEXT NOT NULL,
    result TEXT NOT NULL,
    error_code TEXT,
    retryable INTEGER
);
"""


class OutboxError(OrbitError):
    """The outbox file cannot be used (permissions, corruption, another process holds it)."""

    __module__ = "orbit_sync"  # where users import it from: tracebacks say so


def _file_error(path: str, exc: BaseException) -> BaseException:
    """The error for an outbox file that cannot be opened as ours (a missing directory stays
    ``FileNotFoundError``, as for any file a program is given)."""
    if isinstance(exc, ValueError):  # open_private's reason
        return OutboxError(f"outbox {path} {exc}")
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
        if exc.errno == errno.ELOOP:
            return OutboxError(f"outbox {path} is a symbolic link; give the real path")
        if exc.errno == errno.EISDIR:
            return OutboxError(f"outbox {path} is a directory; give a file path")
        return OutboxError(f"outbox {path} cannot be opened: {exc.strerror or exc}")
    return exc


def _insert_launched(
    db: sqlite3.Connection, on_conflict: str, instance_id: str, ref: AttemptRef, handler: str
) -> None:
    row = (ref.attempt_id, instance_id, ref.task_id, ref.epoch, ref.lease_secret, handler)
    db.execute(f"INSERT OR {on_conflict} INTO launched VALUES (?, ?, ?, ?, ?, ?)", row)


@attrs.frozen
class Pending:
    """One attempt left in the outbox: launched, and maybe with its finish decided."""

    ref: AttemptRef
    handler: str
    message_id: str | None
    finish: Finish | None


class Outbox:
    """One open outbox file. Thread-safe (one connection, one lock)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        #: Where every handler process of this run holds its instance's lock.
        self.lock_path = self.path + "-lock"
        self._lock = threading.Lock()
        try:
            fd = open_private(self.path)
        except BaseException as exc:
            raise _file_error(self.path, exc) from None
        try:
            # One process at a time: a second one would speak as the same instances.
            self._lock_fd, self._lock_key = self._own_lock_file()
        finally:
            # SQLite opens the file by name: this descriptor only pinned the checks above.
            os.close(fd)
        self._closed = False
        try:
            self._db = self._connect()
        except BaseException:
            self._close_lock_file()
            raise

    @classmethod
    def open(cls, path: str | os.PathLike[str], registration: Registration) -> Outbox:
        """Open the outbox and store the run's identity; a failure leaves nothing open or locked."""
        outbox = cls(path)
        try:
            outbox.register(registration)
        except BaseException:
            outbox.close()
            raise
        return outbox

    def _own_lock_file(self) -> tuple[int, tuple[int, int]]:
        """Open the lock file and take byte 0, the owner's: its descriptor and (st_dev, st_ino)."""
        in_this_process = OutboxError(
            f"outbox {self.path} is already open in this process (by another Worker): "
            "give each Worker its own outbox file"
        )
        with _open_lock:
            with contextlib.suppress(OSError):
                info = os.lstat(self.lock_path)
                if (info.st_dev, info.st_ino) in _open_files:
                    # Opening it again and closing that would drop this process's locks.
                    raise in_this_process
            try:
                fd = open_private(self.lock_path)
                info = os.fstat(fd)
            except BaseException as exc:
                raise _file_error(self.lock_path, exc) from None
            key = (info.st_dev, info.st_ino)
            if key in _open_files:  # replaced by the same file under our feet
                raise in_this_process
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            except OSError:
                os.close(fd)  # this process held no lock on it: nothing is dropped
                raise OutboxError(f"outbox {self.path} is in use by another process") from None
            _open_files.add(key)
        return fd, key

    def _close_lock_file(self) -> None:
        with _open_lock:
            os.close(self._lock_fd)
            self._lock_fd = -1  # a later instance_lock() fails, never locks a reused descriptor
            _open_files.discard(self._lock_key)

    def _connect(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT, check_same_thread=False, isolation_level=None
            )
        except sqlite3.Error as exc:
            raise OutboxError(f"outbox {self.path} cannot be opened: {exc}") from exc
        try:
            (app_id,) = db.execute("PRAGMA application_id").fetchone()
            (version,) = db.execute("PRAGMA user_version").fetchone()
            tables = db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
            if app_id == 0 and version == 0 and tables == 0:
                db.executescript(
                    f"BEGIN; {_SCHEMA} PRAGMA application_id = {APPLICATION_ID}; "
                    f"PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
                )
            elif app_id != APPLICATION_ID:
                raise OutboxError(f"{self.path} is not an orbit-sync outbox; it was left as is")
            elif version != SCHEMA_VERSION:
                raise OutboxError(
                    f"outbox {self.path} has schema version {version}, this release reads "
                    f"{SCHEMA_VERSION}; it was left as is"
                )
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = FULL")
            db.execute("PRAGMA integrity_check").fetchone()
        except BaseException as exc:
            db.close()
            if isinstance(exc, sqlite3.OperationalError):  # disk full, I/O error, locked by SQLite
                raise OutboxError(f"outbox {self.path} cannot be opened: {exc}") from exc
            if isinstance(exc, sqlite3.DatabaseError):
                raise OutboxError(
                    f"outbox {self.path} is corrupt or not a database ({exc}); it was left as is"
                ) from None
            raise
        # The WAL and shared-memory files hold the same secrets.
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.path + suffix, 0o600)
        return db

    def close(self) -> None:
        """Close the file and release the lock (safe twice)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._db.close()
            self._close_lock_file()

    @contextlib.contextmanager
    def instance_lock(self, instance_id: str, timeout: float) -> Iterator[bool]:
        """Hold *instance_id*'s byte exclusively (yields True) once none of its handler processes
        is left, waiting up to *timeout*; yields False while one still may run."""
        offset = instance_offset(instance_id)
        end = monotonic() + timeout
        while True:
            try:
                fcntl.lockf(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
                break
            except OSError:
                if monotonic() >= end:
                    yield False
                    return
                time.sleep(_POLL)  # no blocking lock with a timeout exists: poll
        try:
            yield True
        finally:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, offset)

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Outbox {self.path!r}>"

    @contextlib.contextmanager
    def _using(self) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock, for one read or transaction: SQLite's failures become
        ``OutboxError``, which the replay retries (every value is bound: no secret in them)."""
        with self._lock:
            if self._closed:
                raise OutboxError("the outbox is closed")
            try:
                yield self._db
            except sqlite3.Error as exc:
                raise OutboxError(f"outbox {self.path}: {exc}") from exc

    @contextlib.contextmanager
    def _tx(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        with self._using() as db:
            try:
                if not durable:
                    # A delete that may be lost: the next replay re-sends the same message_id.
                    db.execute("PRAGMA synchronous = OFF")
                db.execute("BEGIN IMMEDIATE")
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):  # the first error is the one to tell
                        db.execute("ROLLBACK")
                raise
            finally:
                if not durable:  # also when BEGIN failed: every later write must be fsync'd again
                    db.execute("PRAGMA synchronous = FULL")

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self._using() as db:
            return db.execute(sql, params).fetchall()

    @contextlib.contextmanager
    def _decoding(self, what: str) -> Iterator[None]:
        """Rows this release cannot decode raise ``OutboxError`` naming the table, never a value."""
        try:
            yield
        except (ValueError, TypeError) as exc:  # json, enums, the models' validators
            raise OutboxError(
                f"outbox {self.path} holds {what} that cannot be read; it was left as is"
            ) from exc

    def register(self, registration: Registration) -> None:
        """Store this run's identity, so a later process can deliver as this instance."""
        reg = registration
        caps = [[c.handler, c.handler_version, c.payload_version] for c in reg.capabilities]
        row = (reg.instance_id, reg.instance_secret, reg.queue_id, json.dumps(caps), reg.capacity)
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO instances VALUES (?, ?, ?, ?, ?)", row)

    def launch(self, instance_id: str, ref: AttemptRef, handler: str) -> None:
        """Record that *ref*'s handler is about to run (committed before it runs)."""
        with self._tx() as db:
            _insert_launched(db, "REPLACE", instance_id, ref, handler)

    def record_finish(
        self, instance_id: str, handler: str, finish: Finish, message_id: str
    ) -> None:
        """Record the finish decided for an attempt (committed before it is first sent)."""
        result = json.dumps(finish.result, separators=(",", ":"), allow_nan=False)
        retryable = None if finish.retryable is None else int(finish.retryable)
        row = (
            finish.ref.attempt_id,
            message_id,
            finish.outcome.value,
            result,
            finish.error_code,
            retryable,
        )
        with self._tx() as db:
            _insert_launched(db, "IGNORE", instance_id, finish.ref, handler)
            db.execute(
                "INSERT OR REPLACE INTO finishes VALUES (?, ?, ?, ?, ?, ?)",
                row,
            )

    def done(self, attempt_id: str) -> None:
        """Forget an attempt whose finish the server acknowledged."""
        with self._tx(durable=False) as db:
            db.execute("DELETE FROM finishes WHERE attempt_id = ?", (attempt_id,))
            db.execute("DELETE FROM launched WHERE attempt_id = ?", (attempt_id,))

    def instances(self, *, exclude: str | None = None) -> list[Registration]:
        """Stored identities (other than *exclude*, this run's)."""
        rows = self._read(
            "SELECT instance_id, instance_secret, queue_id, capabilities, capacity "
            "FROM instances ORDER BY rowid"
        )
        with self._decoding("an instance"):
            return [
                Registration(
                    queue_id=queue_id,
                    capabilities=[Capability(*c) for c in json.loads(caps)],
                    capacity=capacity,
                    instance_id=instance_id,
                    instance_secret=secret,
                )
                for instance_id, secret, queue_id, caps, capacity in rows
                if instance_id != exclude
            ]

    def pending(self, instance_id: str) -> list[Pending]:
        """What *instance_id* left: every launched attempt, with its finish when decided."""
        rows = self._read(
            "SELECT l.attempt_id, l.task_id, l.epoch, l.lease_secret, l.handler, "
            "f.message_id, f.outcome, f.result, f.error_code, f.retryable "
            "FROM launched l LEFT JOIN finishes f ON f.attempt_id = l.attempt_id "
            "WHERE l.instance_id = ? ORDER BY l.rowid",
            (instance_id,),
        )
        out = []
        with self._decoding("an attempt"):
            for row in rows:
                attempt_id, task_id, epoch, secret, handler, mid, outcome, result, code, retry = row
                ref = AttemptRef(
                    task_id=task_id, attempt_id=attempt_id, epoch=epoch, lease_secret=secret
                )
                finish = None
                if mid is not None:
                    retryable = None if retry is None else bool(retry)
                    finish = Finish(ref, Outcome(outcome), json.loads(result), code, retryable)
                out.append(Pending(ref, handler, mid, finish))
        return out

    def forget_instance(self, instance_id: str) -> None:
        """Drop a stored identity once nothing of it is left to deliver."""
        with self._tx(durable=False) as db:
            left = db.execute(
                "SELECT count(*) FROM launched WHERE instance_id = ?", (instance_id,)
            ).fetchone()[0]
            if not left:
                db.execute("DELETE FROM instances WHERE instance_id = ?", (instance_id,))

    def counts(self) -> dict[str, Any]:
        """How many rows each table holds (for tests and diagnostics; no secrets)."""
        with self._using() as db:
            return {
                table: db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                for table in ("instances", "launched", "finishes")
            }
