"""No handler outlives its worker: process-executor children die with it, replay waits for them."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import _process_handlers as handlers
import attrs
import pytest
from test_worker_outbox import _await_started, _spawn
from test_worker_units import _task as unit_task

from orbit_sync.client import Client
from orbit_sync.models import AttemptState, Outcome, Task, TaskState, new_id
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import WorkerOptions
from orbit_sync.worker.outbox._outbox import Outbox
from orbit_sync.worker.process._process import _Process
from orbit_sync.worker.process._process_child import ORPHAN_EXIT
from orbit_sync.worker.session._replay import replay

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd (Linux)")

#: The children's cancel_grace in tests/_outbox_child.py.
CANCEL_GRACE = 1.0


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server with a short lease, recovered as it expires (not at the next 2 s scan), so
    a retry without an outbox comes soon."""
    with MockOrbitServer(assignment_rate=None, lease_duration=3.0, exact_recovery=True) as srv:
        yield srv
        srv.check_invariants()


def _child_pids(directory: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in directory.glob("started-*")]


def _exits_within(pid: int, seconds: float) -> bool:
    """Whether process *pid* (not ours to wait for) ends within *seconds*."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], seconds)
        return bool(readable)
    finally:
        os.close(fd)


@pytest.mark.parametrize("with_outbox", [True, False], ids=["outbox", "no-outbox"])
def test_killed_worker_leaves_no_handler_running(
    server: MockOrbitServer, tmp_path: Path, with_outbox: bool
) -> None:
    """SIGKILL while a child runs the handler: the child is gone within cancel_grace + 1 s, and
    the retry by the next worker never runs the effect alongside it (at most one at a time)."""
    outbox = tmp_path / "outbox.sqlite" if with_outbox else Path("-")
    first = _spawn(server, outbox, tmp_path, "process")
    try:
        task_id = server.enqueue(
            "work",
            {"n": 1, "dir": str(tmp_path)},
            retry_safety="IDEMPOTENT",
            backoff_initial=0.05,
        )
        _await_started(first, timeout=30)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=15)
    (orphan,) = _child_pids(tmp_path)
    assert _exits_within(orphan, CANCEL_GRACE + 1.0), "the handler's process outlived its worker"
    if not with_outbox:
        server.advance(server.lease_duration)  # nobody reports the attempt: its lease expires
    (tmp_path / "release").write_text("")
    second = _spawn(server, outbox, tmp_path, "process")
    try:
        snap = server.wait_for(task_id, {"SUCCEEDED", "FAILED", "NEEDS_REVIEW"}, timeout=30)
    finally:
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=30)
    assert snap.state is TaskState.SUCCEEDED
    assert snap.attempts[0].state is AttemptState.UNKNOWN  # reported lost, or its lease expired
    if with_outbox:
        assert snap.attempts[0].error_code == "WORKER_LOST"
    assert not list(tmp_path.glob("overlap-*"))
    assert [p.name for p in tmp_path.glob("effect-*[0-9]")] == [f"effect-{snap.result['pid']}"]


def _task(payload: object) -> Task:
    return attrs.evolve(unit_task(), payload=payload)


@pytest.mark.parametrize(
    ("handler", "grace", "code"),
    [(handlers.cooperative, 30.0, 0), (handlers.stubborn, 0.3, ORPHAN_EXIT)],
    ids=["cooperative", "stubborn"],
)
def test_pipe_end_cancels_the_handler_and_ends_the_child(
    tmp_path: Path, handler: object, grace: float, code: int
) -> None:
    """The parent's end of the pipe closing (with the parent alive, so no parent-death signal)
    cancels the running handler; one that ignores it is cut off after cancel_grace."""
    mp = multiprocessing.get_context("spawn")
    child = _Process(mp, logging.WARNING, grace, None)
    try:
        task = _task({"dir": str(tmp_path)})
        child.conn.send(("run", 1, pickle.dumps(handler), task, new_id(), None))
        message = child.conn.recv()  # the handler's "started" log line, forwarded
        assert message[0] == "log"
        # Both directions end, as when the parent dies; the parent's own descriptor stays open.
        socket.socket(fileno=os.dup(child.conn.fileno())).shutdown(socket.SHUT_RDWR)
        child.proc.join(grace + 5.0)
        assert child.proc.exitcode == code
    finally:
        child.stop(kill=True)


def _hold_lock(lock_path: str, instance_id: str) -> subprocess.Popen[str]:
    """Another process holding *instance_id*'s lock, as a handler process does, until its stdin
    closes."""
    code = (
        "import sys\n"
        "from orbit_sync.worker.outbox._outbox_lock import hold_instance_shared\n"
        "hold_instance_shared(sys.argv[1], sys.argv[2])\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, lock_path, instance_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "held\n"
    return proc


def test_replay_reports_lost_only_once_no_handler_process_holds_the_instance(
    tmp_path: Path,
) -> None:
    """While a process holds the dead instance's lock, the replay reports nothing (and says it
    must try again); once it is gone, the attempt is reported UNKNOWN WORKER_LOST."""
    with MockOrbitServer(assignment_rate=None) as server:
        outbox = tmp_path / "outbox.sqlite"
        first = _spawn(server, outbox, tmp_path, "hang")
        try:
            task_id = server.enqueue("work", {"n": 1})
            _await_started(first)
        finally:
            first.send_signal(signal.SIGKILL)
            first.communicate(timeout=15)
        with sqlite3.connect(outbox) as db:
            ((instance_id,),) = db.execute("SELECT instance_id FROM instances").fetchall()
        box = Outbox(outbox)
        client = Client(server.url, server.token)
        log = logging.getLogger("tests.replay")

        options = WorkerOptions(queue_id=server.queue_id, logger=log, dial_timeout=10)

        def run() -> bool:
            return replay(box, client, exclude="", options=options, lock_wait=0.2)

        try:
            holder = _hold_lock(box.lock_path, instance_id)
            try:
                assert run() is False
                assert server.task(task_id).attempts[0].outcome is None
                assert box.counts()["launched"] == 1
            finally:
                assert holder.stdin is not None
                holder.stdin.close()
                holder.wait(15)
            assert run() is True
        finally:
            box.close()
        snap = server.task(task_id)
        assert (snap.attempts[0].outcome, snap.attempts[0].error_code) == (
            Outcome.UNKNOWN,
            "WORKER_LOST",
        )


def test_instance_lock_is_per_process_and_never_the_owners(tmp_path: Path) -> None:
    """The owner's lock and an instance's lock are distinct: the owner takes an instance's lock
    while no other process holds it, and closing the outbox releases the owner's lock."""
    box = Outbox(tmp_path / "outbox.sqlite")
    try:
        with box.instance_lock("inst-a", 0.0) as gone:
            assert gone
        holder = _hold_lock(box.lock_path, "inst-a")
        try:
            with box.instance_lock("inst-a", 0.1) as gone:
                assert not gone
            with box.instance_lock("inst-b", 0.0) as gone:
                assert gone
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(15)
    finally:
        box.close()
    Outbox(tmp_path / "outbox.sqlite").close()
