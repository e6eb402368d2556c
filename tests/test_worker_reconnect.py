"""A reconnect in the middle of an attempt, against a scripted server: every held attempt is
resumed first; its kept start or finish, and its unanswered renew, go out right behind the
resume with their message_id, before any answer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from _scripted import (
    ATTEMPT_ID,
    WAIT,
    Peer,
    ScriptedServer,
    assignment_body,
    command_body,
    lease_body,
    welcome_body,
)
from _worker_helpers import Sessions
from test_worker_session_setup import (
    OTHER_ATTEMPT,
    OTHER_TASK,
    _first_session,
    _on_still_time,
    _reconnected,
    _scripted,
)

from orbit_sync.testing import ManualClock
from orbit_sync.worker import SessionEvent


def _sent_again(
    server: ScriptedServer,
    peer: Peer,
    sent: dict[str, Any],
    backoff: Callable[[], None] = lambda: None,
) -> tuple[Peer, dict[str, Any]]:
    """Cut *peer* before *sent* is answered and welcome the next connection (after *backoff*);
    answer its report and its resume; return the new connection and *sent* sent again on it,
    same message_id. A start, finish or renew goes out right behind the resume (from its own
    thread: the handler's, or the watchdog's), beside the report, all before any answer."""
    peer.close()
    backoff()
    peer, resume = _reconnected(server, "2")
    first, second = peer.recv(), peer.recv()  # nothing was answered on this connection yet
    again, report = (first, second) if first["type"] == sent["type"] else (second, first)
    assert report["type"] == "worker.capacity", "the report goes out beside the re-send"
    peer.ack(resume, lease_body())
    peer.ack(report, welcome_body(epoch="2"))
    assert again["type"] == sent["type"]
    assert again["message_id"] == sent["message_id"] and again["body"] == sent["body"]
    return peer, again


def _renew_due(peer: Peer, clock: ManualClock) -> dict[str, Any]:
    """Move the clock past half the 30 s lease; return the renew that follows (the session's
    own report, repeated meanwhile, is answered)."""
    clock.advance(16.0)
    renew: dict[str, Any] = peer.recv()
    while renew["type"] != "task.renew":
        peer.ack(renew, welcome_body())
        renew = peer.recv()
    return renew


def test_a_finish_cut_in_flight_goes_out_after_the_resume_with_its_message_id() -> None:
    """The connection drops before the finish is answered: on the next one the attempt is
    resumed first, then the same finish (same message_id) is re-sent, and delivered."""
    sessions = Sessions()
    with _scripted(listeners=[sessions]) as (server, worker, handlers):
        peer = _first_session(server, handlers)
        handlers.release.set()
        finish = peer.recv()
        assert finish["type"] == "task.finish"
        peer, again = _sent_again(server, peer, finish)
        done = command_body("finish", task_state="SUCCEEDED", attempt_state="SUCCEEDED")
        peer.ack(again, {**done, "deduplicated": True})
        # The re-sent finish may be answered before the connection thread has stepped the
        # resume's answer (the session is counted then): wait for it before reading the count.
        assert sessions.wait(lambda s: s.established >= 2), "the worker never reconnected"
        assert handlers.runs == {ATTEMPT_ID: 1}
    stats = worker.stats()
    assert stats.succeeded == 1 and stats.reconnects == 1


def test_a_start_cut_in_flight_goes_out_after_the_resume_and_runs_once() -> None:
    """The connection drops before the start is answered: the attempt is resumed first, then
    the same start (same message_id) is re-sent; its answer runs the handler, once."""
    with _scripted() as (server, _worker, handlers):
        peer = server.accept()
        peer.handshake()
        report = peer.recv()
        peer.ack(report, welcome_body())
        peer.push("task.assign", assignment_body())
        start = peer.recv()
        assert start["type"] == "task.start"
        peer, again = _sent_again(server, peer, start)
        peer.ack(again, command_body("start", deduplicated=True))
        assert handlers.started.get(timeout=WAIT) == ATTEMPT_ID
        handlers.release.set()
        finish = peer.recv()
        assert finish["type"] == "task.finish" and finish["body"]["outcome"] == "SUCCEEDED"
        assert handlers.runs == {ATTEMPT_ID: 1}


def test_a_start_answered_before_its_resume_keeps_the_handler_running() -> None:
    """The kept start's answer may be stepped before the resume's (the reader steps a start,
    the connection thread a resume): the resume's lease, a reservation from before the start
    was applied, never cancels the handler the start let run."""
    reconnected = threading.Event()

    class Sessions:
        def connected(self, event: SessionEvent) -> None:
            if event.reconnect:
                reconnected.set()

    with _scripted(listeners=[Sessions()]) as (server, worker, handlers):
        peer = server.accept()
        peer.handshake()
        peer.ack(peer.recv(), welcome_body())
        peer.push("task.assign", assignment_body())
        start = peer.recv()
        assert start["type"] == "task.start"
        peer.close()
        peer, resume = _reconnected(server, "2")
        two = [peer.recv(), peer.recv()]  # the start (its thread) and the report, either order
        again, report = sorted(two, key=lambda f: f["type"] != "task.start")
        assert again["message_id"] == start["message_id"]
        peer.ack(again, command_body("start"))
        assert handlers.started.get(timeout=WAIT) == ATTEMPT_ID
        peer.ack(resume, lease_body(state="LEASED"))
        peer.ack(report, welcome_body(epoch="2"))
        assert reconnected.wait(WAIT), "the resume is over"
        handlers.release.set()
        finish = peer.recv()
        assert finish["type"] == "task.finish" and finish["body"]["outcome"] == "SUCCEEDED"
        assert handlers.reasons == {ATTEMPT_ID: None}, "never cancelled"
    assert worker.stats().lease_losses == 0


def test_a_renew_left_unanswered_is_sent_again_right_behind_the_resume() -> None:
    """A renew lost with its connection is re-sent (same message_id) right behind the resume,
    before its answer, not after the retry delay or half a lease later: the worker's clock
    never reaches those."""
    with _on_still_time() as (server, worker, handlers, clock, backoff):
        peer = _first_session(server, handlers)
        renew = _renew_due(peer, clock)
        peer, again = _sent_again(server, peer, renew, backoff)
        peer.ack(again, command_body("renew"))
        handlers.release.set()
        finish = peer.recv()
        assert finish["type"] == "task.finish" and finish["body"]["outcome"] == "SUCCEEDED"
        done = command_body("finish", task_state="SUCCEEDED", attempt_state="SUCCEEDED")
        peer.ack(finish, done)
        assert handlers.reasons == {ATTEMPT_ID: None}, "the lease held: never cancelled"
    assert worker.stats().lease_losses == 0


def test_two_held_attempts_resend_their_finish_and_renew_behind_the_resumes() -> None:
    """Two held attempts, one running with a renew left unanswered, one finishing: the kept
    finish (same message_id, from its handler's thread) and the renew (same message_id, from
    the watchdog's, on a worker clock that never reaches a retry delay) go out right behind the
    two resumes, beside the report; all before any answer."""
    with _on_still_time() as (server, _worker, handlers, clock, backoff):
        peer = _first_session(server, handlers)
        peer.push("task.assign", assignment_body(task_id=OTHER_TASK, attempt_id=OTHER_ATTEMPT))
        start = peer.recv()
        peer.ack(start, command_body("start"))
        finish = peer.recv()  # the other handler returns at once; its finish is not answered
        assert finish["type"] == "task.finish"
        renew = _renew_due(peer, clock)
        peer.close()
        backoff()
        peer = server.accept()
        peer.handshake(epoch="2")
        frames = [peer.recv() for _ in range(5)]
        assert [f["type"] for f in frames[:2]] == ["worker.resume", "worker.resume"]
        kept, again, report = sorted(frames[2:], key=lambda f: str(f["type"]))
        assert kept["type"] == "task.finish" and kept["message_id"] == finish["message_id"]
        assert report["type"] == "worker.capacity" and again["type"] == "task.renew"
        assert again["message_id"] == renew["message_id"]
        resumes = {f["body"]["attempt_id"]: f for f in frames[:2]}
        peer.ack(resumes[ATTEMPT_ID], lease_body())
        done = command_body("finish", task_state="SUCCEEDED", attempt_state="SUCCEEDED")
        peer.ack(kept, done)
        peer.ack(report, welcome_body(epoch="2"))
        peer.ack(resumes[OTHER_ATTEMPT], lease_body())
        peer.ack(again, command_body("renew"))
        handlers.release.set()
        last = peer.recv()
        assert last["type"] == "task.finish" and last["body"]["ref"]["attempt_id"] == ATTEMPT_ID
        peer.ack(last, done)
        assert handlers.reasons == {ATTEMPT_ID: None}, "the lease held: never cancelled"
        assert handlers.runs == {ATTEMPT_ID: 1, OTHER_ATTEMPT: 1}


def test_an_unanswered_renew_never_holds_back_its_leases_deadline() -> None:
    """The watchdog's thread waits for no renewal's answer: with a renew left unanswered, its
    lease's local deadline passes on the worker's clock and the handler is cancelled
    (lease_expired) at once, not after the renew's own call bound of seconds in real time."""
    with _on_still_time() as (server, worker, handlers, clock, _backoff):
        peer = _first_session(server, handlers)
        renew = _renew_due(peer, clock)
        assert renew["type"] == "task.renew"
        clock.advance(15.0)  # past the 30 s lease's deadline; the renew is still unanswered
        frame = peer.recv()
        while frame["type"] != "task.finish":
            if frame["type"] == "worker.capacity":
                peer.ack(frame, welcome_body())
            frame = peer.recv()
        assert handlers.reasons == {ATTEMPT_ID: "lease_expired"}
        assert frame["body"]["ref"]["attempt_id"] == ATTEMPT_ID
    assert worker.stats().lease_losses == 1
