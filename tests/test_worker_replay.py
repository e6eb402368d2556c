"""The outbox replay as attempt machines: their replay transitions without sockets or threads,
then a replay driven over a real mock server, cut midway, retried and stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_worker_attempt import _begin, _kinds, _lease, _machine, _result

from orbit_sync.client import Client
from orbit_sync.errors import WorkerDisconnected, WorkerError
from orbit_sync.models import (
    AttemptRef,
    AttemptState,
    Capability,
    CapacityReport,
    Finish,
    Outcome,
    Registration,
    TaskState,
    new_id,
    new_message_id,
    new_secret,
)
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import WorkerOptions
from orbit_sync.worker.core._machine import (
    AttemptMachine,
    BreakConnection,
    Ended,
    Keep,
    MachineError,
    Phase,
    RecordFinish,
    Release,
    Reported,
    Send,
)
from orbit_sync.worker.outbox._outbox import Outbox
from orbit_sync.worker.runtime._link import Link
from orbit_sync.worker.session._replay import WORKER_LOST, replay

LOG = logging.getLogger("tests.replay")


def _stored(m: AttemptMachine) -> Finish:
    return Finish(ref=m.ref, outcome=Outcome.SUCCEEDED, result={"n": 7})


def _resuming(m: AttemptMachine, finish: Finish | None = None, mid: str | None = None) -> None:
    assert m.replay(finish, mid) == [Send(m.request)]  # type: ignore[arg-type]


# ------------------------------------------------------------------ the machine


def test_replay_resumes_first_and_only_once() -> None:
    """A stored attempt enters by resuming its lease (a fresh message_id); entering twice, or
    after a start, is a bug of the worker's, raised (MachineError) with nothing sent."""
    m = _machine()
    actions = m.replay(None, None)
    assert m.phase is Phase.RESUMING and actions == [Send(m.request)]
    assert m.request is not None and m.request.request_type == "worker.resume"
    assert m.request.body is m.ref
    with pytest.raises(MachineError):
        m.replay(None, None)
    live = _machine()
    _begin(live)
    with pytest.raises(MachineError):
        live.replay(None, None)
    assert live.phase is Phase.STARTING


@pytest.mark.parametrize(
    "answer",
    ["active", "inactive", "refused"],
)
def test_a_stored_finish_is_sent_after_the_resume_whatever_it_says(answer: str) -> None:
    """The stored finish goes out with its original message_id once the resume is answered,
    refused or not (after the lease it is evidence); it is never recorded again."""
    m = _machine()
    finish, mid = _stored(m), new_message_id()
    _resuming(m, finish, mid)
    resume = m.request
    assert resume is not None and resume.message_id != mid
    if answer == "refused":
        actions = m.failed(resume, WorkerError("LEASE_LOST", "gone"), gen=1)
    else:
        lease = _lease(active=answer == "active", state=AttemptState.RUNNING)
        actions = m.resume_answered(resume, lease)
    assert actions == [Send(m.request)] and m.phase is Phase.FINISHING
    assert m.request is not None and m.request.body is finish and m.request.message_id == mid
    done = m.finish_answered(m.request, _result())
    assert _kinds(done) == [Reported, Release] and m.phase is Phase.DELIVERED
    assert isinstance(done[0], Reported) and done[0].verdict.outcome is Outcome.SUCCEEDED


def test_launched_with_an_active_lease_is_recorded_then_reported_lost() -> None:
    """Launched, never finished, lease still active: UNKNOWN WORKER_LOST, recorded before it is
    sent, under a message_id of its own."""
    m = _machine()
    _resuming(m)
    resume = m.request
    assert resume is not None
    actions = m.resume_answered(resume, _lease())
    assert _kinds(actions) == [RecordFinish, Send] and m.phase is Phase.FINISHING
    record, send = actions
    assert isinstance(record, RecordFinish) and isinstance(send, Send)
    assert record.request is send.request is m.request
    finish = send.request.body
    assert isinstance(finish, Finish) and finish.ref is m.ref
    assert (finish.outcome, finish.error_code) == (Outcome.UNKNOWN, WORKER_LOST)
    assert send.request.message_id != resume.message_id


@pytest.mark.parametrize("answer", ["inactive", "refused"])
def test_launched_whose_lease_is_over_is_dropped_without_a_finish(answer: str) -> None:
    """Launched, nothing stored, and the server already ended it (resume refused, or an
    inactive lease): nothing is sent, the record is dropped."""
    m = _machine()
    _resuming(m)
    resume = m.request
    assert resume is not None
    if answer == "refused":
        actions = m.failed(resume, WorkerError("LEASE_MISMATCH", "no"), gen=1)
    else:
        actions = m.resume_answered(resume, _lease(active=False, state=AttemptState.EXPIRED))
    assert _kinds(actions) == [Ended, Release] and m.phase is Phase.ENDED
    assert m.settled and m.request is None


def test_resume_failures_use_the_one_classification() -> None:
    """A resume cut with its connection is kept for the next one; a transient answer is
    retried after the delay; both re-send the same request (same message_id)."""
    m = _machine()
    _resuming(m)
    resume = m.request
    assert resume is not None
    cut = m.failed(resume, WorkerDisconnected("cut"), gen=3)
    assert cut == [BreakConnection(3), Keep(resume, newer_than=3)]
    busy = WorkerError("UNAVAILABLE", "later")
    assert m.failed(resume, busy, gen=3) == [Keep(resume, delay=1.0, error=busy)]
    assert m.resend(resume) == [Send(resume)] and m.phase is Phase.RESUMING


def test_a_stored_finish_cut_is_kept_with_its_original_id() -> None:
    """The stored finish's connection fails: kept, and re-sent with the stored message_id."""
    m = _machine()
    finish, mid = _stored(m), new_message_id()
    _resuming(m, finish, mid)
    assert m.request is not None
    m.resume_answered(m.request, _lease())
    request = m.request
    assert request is not None and request.message_id == mid
    assert m.failed(request, WorkerDisconnected("cut"), gen=1)[1] == Keep(request, newer_than=1)
    assert m.resend(request) == [Send(request)]
    assert m.finish_answered(request, _result())[-1] == Release()


def test_replay_stopping_leaves_everything_stored() -> None:
    """The try ends before an answer: a resume leaves the attempt unreported (no action but
    its release), a finish is reported undelivered; late answers are then ignored."""
    m = _machine()
    _resuming(m)
    resume = m.request
    assert resume is not None
    assert m.gave_up(resume) == [Release()] and m.phase is Phase.UNREPORTED
    assert m.resume_answered(resume, _lease()) == []
    f = _machine()
    _resuming(f, _stored(f), new_message_id())
    assert f.request is not None
    f.resume_answered(f.request, _lease())
    finishing = f.request
    assert finishing is not None
    gave_up = f.gave_up(finishing)
    assert _kinds(gave_up) == [Reported, Release] and f.phase is Phase.UNREPORTED
    assert isinstance(gave_up[0], Reported) and not gave_up[0].delivered
    assert gave_up[0].error is None
    assert f.finish_answered(finishing, _result()) == []


# ------------------------------------------------------------------ over a real server


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server with the default 30 s lease: every wait below is far shorter."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


class _Dead:
    """A worker instance that launched one attempt and died: its outbox records, and its
    connection, left open (the replay must fence it)."""

    def __init__(self, server: MockOrbitServer, box: Outbox) -> None:
        self.registration = Registration(
            queue_id=server.queue_id,
            capabilities=[Capability("work", "1", "1")],
            capacity=1,
            instance_id=new_id(),
            instance_secret=new_secret(),
        )
        self.task_id = server.enqueue("work", {"n": 1})
        self.conn = Client(server.url, server.token).dial_worker(self.registration)
        self.conn.capacity(CapacityReport(sequence=1, capacity=1))
        assignment = self.conn.next_assignment(timeout=10)
        self.ref: AttemptRef = assignment.attempt
        assert self.conn.start(self.ref).lease.active
        box.register(self.registration)
        box.launch(self.registration.instance_id, self.ref, "work")


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Outbox]:
    """An outbox file of this test."""
    with Outbox(tmp_path / "outbox.sqlite") as outbox:
        yield outbox


def _replay(
    server: MockOrbitServer, box: Outbox, *, stop: Link | None = None, **options: Any
) -> bool:
    """Replay with the options of a worker of *server*."""
    settings = WorkerOptions(queue_id=server.queue_id, logger=LOG, dial_timeout=10, **options)
    return replay(box, Client(server.url, server.token), exclude="", options=settings, stop=stop)


def _events(server: MockOrbitServer, kind: str, task_id: str) -> list[str]:
    return [e.detail for e in server.events() if e.kind == kind and e.task_id == task_id]


def test_replay_cut_after_reporting_lost_resends_the_same_finish(
    server: MockOrbitServer, box: Outbox
) -> None:
    """The connection closes right after the WORKER_LOST finish is applied: the try says it is
    not done; the next one re-sends that finish with the recorded message_id (answered as a
    duplicate, not a second report), and the outbox is empty."""
    dead = _Dead(server, box)
    cut = server.faults.close_after("task.finish")
    try:
        assert _replay(server, box) is False
        assert cut.fired == 1
        snap = server.task(dead.task_id)
        assert (snap.attempts[0].outcome, snap.attempts[0].error_code) == (
            Outcome.UNKNOWN,
            WORKER_LOST,
        )
        assert box.counts()["finishes"] == 1  # recorded before it was sent
        assert dead.conn.done.wait(10)  # the dead process's session was fenced
        assert _replay(server, box) is True
    finally:
        dead.conn.close()
    assert box.counts() == {"instances": 0, "launched": 0, "finishes": 0}
    assert _events(server, "request.deduplicated", dead.task_id) == ["task.finish"]
    assert _events(server, "finish.repeated", dead.task_id) == []
    snap = server.task(dead.task_id)
    assert len(snap.attempts) == 1 and snap.evidence == ()


def test_replay_cut_before_a_stored_finish_delivers_it_next_try(
    server: MockOrbitServer, box: Outbox
) -> None:
    """The connection closes before the stored finish is applied: nothing is lost or invented;
    the next try delivers the dead process's own result."""
    dead = _Dead(server, box)
    finish = Finish(ref=dead.ref, outcome=Outcome.SUCCEEDED, result={"n": 7})
    box.record_finish(dead.registration.instance_id, "work", finish, new_message_id())
    cut = server.faults.close_before("task.finish")
    try:
        assert _replay(server, box) is False
        assert cut.fired == 1
        assert server.task(dead.task_id).state is TaskState.RUNNING
        assert box.counts()["finishes"] == 1
        assert _replay(server, box) is True
    finally:
        dead.conn.close()
    snap = server.task(dead.task_id)
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"n": 7}
    assert len(snap.attempts) == 1
    assert box.counts() == {"instances": 0, "launched": 0, "finishes": 0}


def test_transient_answers_are_retried_on_the_same_connection(
    server: MockOrbitServer, box: Outbox
) -> None:
    """UNAVAILABLE to the resume and RATE_LIMITED to the finish are re-sent after the retry
    delay on the replay's one connection: a single try delivers."""
    dead = _Dead(server, box)
    resume = server.faults.reply_error("worker.resume", "UNAVAILABLE", count=1)
    finish = server.faults.reply_error("task.finish", "RATE_LIMITED", count=2)
    try:
        assert _replay(server, box, renew_retry_delay=0.1) is True
    finally:
        dead.conn.close()
    assert (resume.fired, finish.fired) == (1, 2)
    opened = [e for e in server.events() if e.kind == "session.opened"]
    assert len(opened) == 2  # the dead process's, then the replay's one
    snap = server.task(dead.task_id)
    assert snap.attempts[0].error_code == WORKER_LOST
    assert box.counts() == {"instances": 0, "launched": 0, "finishes": 0}


def test_shutdown_ends_a_try_waiting_for_an_answer(server: MockOrbitServer, box: Outbox) -> None:
    """A resume that is never answered: closing the worker's link ends the try at once (long
    before its call timeout); nothing was reported and the records stay for the next start."""
    dead = _Dead(server, box)
    dropped = server.faults.drop_reply("worker.resume")
    stop = Link()
    outcome: list[bool] = []
    thread = threading.Thread(
        target=lambda: outcome.append(_replay(server, box, stop=stop)),
        name="test-replay",
    )
    thread.start()
    try:
        assert dropped.wait(10)
        stop.close()
        thread.join(10)  # far less than the try's own limit
        assert not thread.is_alive() and outcome == [False]
    finally:
        thread.join(60)
        dead.conn.close()
    assert server.task(dead.task_id).attempts[0].outcome is None
    assert box.counts()["launched"] == 1


def test_a_refused_stored_identity_keeps_its_records(
    server: MockOrbitServer, box: Outbox, caplog: pytest.LogCaptureFixture
) -> None:
    """Credentials the server refuses: no later try can help (done), nothing is sent, and the
    records stay in the file, said at ERROR without the token."""
    dead = _Dead(server, box)
    dead.conn.close()
    caplog.set_level(logging.ERROR, LOG.name)
    options = WorkerOptions(queue_id=server.queue_id, logger=LOG, dial_timeout=10)
    done = replay(box, Client(server.url, "not-the-token"), exclude="", options=options)
    assert done is True
    assert box.counts() == {"instances": 1, "launched": 1, "finishes": 0}
    assert "kept undelivered" in caplog.text and "not-the-token" not in caplog.text
    assert server.task(dead.task_id).attempts[0].outcome is None
