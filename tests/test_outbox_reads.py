"""Reading an outbox back (what the replay does) fails with ``OutboxError``, never a raw SQLite or
decoding error, whatever happened to the file under it; no secret is in the message."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orbit_sync import OutboxError
from orbit_sync.models import (
    AttemptRef,
    Capability,
    Finish,
    Outcome,
    Registration,
    new_id,
    new_message_id,
    new_secret,
)
from orbit_sync.worker.outbox._outbox import Outbox

#: Each read the replay makes, by name.
READS: dict[str, Callable[[Outbox, Registration], object]] = {
    "instances": lambda box, reg: box.instances(),
    "pending": lambda box, reg: box.pending(reg.instance_id),
    "counts": lambda box, reg: box.counts(),
}


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[Outbox, Registration, AttemptRef]]:
    """An open outbox holding one instance, one launched attempt and one decided finish."""
    reg = Registration(queue_id=new_id(), capabilities=[Capability("resize", "1", "1")], capacity=2)
    box = Outbox.open(tmp_path / "outbox.sqlite", reg)
    ref = AttemptRef(task_id=new_id(), attempt_id=new_id(), epoch=1, lease_secret=new_secret())
    box.launch(reg.instance_id, ref, "resize")
    finish = Finish(ref=ref, outcome=Outcome.SUCCEEDED, result={"ok": True})
    box.record_finish(reg.instance_id, "resize", finish, new_message_id())
    try:
        yield box, reg, ref
    finally:
        box.close()


def _beside(box: Outbox) -> contextlib.closing[sqlite3.Connection]:
    """Another connection to the same file: what a person or a tool does to it by hand."""
    return contextlib.closing(sqlite3.connect(box.path, isolation_level=None))


def _no_secret(exc: BaseException, reg: Registration, ref: AttemptRef) -> None:
    for secret in (reg.instance_secret, ref.lease_secret):
        assert secret not in str(exc) and secret not in repr(exc)


@pytest.mark.parametrize("read", sorted(READS))
def test_a_truncated_file_fails_every_read_with_outbox_error(
    stored: tuple[Outbox, Registration, AttemptRef], read: str
) -> None:
    """A file cut short under an open outbox: OutboxError, with SQLite's error as the cause."""
    box, reg, ref = stored
    with _beside(box) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every row now lives in the main file
    os.truncate(box.path, 4096)  # only the first page (the schema) is left
    with pytest.raises(OutboxError, match="malformed") as caught:
        READS[read](box, reg)
    assert isinstance(caught.value.__cause__, sqlite3.DatabaseError)
    _no_secret(caught.value, reg, ref)


@pytest.mark.parametrize(
    ("read", "table"),
    [("instances", "instances"), ("pending", "launched"), ("counts", "finishes")],
)
def test_a_table_dropped_under_the_outbox_fails_its_read_with_outbox_error(
    stored: tuple[Outbox, Registration, AttemptRef], read: str, table: str
) -> None:
    """A table dropped by another connection: OutboxError naming SQLite's reason."""
    box, reg, ref = stored
    with _beside(box) as db:
        db.execute(f"DROP TABLE {table}")
    with pytest.raises(OutboxError, match=f"no such table: {table}") as caught:
        READS[read](box, reg)
    assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
    _no_secret(caught.value, reg, ref)


@pytest.mark.parametrize(
    "change",
    [
        "UPDATE finishes SET outcome = 'MAYBE'",
        "UPDATE finishes SET result = '{not json'",
        "UPDATE launched SET epoch = 'one'",
        "UPDATE instances SET capabilities = '[[\"resize\"]]'",
    ],
    ids=["outcome", "result", "epoch", "capabilities"],
)
def test_a_row_changed_by_hand_fails_its_read_with_outbox_error(
    stored: tuple[Outbox, Registration, AttemptRef], change: str
) -> None:
    """A stored value this release cannot decode: OutboxError, the value not in the message."""
    box, reg, ref = stored
    with _beside(box) as db:
        db.execute(change)
    with pytest.raises(OutboxError, match="cannot be read; it was left as is") as caught:
        box.pending(reg.instance_id)
        box.instances()
    assert isinstance(caught.value.__cause__, ValueError | TypeError)
    _no_secret(caught.value, reg, ref)
    with _beside(box) as db:  # left as is
        assert db.execute("SELECT count(*) FROM launched").fetchone()[0] == 1


@pytest.mark.parametrize("read", sorted(READS))
def test_a_read_of_a_closed_outbox_is_outbox_error(
    stored: tuple[Outbox, Registration, AttemptRef], read: str
) -> None:
    """After close(), a read says the outbox is closed (not SQLite's closed-database error)."""
    box, reg, _ = stored
    box.close()
    with pytest.raises(OutboxError, match="the outbox is closed"):
        READS[read](box, reg)


def test_the_stored_rows_read_back_intact(
    stored: tuple[Outbox, Registration, AttemptRef],
) -> None:
    """The reads still decode what was written (the mapping changes only failures)."""
    box, reg, ref = stored
    (instance,) = box.instances()
    assert instance.instance_secret == reg.instance_secret
    (pending,) = box.pending(reg.instance_id)
    assert pending.ref == ref and pending.finish is not None
    assert pending.finish.result == json.loads('{"ok": true}')
    assert box.counts() == {"instances": 1, "launched": 1, "finishes": 1}


def test_a_delete_that_cannot_begin_leaves_later_writes_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A done() whose transaction cannot begin (another connection holds the write lock) fails
    with OutboxError and leaves the outbox's connection at synchronous=FULL for what follows."""
    connect = sqlite3.connect
    opened: list[sqlite3.Connection] = []

    def quick(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        opened.append(connect(*args, **{**kwargs, "timeout": 0.05}))
        return opened[-1]

    monkeypatch.setattr(sqlite3, "connect", quick)
    reg = Registration(queue_id=new_id(), capabilities=[Capability("resize", "1", "1")], capacity=2)
    box = Outbox.open(tmp_path / "outbox.sqlite", reg)
    (db,) = opened
    with contextlib.closing(connect(box.path, isolation_level=None)) as blocker:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(OutboxError, match="locked"):
            box.done(new_id())
        blocker.execute("ROLLBACK")
    assert db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    box.close()
