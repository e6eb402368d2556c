"""The client protocol core on a fake clock: no threads, no sockets (orbit_sync._protocol)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _scripted import (
    LEASE_SECRET,
    SESSION_ID,
    assignment_body,
    command_body,
    frame,
    lease_body,
    registration,
    welcome_body,
)

from orbit_sync import _codec
from orbit_sync._protocol import (
    ASSIGNMENT,
    ASSIGNMENT_BUFFER,
    CALL_TIMEOUT,
    MAX_IN_FLIGHT,
    READ_IDLE_TIMEOUT,
    Answered,
    ClientProtocol,
    Ended,
    Full,
    Pushed,
    Queued,
)
from orbit_sync.errors import (
    CallTimeout,
    OrbitError,
    WorkerBackpressure,
    WorkerBusy,
    WorkerClosed,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)
from orbit_sync.models import AttemptRef, CapacityReport, CommandResult, Lease, Welcome

REF = AttemptRef("1" * 32, "2" * 32, 1, LEASE_SECRET)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _core(clock: Clock, lease_clock: Clock | None = None) -> ClientProtocol:
    ctx = _codec.SessionContext(SESSION_ID, 1, registration())
    return ClientProtocol(ctx, clock=clock, lease_clock=lease_clock)


def _ignore(value: Any, error: OrbitError | None) -> None:
    """A completion callback that is never meant to run in these tests."""


def _answer(core: ClientProtocol, message_id: str, **kw: Any) -> Any:
    event = core.decode(json.dumps(frame(kw.pop("type", "ack"), reply_to=message_id, **kw)))
    assert isinstance(event, _codec.Reply)
    return core.answer(event)


def test_open_encodes_the_frame_and_holds_a_slot() -> None:
    """A request gets a slot with its deadline, and its frame names its message_id."""
    clock = Clock()
    core = _core(clock)
    call, text = core.open("task.renew", REF, None, 2.5, _ignore)
    sent = json.loads(text)
    assert sent["type"] == "task.renew" and sent["message_id"] == call.message_id
    assert sent["session_id"] == SESSION_ID
    assert call.deadline == pytest.approx(102.5)
    assert core.calls == {call.message_id: call}


def test_the_call_timeout_is_capped_and_checked() -> None:
    """A call's bound defaults to and is capped at 10 s; zero, negative and NaN raise."""
    core = _core(Clock())
    assert core.bound(None) == CALL_TIMEOUT
    assert core.bound(60) == CALL_TIMEOUT
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError):
            core.bound(bad)
    with pytest.raises(TypeError):
        core.bound("1")  # type: ignore[arg-type]


def test_thirty_three_in_flight_is_busy_and_takes_no_slot() -> None:
    """The 33rd request raises WorkerBusy before encoding; an answered one frees its slot."""
    core = _core(Clock())
    calls = [core.open("task.renew", REF, None, None, _ignore)[0] for _ in range(MAX_IN_FLIGHT)]
    with pytest.raises(WorkerBusy):
        core.open("task.renew", REF, None, None, _ignore)
    assert len(core.calls) == MAX_IN_FLIGHT
    _answer(core, calls[0].message_id, body=command_body("renew"))
    core.open("task.renew", REF, None, None, _ignore)


def test_a_message_id_is_in_flight_once() -> None:
    """Re-using a message_id that is still in flight raises before anything is sent."""
    core = _core(Clock())
    call, _ = core.open("task.renew", REF, None, None, _ignore)
    with pytest.raises(ValueError, match="already in flight"):
        core.open("task.renew", REF, call.message_id, None, _ignore)
    with pytest.raises(ValueError, match="32 lowercase hex"):
        core.open("task.renew", REF, "X" * 32, None, _ignore)


def test_an_answer_is_routed_to_its_call_with_the_lease_anchored() -> None:
    """The ack's lease deadline is t_sent (lease clock, before sending) + window - 250 ms."""
    clock, lease_clock = Clock(100.0), Clock(5000.0)
    core = _core(clock, lease_clock)
    call, _ = core.open("task.start", REF, None, None, _ignore)
    lease_clock.now = 5003.0  # the answer comes later: the deadline still counts from the send
    got, value, error = _answer(core, call.message_id, body=command_body("start"))
    assert got is call and error is None and not core.calls
    assert isinstance(value, CommandResult)
    assert value.lease.deadline == pytest.approx(5000.0 + 30.0 - 0.25)


def test_resume_and_capacity_answers() -> None:
    """A resume returns an anchored Lease, an inactive one has no deadline; capacity a Welcome."""
    core = _core(Clock(), Clock(10.0))
    resume, _ = core.open("worker.resume", REF, None, None, _ignore)
    gone, _ = core.open("worker.resume", REF, None, None, _ignore)
    report, _ = core.open("worker.capacity", CapacityReport(1, 4), None, None, _ignore)
    _, lease, _ = _answer(core, resume.message_id, body=lease_body(window=20))
    assert isinstance(lease, Lease) and lease.deadline == pytest.approx(10.0 + 20.0 - 0.25)
    _, inactive, _ = _answer(core, gone.message_id, body=lease_body(active=False, state="EXPIRED"))
    assert inactive.deadline is None and not inactive.may_run()
    _, welcome, _ = _answer(core, report.message_id, body=welcome_body())
    assert isinstance(welcome, Welcome)


def test_error_answers_and_fatal_codes() -> None:
    """An error answer goes to its call; only the session-ending codes are fatal."""
    core = _core(Clock())
    for code, fatal in (
        ("LEASE_LOST", False),
        ("RATE_LIMITED", False),
        ("STALE_SESSION", True),
        ("UNAUTHENTICATED", True),
        ("PERMISSION_DENIED", True),
    ):
        call, _ = core.open("task.renew", REF, None, None, _ignore)
        _, value, error = _answer(core, call.message_id, type="error", error=(code, "no"))
        assert value is None and isinstance(error, WorkerError) and error.code == code
        assert error.message_id == call.message_id
        assert core.is_fatal(error) is fatal


def test_an_answer_to_nothing_in_flight_is_a_protocol_error() -> None:
    """An answer naming no call in flight, or of the wrong kind, is a protocol error."""
    core = _core(Clock())
    with pytest.raises(WorkerProtocolError, match="no pending request"):
        _answer(core, "9" * 32, body=command_body("renew"))
    call, _ = core.open("task.renew", REF, None, None, _ignore)
    with pytest.raises(WorkerProtocolError, match="CommandResult"):
        _answer(core, call.message_id, body=welcome_body())  # a Welcome answering a renew
    assert core.calls == {call.message_id: call}  # left in flight, to be failed with the error


def test_fail_hands_back_every_call_once_and_refuses_new_ones() -> None:
    """The first error wins; every call in flight is returned once; nothing more can be sent."""
    core = _core(Clock())
    calls = {core.open("task.renew", REF, None, None, _ignore)[0] for _ in range(3)}
    [ended] = core.fail(WorkerClosed("closed"))
    assert isinstance(ended, Ended) and isinstance(ended.error, WorkerClosed)
    assert set(ended.calls) == calls and not core.calls
    assert core.fail(WorkerDisconnected("later")) == []
    assert isinstance(core.err, WorkerClosed)
    with pytest.raises(WorkerClosed) as info:
        core.open("task.renew", REF, None, None, _ignore)
    assert info.value.message_id is None


def test_call_deadline_comes_before_the_read_idle_one() -> None:
    """The earliest call deadline is due first: a CallTimeout naming that call."""
    clock = Clock(100.0)
    core = _core(clock)
    slow, _ = core.open("task.finish", _finish(), None, 3.0, _ignore)
    core.open("task.renew", REF, None, 5.0, _ignore)
    assert core.next_deadline(last_rx=100.0) == (103.0, slow)
    clock.now = 102.9
    assert core.expire(last_rx=100.0) == []
    clock.now = 103.0
    [ended] = core.expire(last_rx=100.0)
    assert isinstance(ended, Ended) and isinstance(ended.error, CallTimeout)
    assert ended.error.message_id == slow.message_id and len(ended.calls) == 2
    assert core.expire(last_rx=100.0) == []  # ended once


def test_read_idle_deadline_without_calls() -> None:
    """With nothing in flight, the session ends 60 s after the last byte received."""
    clock = Clock(100.0)
    core = _core(clock)
    assert core.next_deadline(last_rx=90.0) == (90.0 + READ_IDLE_TIMEOUT, None)
    clock.now = 90.0 + READ_IDLE_TIMEOUT
    assert core.expire(last_rx=clock.now) == []
    [ended] = core.expire(last_rx=90.0)
    assert isinstance(ended, Ended) and isinstance(ended.error, WorkerDisconnected)


def test_a_caller_giving_up_ends_the_session_only_while_its_call_is_unanswered() -> None:
    """give_up: CallTimeout for an unanswered call; nothing once it was answered."""
    core = _core(Clock())
    answered, _ = core.open("task.renew", REF, None, None, _ignore)
    _answer(core, answered.message_id, body=command_body("renew"))
    assert core.give_up(answered) == []
    late, _ = core.open("task.renew", REF, None, None, _ignore)
    [ended] = core.give_up(late)
    assert isinstance(ended.error, CallTimeout) and ended.calls == [late]


def _route(core: ClientProtocol, value: dict[str, Any]) -> list[Any]:
    return core.route(core.decode(json.dumps(value)))


def test_routing_answers_and_fatal_errors_as_events() -> None:
    """An answer is Answered; a fatal error answer is Answered, then Ended with that error."""
    core = _core(Clock())
    call, _ = core.open("task.renew", REF, None, None, _ignore)
    [answered] = _route(core, frame("ack", reply_to=call.message_id, body=command_body("renew")))
    assert isinstance(answered, Answered) and answered.call is call
    assert isinstance(answered.value, CommandResult) and answered.error is None
    other, _ = core.open("task.renew", REF, None, None, _ignore)
    fatal, _ = core.open("task.renew", REF, None, None, _ignore)
    error = frame("error", reply_to=fatal.message_id, error=("STALE_SESSION", "replaced"))
    first, ended = _route(core, error)
    assert isinstance(first, Answered) and first.call is fatal
    assert isinstance(ended, Ended) and ended.error is first.error and ended.calls == [other]
    assert _route(core, frame("task.assign", body=assignment_body())) == []  # ended: nothing


def test_pushes_are_queued_up_to_the_buffer_then_wait_for_room() -> None:
    """Without a callback, assignments are Queued up to ASSIGNMENT_BUFFER and taken in order;
    one more is Full (the shell waits for room for it); backpressure() past the wait ends the
    session with WorkerBackpressure and drops what was unread."""
    core = _core(Clock())
    ids = [f"{i + 1:032x}" for i in range(ASSIGNMENT_BUFFER + 1)]
    for attempt_id in ids[:-1]:
        assert _route(core, frame("task.assign", body=assignment_body(attempt_id=attempt_id))) == [
            Queued(ASSIGNMENT)
        ]
    assert core.take(ASSIGNMENT).attempt_id == ids[0]
    assert _route(core, frame("task.assign", body=assignment_body(attempt_id=ids[-1]))) == [
        Queued(ASSIGNMENT)
    ]
    [full] = _route(core, frame("task.assign", body=assignment_body(attempt_id="f" * 32)))
    assert isinstance(full, Full) and full.kind == ASSIGNMENT
    assert full.item.attempt_id == "f" * 32 and core.err is None
    [ended] = core.backpressure(ASSIGNMENT)
    assert isinstance(ended, Ended) and isinstance(ended.error, WorkerBackpressure)
    assert core.take(ASSIGNMENT) is None


def test_a_push_with_a_callback_is_handed_over_unbounded() -> None:
    """With an assignment callback, every assignment is Pushed (never buffered, never ended)."""
    ctx = _codec.SessionContext(SESSION_ID, 1, registration())
    core = ClientProtocol(ctx, clock=Clock(), callbacks={ASSIGNMENT})
    for i in range(ASSIGNMENT_BUFFER + 2):
        [pushed] = _route(
            core, frame("task.assign", body=assignment_body(attempt_id=f"{i + 1:032x}"))
        )
        assert isinstance(pushed, Pushed) and pushed.kind == ASSIGNMENT
    assert core.err is None


def _finish() -> Any:
    from orbit_sync.models import Finish, Outcome

    return Finish(REF, Outcome.SUCCEEDED, {"ok": True})


@pytest.mark.parametrize("kind", ["task.start", "task.renew", "worker.resume"])
def test_ref_requests_encode_exactly_as_the_generic_frame(kind: str) -> None:
    """The cached AttemptRef fast path produces the same text as the generic frame encoder."""
    generic = _codec.encode_frame(
        kind, "4" * 32, session_id=SESSION_ID, body=_codec.unstructure(REF)
    )
    assert _codec.encode_request(kind, "4" * 32, SESSION_ID, REF) == generic
    assert _codec.encode_request(kind, "4" * 32, SESSION_ID, REF) == generic  # cached


def test_message_ids_are_hex_unique_and_new_in_a_forked_child() -> None:
    """message_ids are 32 lowercase hex, distinct, and a forked child does not repeat them."""
    import os
    import re

    from orbit_sync.models import new_message_id

    ids = {new_message_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id, then leave at once
        os.write(write, new_message_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{32}", child)
    assert child != new_message_id(), "the child was reseeded, not a copy of the parent"
