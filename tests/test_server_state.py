"""The mock server's pure state machine (OrbitState): PROTOCOL §5-§9 rules, no sockets."""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest
from _independent import parse_time
from _serverkit import (
    CAP,
    SCOPE_CONNECT,
    SCOPE_CONSUME,
    Kit,
    Proc,
    body,
    client_frame,
    code,
    pushes_of,
    queue_scope,
    ref_of,
)

from orbit_sync._codec import decode_body, unstructure
from orbit_sync.models import (
    Assignment,
    AttemptRef,
    Capability,
    Lease,
    Registration,
    TaskState,
    new_secret,
)
from orbit_sync.testing._state import InvariantError

# --------------------------------------------------------------------------- sessions


def test_welcome_fields() -> None:
    """The welcome names the session in its body, epoch 1, the windows and draining."""
    kit = Kit()
    handled = kit.worker().hello()
    welcome = body(handled)
    assert handled.answer.type == "worker.welcome"
    assert welcome["session_id"] == handled.session_id
    assert welcome["epoch"] == "1"
    window = parse_time(welcome["expires_at"]) - parse_time(welcome["server_time"])
    assert window.total_seconds() == 45
    assert welcome["lease_duration_ms"] == 30000
    assert welcome["draining"] is False


def test_reconnect_increments_epoch_and_stales_old_session() -> None:
    """A new connection of the same process gets epoch+1; the old one is told and closed."""
    kit = Kit()
    proc = kit.worker()
    proc.hello()
    old = proc.session_id
    assert old is not None
    handled = proc.hello()
    assert body(handled)["epoch"] == "2"
    assert next(a.error for a in handled.actions if hasattr(a, "error")) == (
        "STALE_SESSION",
        "a newer session of this worker exists",
    )
    assert old in kit.closed
    report = {"sequence": "9", "capacity": 1, "drain": False}
    stale = kit.state.handle(old, client_frame("worker.capacity", report, session_id=old))
    assert code(stale) == "STALE_SESSION" and stale.answer.close
    # A frame naming the old session on the new session's connection is refused too.
    assert code(proc.send("worker.capacity", report, session_id=old)) == "STALE_SESSION"


def test_reconnect_identity_must_match() -> None:
    """Same instance with another secret, queue or capability set is refused."""
    kit = Kit()
    proc = kit.worker()
    proc.hello()
    reg = proc.registration
    wrong_secret = attrs.evolve(reg, instance_secret=new_secret())
    assert code(proc.hello(wrong_secret)) == "PERMISSION_DENIED"
    other_queue = kit.state.add_queue()
    token = kit.state.add_token({SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(other_queue)})
    proc.token = token
    assert code(proc.hello(attrs.evolve(reg, queue_id=other_queue))) == "PERMISSION_DENIED"
    proc.token = kit.token
    other_caps = attrs.evolve(reg, capabilities=[CAP, Capability("crop", "1", "1")])
    refused = proc.hello(other_caps)
    assert code(refused) == "STATE_CONFLICT" and refused.answer.close
    reordered = Registration(
        queue_id=reg.queue_id,
        capabilities=[Capability("b", 1, 1), Capability("a", 1, 1)],
        capacity=2,
        instance_id=reg.instance_id,
        instance_secret=reg.instance_secret,
    )
    proc2 = kit.worker(capabilities=[Capability("a", 1, 1), Capability("b", 1, 1)])
    proc2.hello()
    reordered = attrs.evolve(
        reordered,
        instance_id=proc2.registration.instance_id,
        instance_secret=proc2.registration.instance_secret,
    )
    assert body(proc2.hello(reordered))["epoch"] == "2"


def test_same_queue_switch_is_state_conflict() -> None:
    """A process may not move to another queue even with a token for both."""
    kit = Kit()
    other = kit.state.add_queue()
    token = kit.state.add_token(
        {SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(kit.queue_id), queue_scope(other)}
    )
    proc = kit.worker(token=token)
    proc.hello()
    assert code(proc.hello(attrs.evolve(proc.registration, queue_id=other))) == "STATE_CONFLICT"


def test_hello_scopes() -> None:
    """Missing workers:consume or the queue scope is PERMISSION_DENIED; a bad token fails."""
    kit = Kit()
    no_consume = kit.state.add_token({SCOPE_CONNECT, queue_scope(kit.queue_id)})
    no_queue = kit.state.add_token({SCOPE_CONNECT, SCOPE_CONSUME})
    assert code(kit.worker(token=no_consume).hello()) == "PERMISSION_DENIED"
    assert code(kit.worker(token=no_queue).hello()) == "PERMISSION_DENIED"
    proc = kit.worker()
    kit.state.revoke_token(kit.token)
    refused = proc.hello()
    assert code(refused) == "UNAUTHENTICATED" and refused.answer.close


def test_revoked_token_fails_later_requests() -> None:
    """Control operations re-check the credential: a revoked token is UNAUTHENTICATED."""
    kit = Kit()
    proc = kit.worker().open()
    kit.state.revoke_token(kit.token)
    handled = proc.capacity()
    assert code(handled) == "UNAUTHENTICATED" and handled.answer.close


def test_nothing_assigned_before_first_capacity() -> None:
    """Dispatch starts only once the session's first capacity report is acknowledged."""
    kit = Kit()
    kit.enqueue()
    proc = kit.worker()
    proc.hello()
    assert proc.assignments() == []
    handled = proc.capacity()
    assert handled.answer.type == "ack"
    assert len(pushes_of(list(handled.actions), "task.assign")) == 1


def test_capacity_ack_is_a_welcome_for_this_session() -> None:
    """The capacity ack carries the session's own id and epoch and renews expires_at."""
    kit = Kit()
    proc = kit.worker()
    proc.hello()
    kit.advance(10)
    ack = body(proc.capacity())
    assert ack["session_id"] == proc.session_id and ack["epoch"] == "1"
    assert (parse_time(ack["expires_at"]) - parse_time(ack["server_time"])).total_seconds() == 45
    assert parse_time(ack["server_time"]).timestamp() == kit.clock.now()


def test_capacity_sequence_rules() -> None:
    """Same sequence + content repeats; other content or an older sequence conflicts."""
    kit = Kit()
    proc = kit.worker()
    proc.hello()
    assert proc.capacity(2, sequence=5).answer.type == "ack"
    assert proc.capacity(2, sequence=5).answer.type == "ack"
    assert code(proc.capacity(3, sequence=5)) == "STATE_CONFLICT"
    assert code(proc.capacity(2, sequence=4)) == "STATE_CONFLICT"
    assert proc.capacity(3, sequence=6).answer.type == "ack"


def test_capacity_sequence_is_per_process_across_sessions() -> None:
    """After a reconnect the process continues its sequence; an older one conflicts."""
    kit = Kit()
    proc = kit.worker()
    proc.hello()
    proc.capacity(2, sequence=3)
    proc.hello()
    assert code(proc.capacity(2, sequence=1)) == "STATE_CONFLICT"
    assert proc.capacity(2, sequence=3).answer.type == "ack"


def test_repeated_capacity_renews_session() -> None:
    """Repeating the current report keeps the session alive past its first window."""
    kit = Kit()
    proc = kit.worker()
    proc.hello()
    proc.capacity(1, sequence=1)
    for _ in range(4):
        kit.advance(20)
        assert proc.capacity(1, sequence=1).answer.type == "ack"
    assert proc.session_id not in kit.closed


def test_session_expires_without_renewal() -> None:
    """Past expires_at the session is closed and its requests get STALE_SESSION."""
    kit = Kit()
    proc = kit.worker().open()
    kit.advance(46)
    assert proc.session_id in kit.closed
    errors = [p.error for p in proc.pushes if p.type == "error"]
    assert errors and errors[0] is not None and errors[0][0] == "STALE_SESSION"
    assert code(proc.capacity()) == "STALE_SESSION"


def test_drain_persists_and_cannot_be_cleared() -> None:
    """drain stops dispatch, survives reconnects (welcome.draining) and cannot be undone."""
    kit = Kit()
    proc = kit.worker()
    proc.hello()
    assert body(proc.capacity(2, drain=True))["draining"] is True
    kit.enqueue()
    assert proc.assignments() == []
    assert code(proc.capacity(2, drain=False)) == "STATE_CONFLICT"
    welcome = body(proc.hello())
    assert welcome["draining"] is True
    assert code(proc.capacity(2, drain=False)) == "STATE_CONFLICT"
    assert proc.capacity(2, drain=True).answer.type == "ack"
    assert proc.assignments() == []


def test_capacity_zero_stops_assignments_but_keeps_held() -> None:
    """capacity 0 assigns nothing new and frees nothing already held."""
    kit = Kit()
    proc = kit.worker().open(capacity=2)
    kit.enqueue()
    proc.take()
    proc.capacity(0)
    kit.enqueue()
    assert proc.assignments() == []
    assert kit.state.session_snapshots()[0].held == 1
    kit.state.check_invariants()


def test_capacity_counts_across_sessions_of_a_process() -> None:
    """Slots held by an older session still count after a reconnect."""
    kit = Kit()
    proc = kit.worker(capacity=1).open()
    kit.enqueue()
    ref = proc.take()
    proc.hello()  # reconnect: new session, same process
    proc.resume(ref)
    proc.capacity()
    kit.enqueue()
    assert proc.assignments() == []
    proc.start(ref)
    proc.finish(ref)
    assert len(proc.assignments()) == 1


def test_hello_capacity_bounds_reports() -> None:
    """A report above the hello's total slots does not raise the process's capacity."""
    kit = Kit()
    proc = kit.worker(capacity=1).open(capacity=5)
    kit.enqueue()
    kit.enqueue()
    assert len(proc.assignments()) == 1


def test_assignments_respect_capabilities() -> None:
    """Only tasks whose handler and versions match a capability are assigned."""
    kit = Kit()
    proc = kit.worker().open()
    kit.enqueue("crop")
    kit.enqueue("resize", handler_version="2")
    assert proc.assignments() == []
    kit.enqueue("resize")
    assert len(proc.assignments()) == 1


def test_assignment_body() -> None:
    """An assignment is LEASED, names its attempt number and the policy's budget."""
    kit = Kit()
    proc = kit.worker().open()
    task_id = kit.enqueue(payload={"w": 3}, max_attempts=5)
    (assign,) = proc.assignments()
    task = assign["task"]
    assert task["task_id"] == task_id and task["state"] == "LEASED"
    assert task["attempt"] == "1" and task["max_attempts"] == "5"
    assert task["payload"] == {"w": 3} and task["queue_id"] == kit.queue_id
    assert assign["epoch"] == "1"
    window = parse_time(assign["lease_until"]) - parse_time(assign["server_time"])
    assert window.total_seconds() == 30
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.LEASED and snap.attempts[0].state.value == "LEASED"


# --------------------------------------------------------------------------- attempts


def _running(kit: Kit, **enqueue: Any) -> tuple[Proc, AttemptRef, str]:
    proc = kit.worker().open()
    task_id = kit.enqueue(**enqueue)
    ref = proc.take()
    assert proc.start(ref).answer.type == "ack"
    return proc, ref, task_id


def test_start_grants_running_lease() -> None:
    """start stores RUNNING and answers an active RUNNING lease and an APPLIED receipt."""
    kit = Kit()
    proc = kit.worker().open()
    task_id = kit.enqueue()
    ref = proc.take()
    result = body(proc.start(ref))
    assert result["deduplicated"] is False
    assert result["receipt"]["operation"] == "start"
    assert result["receipt"]["disposition"] == "APPLIED"
    assert result["lease"]["active"] is True and result["lease"]["state"] == "RUNNING"
    assert "cancel_requested_at" not in result["lease"]
    assert kit.state.task_snapshot(task_id).state is TaskState.RUNNING


def test_second_start_is_refused_and_repeat_is_deduplicated() -> None:
    """A new start of a started attempt is STATE_CONFLICT; the same message_id replays."""
    kit = Kit()
    proc = kit.worker().open()
    kit.enqueue()
    ref = proc.take()
    first = proc.start(ref, message_id="a" * 32)
    again = proc.start(ref, message_id="a" * 32)
    assert body(again)["deduplicated"] is True
    assert body(again)["receipt"] == body(first)["receipt"]
    assert code(proc.start(ref)) == "STATE_CONFLICT"


def test_renew_extends_a_running_lease() -> None:
    """A renew (new message_id) extends lease_until to now + lease window."""
    kit = Kit()
    proc, ref, _ = _running(kit)
    kit.advance(10)
    lease = body(proc.renew(ref))["lease"]
    window = parse_time(lease["lease_until"]) - parse_time(lease["server_time"])
    assert window.total_seconds() == 30


def test_repeated_renew_does_not_extend() -> None:
    """Repeating an old renew's message_id returns its original receipt only."""
    kit = Kit()
    proc, ref, _ = _running(kit)
    first = body(proc.renew(ref, message_id="b" * 32))
    kit.advance(10)
    again = body(proc.renew(ref, message_id="b" * 32))
    assert again["deduplicated"] is True
    assert again["receipt"]["lease_until"] == first["receipt"]["lease_until"]
    assert again["lease"]["lease_until"] == first["lease"]["lease_until"]


def test_renew_before_start_conflicts() -> None:
    """Only a RUNNING attempt can be renewed."""
    kit = Kit()
    proc = kit.worker().open()
    kit.enqueue()
    assert code(proc.renew(proc.take())) == "STATE_CONFLICT"


def test_lease_never_outlives_the_session() -> None:
    """A lease ends no later than the session's expires_at."""
    kit = Kit(session_window=40)
    proc, ref, _ = _running(kit)
    kit.advance(20)
    lease = body(proc.renew(ref))["lease"]
    assert (
        parse_time(lease["lease_until"]) - parse_time(lease["server_time"])
    ).total_seconds() == 20


def test_wrong_lease_secret_is_lease_lost() -> None:
    """A wrong lease_secret is LEASE_LOST everywhere and nothing is stored."""
    kit = Kit()
    proc = kit.worker().open()
    task_id = kit.enqueue()
    ref = proc.take()
    forged = attrs.evolve(ref, lease_secret=new_secret())
    for handled in (proc.start(forged), proc.renew(forged), proc.resume(forged),
                    proc.finish(forged)):  # fmt: skip
        assert code(handled) == "LEASE_LOST"
        assert "secret" not in handled.answer.error[1]
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.LEASED and snap.evidence == ()


def test_other_process_cannot_use_an_attempt() -> None:
    """Knowing the AttemptRef is not enough: another instance gets LEASE_LOST."""
    kit = Kit()
    owner = kit.worker().open()
    kit.enqueue()
    ref = owner.take()
    thief = kit.worker().open()
    assert code(thief.start(ref)) == "LEASE_LOST"


def test_finish_succeeded_frees_the_slot() -> None:
    """A SUCCEEDED finish ends the task and frees the process's slot."""
    kit = Kit()
    proc, ref, task_id = _running(kit)
    result = body(proc.finish(ref, result={"done": True}))
    assert result["receipt"]["task_state"] == "SUCCEEDED"
    assert result["lease"]["active"] is False
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"done": True}
    assert kit.state.session_snapshots()[0].held == 0
    kit.state.check_invariants()


def test_same_message_id_after_resume_on_new_session() -> None:
    """A finish re-sent with its message_id on a new session returns the original answer."""
    kit = Kit()
    proc, ref, _ = _running(kit)
    first = body(proc.finish(ref, message_id="c" * 32))
    proc.hello()
    proc.resume(ref)
    again = body(proc.finish(ref, message_id="c" * 32))
    assert again["deduplicated"] is True and again["receipt"] == first["receipt"]
    kit.state.check_invariants()


def test_same_message_id_other_content_conflicts() -> None:
    """The same message_id with other content, or another retryable, is IDEMPOTENCY_CONFLICT."""
    kit = Kit()
    proc, ref, _ = _running(kit)
    mid = "d" * 32
    proc.finish(ref, "FAILED", {"e": 1}, "BOOM", message_id=mid)
    assert code(proc.finish(ref, "FAILED", {"e": 1}, "BOOM", True, message_id=mid)) == (
        "IDEMPOTENCY_CONFLICT"
    )
    assert code(proc.start(ref, message_id=mid)) == "IDEMPOTENCY_CONFLICT"
    # retryable omitted and false are the same content (omitted means false).
    assert body(proc.finish(ref, "FAILED", {"e": 1}, "BOOM", False, message_id=mid))["deduplicated"]


def test_same_finish_under_new_message_id_returns_first_receipt() -> None:
    """Re-reporting the same result under a new message_id frees nothing twice."""
    kit = Kit()
    proc = kit.worker(capacity=2).open()
    kit.enqueue()
    ref = proc.take()
    proc.start(ref)
    first = body(proc.finish(ref, result={"v": 1}))
    again = body(proc.finish(ref, result={"v": 1}))
    assert again["receipt"] == first["receipt"] and again["deduplicated"] is True
    assert kit.state.session_snapshots()[0].held == 0
    kit.state.check_invariants()


def test_conflicting_finish_is_evidence_only() -> None:
    """Another result for a finished attempt is kept as EVIDENCE_ONLY; the outcome stands."""
    kit = Kit()
    proc, ref, task_id = _running(kit)
    proc.finish(ref, result={"v": 1})
    other = body(proc.finish(ref, "FAILED", {"v": 2}, "LATE"))
    assert other["receipt"]["disposition"] == "EVIDENCE_ONLY"
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"v": 1}
    (ev,) = snap.evidence
    assert ev.reason == "conflict" and ev.result == {"v": 2} and ev.error_code == "LATE"


def test_finish_of_never_started_attempt_is_evidence() -> None:
    """A result for an attempt that never started is evidence and grants nothing."""
    kit = Kit()
    proc = kit.worker().open()
    task_id = kit.enqueue()
    ref = proc.take()
    result = body(proc.finish(ref))
    assert result["receipt"]["disposition"] == "EVIDENCE_ONLY"
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.LEASED and snap.evidence[0].reason == "not_started"


def test_late_finish_after_lease_expiry_is_evidence() -> None:
    """A result after the lease expired is evidence; the recovery outcome stands."""
    kit = Kit()
    proc, ref, task_id = _running(kit)
    kit.advance(32)
    assert kit.state.task_snapshot(task_id).state is TaskState.NEEDS_REVIEW
    result = body(proc.finish(ref))
    assert result["receipt"]["disposition"] == "EVIDENCE_ONLY"
    assert result["lease"]["active"] is False
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.NEEDS_REVIEW and snap.evidence[0].reason == "late"


def test_resume_moves_a_live_attempt() -> None:
    """resume binds a live attempt to the new session without extending it."""
    kit = Kit()
    proc, ref, task_id = _running(kit)
    before = kit.state.task_snapshot(task_id).attempts[0].lease_until
    proc.hello()
    assert code(proc.renew(ref)) == "LEASE_LOST"
    lease = body(proc.resume(ref))
    assert lease["active"] is True and lease["state"] == "RUNNING"
    att = kit.state.task_snapshot(task_id).attempts[0]
    assert att.session_id == proc.session_id and att.lease_until == before
    assert body(proc.renew(ref))["lease"]["active"] is True


def test_resume_of_expired_attempt_is_inactive() -> None:
    """resume of an attempt whose lease is gone answers an inactive lease."""
    kit = Kit()
    proc, ref, _ = _running(kit)
    kit.advance(32)
    lease = body(proc.resume(ref))
    assert lease["active"] is False and lease["state"] == "UNKNOWN"


def test_start_of_unresumed_attempt_after_reconnect_is_lease_lost() -> None:
    """An attempt assigned to an older session must be resumed before it can start."""
    kit = Kit()
    proc = kit.worker().open()
    kit.enqueue()
    ref = proc.take()
    proc.hello()
    assert code(proc.start(ref)) == "LEASE_LOST"
    proc.resume(ref)
    assert body(proc.start(ref))["lease"]["active"] is True


# --------------------------------------------------------------------------- recovery and policy


def test_expired_before_start_backs_off_then_fails() -> None:
    """An unstarted lease expiry returns the task to WAITING with backoff; the budget ends it."""
    kit = Kit()
    proc = kit.worker(capacity=2).open()
    task_id = kit.enqueue(max_attempts=2, backoff_initial=5)
    proc.take()
    kit.advance(32)
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.WAITING and snap.attempts[0].state.value == "EXPIRED"
    assert snap.next_run_at is not None
    proc.capacity()  # keep the session alive
    assert proc.assignments() == []
    kit.advance(5)
    assert len(proc.assignments()) == 1
    kit.advance(32)
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.FAILED and snap.error_code == "LEASE_EXPIRED"
    assert not snap.effect_uncertain
    kit.state.check_invariants()


def test_started_then_lost_reconcile_only_needs_review() -> None:
    """A started attempt whose lease expires is UNKNOWN; RECONCILE_ONLY goes to NEEDS_REVIEW."""
    kit = Kit()
    _, _, task_id = _running(kit)
    kit.advance(32)
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.NEEDS_REVIEW
    assert snap.attempts[0].state.value == "UNKNOWN" and snap.effect_uncertain


def test_started_then_lost_idempotent_retries_keeping_uncertainty() -> None:
    """IDEMPOTENT retries after a lost start and keeps effect_uncertain; a failure then
    becomes NEEDS_REVIEW, never FAILED."""
    kit = Kit()
    proc, _, task_id = _running(kit, retry_safety="IDEMPOTENT", backoff_initial=5)
    kit.advance(32)
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.WAITING and snap.effect_uncertain
    assert snap.attempts[0].state.value == "UNKNOWN"
    proc.capacity()
    kit.advance(5)
    ref = proc.take()
    proc.start(ref)
    proc.finish(ref, "FAILED", {}, "BOOM")
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.NEEDS_REVIEW and snap.effect_uncertain


def test_recovery_scan_batches_of_100_every_2s() -> None:
    """A scan recovers at most 100 expired attempts; the next scan 2 s later takes the rest."""
    kit = Kit()
    procs = [kit.worker(capacity=1).open() for _ in range(150)]
    for _ in range(150):
        kit.enqueue(max_attempts=1)
    for p in procs:
        p.take()
    kit.advance(30)  # the scan at exactly lease_until
    failed = [t for t in kit.state.task_snapshots() if t.state is TaskState.FAILED]
    assert len(failed) == 100
    kit.advance(2)
    failed = [t for t in kit.state.task_snapshots() if t.state is TaskState.FAILED]
    assert len(failed) == 150


def test_recovery_runs_on_scan_ticks_only() -> None:
    """An expired lease is not recovered before the next 2 s scan tick."""
    kit = Kit()
    proc = kit.worker().open()
    kit.advance(1)  # leases now end between scan ticks
    task_id = kit.enqueue(max_attempts=1)
    proc.take()
    kit.advance(30)
    assert kit.state.task_snapshot(task_id).state is TaskState.LEASED
    kit.advance(1)
    assert kit.state.task_snapshot(task_id).state is TaskState.FAILED


def test_waiting_past_deadline_or_latest_start_fails() -> None:
    """A WAITING task past its total deadline or latest start is FAILED."""
    kit = Kit()
    a = kit.enqueue(deadline=10)
    b = kit.enqueue(latest_start=5)
    kit.advance(7)
    assert kit.state.task_snapshot(b).state is TaskState.FAILED
    assert kit.state.task_snapshot(a).state is TaskState.WAITING
    kit.advance(4)
    snap = kit.state.task_snapshot(a)
    assert snap.state is TaskState.FAILED and snap.error_code == "DEADLINE_EXCEEDED"


def test_deadline_with_uncertain_history_needs_review() -> None:
    """Past the deadline with uncertain history the task is NEEDS_REVIEW."""
    kit = Kit()
    _, _, task_id = _running(kit, retry_safety="IDEMPOTENT", deadline=100, backoff_initial=40)
    kit.advance(32)
    assert kit.state.task_snapshot(task_id).state is TaskState.WAITING
    kit.advance(70)
    assert kit.state.task_snapshot(task_id).state is TaskState.NEEDS_REVIEW


def test_lease_capped_by_deadline_and_attempt_time_limit() -> None:
    """A lease never passes the task deadline or start + attempt_time_limit."""
    kit = Kit()
    proc, ref, _ = _running(kit, attempt_time_limit=12)
    kit.advance(5)
    lease = body(proc.renew(ref))["lease"]
    assert (
        parse_time(lease["lease_until"]) - parse_time(lease["server_time"])
    ).total_seconds() == 7
    kit2 = Kit()
    proc2 = kit2.worker().open()
    kit2.enqueue(deadline=10)
    (assign,) = proc2.assignments()
    assert (
        parse_time(assign["lease_until"]) - parse_time(assign["server_time"])
    ).total_seconds() == 10


def test_failed_retryable_backs_off_exponentially_until_budget() -> None:
    """FAILED + retryable retries with doubling backoff (capped) until max_attempts."""
    kit = Kit(session_window=300)
    proc = kit.worker().open()
    task_id = kit.enqueue(max_attempts=3, backoff_initial=2, backoff_max=3)
    delays = []
    for _ in range(3):
        kit.advance(10)
        proc.capacity()
        ref = proc.take()
        proc.start(ref)
        before = kit.clock.now()
        proc.finish(ref, "FAILED", {}, "TRANSIENT", True)
        snap = kit.state.task_snapshot(task_id)
        if snap.next_run_at is not None:
            delays.append(snap.next_run_at.timestamp() - before)
    assert delays == [2, 3]
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.FAILED and snap.error_code == "TRANSIENT"
    assert len(snap.attempts) == 3


def test_failed_not_retryable_is_final() -> None:
    """FAILED without retryable ends the task at once."""
    kit = Kit()
    proc, ref, task_id = _running(kit)
    proc.finish(ref, "FAILED", {"why": 1}, "BAD_INPUT")
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.FAILED and snap.result == {"why": 1}


def test_unknown_outcome_follows_retry_safety() -> None:
    """UNKNOWN retries under IDEMPOTENT and goes to NEEDS_REVIEW under RECONCILE_ONLY."""
    kit = Kit()
    proc, ref, task_id = _running(kit, retry_safety="IDEMPOTENT")
    proc.finish(ref, "UNKNOWN", {}, "TIMEOUT")
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.WAITING and snap.effect_uncertain
    kit2 = Kit()
    proc2, ref2, task2 = _running(kit2)
    proc2.finish(ref2, "UNKNOWN", {}, "TIMEOUT")
    assert kit2.state.task_snapshot(task2).state is TaskState.NEEDS_REVIEW


def test_cancelled_finish_needs_a_cancel_request() -> None:
    """CANCELLED without a stored cancel request is STATE_CONFLICT and changes nothing."""
    kit = Kit()
    proc, ref, task_id = _running(kit)
    assert code(proc.finish(ref, "CANCELLED", {}, "STOPPED")) == "STATE_CONFLICT"
    assert kit.state.task_snapshot(task_id).state is TaskState.RUNNING


# --------------------------------------------------------------------------- cancellation


def test_cancel_waiting_is_immediate() -> None:
    """A WAITING task cancelled goes straight to CANCELLED."""
    kit = Kit()
    task_id = kit.enqueue()
    kit.cancel(task_id)
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.CANCELLED and snap.cancel_requested_at is not None


def test_cancel_running_marks_leases_and_stops_renewal() -> None:
    """After a cancel request every lease carries cancel_requested_at, renew no longer
    extends, the notification goes to sessions that asked, and CANCELLED is accepted."""
    kit = Kit()
    proc = kit.worker(notifications=True).open()
    task_id = kit.enqueue()
    ref = proc.take()
    proc.start(ref)
    kit.advance(5)
    kit.cancel(task_id)
    (notice,) = [p for p in proc.pushes if p.type == "task.cancel"]
    assert notice.body is not None and notice.body["attempt_id"] == ref.attempt_id
    before = body(proc.resume(ref))["lease_until"]
    kit.advance(5)
    lease = body(proc.renew(ref))["lease"]
    assert lease["active"] is True and lease["lease_until"] == before
    assert lease["cancel_requested_at"] == notice.body["cancel_requested_at"]
    result = body(proc.finish(ref, "CANCELLED", {}, "STOPPED"))
    assert result["receipt"]["task_state"] == "CANCELLED"
    assert "cancel_requested_at" in result["lease"]


def test_cancel_notice_only_for_sessions_that_asked() -> None:
    """A session without cancellation_notifications gets no task.cancel push."""
    kit = Kit()
    proc, _, task_id = _running(kit)
    kit.cancel(task_id)
    assert [p for p in proc.pushes if p.type == "task.cancel"] == []


def _may_run(lease: dict[str, Any]) -> bool:
    cancel = lease.get("cancel_requested_at")
    return (
        Lease(
            active=lease["active"],
            state=lease["state"],
            lease_until=parse_time(lease["lease_until"]),
            server_time=parse_time(lease["server_time"]),
            cancel_requested_at=None if cancel is None else parse_time(cancel),
        )
        .with_deadline(time.monotonic())
        .may_run()
    )


def test_cancel_leased_keeps_the_attempt_and_start_carries_the_request() -> None:
    """Cancel while LEASED keeps the attempt; start answers RUNNING + cancel; CANCELLED ends it."""
    kit = Kit()
    proc = kit.worker(notifications=True).open()
    task_id = kit.enqueue()
    ref = proc.take()
    kit.cancel(task_id)
    (notice,) = [p for p in proc.pushes if p.type == "task.cancel"]
    assert notice.body is not None and notice.body["attempt_id"] == ref.attempt_id
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.LEASED and snap.attempts[0].state.value == "LEASED"
    assert body(proc.resume(ref))["cancel_requested_at"] == notice.body["cancel_requested_at"]
    lease = body(proc.start(ref))["lease"]
    assert lease["active"] is True and lease["state"] == "RUNNING"
    assert lease["cancel_requested_at"] == notice.body["cancel_requested_at"]
    assert not _may_run(lease)
    assert kit.state.task_snapshot(task_id).state is TaskState.RUNNING
    result = body(proc.finish(ref, "CANCELLED", {"ran": False}, "CANCELLED"))
    assert result["receipt"]["disposition"] == "APPLIED"
    assert result["receipt"]["task_state"] == "CANCELLED"
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.CANCELLED and snap.attempts[0].state.value == "CANCELLED"
    assert kit.state.session_snapshots()[0].held == 0
    kit.state.check_invariants()


def test_cancel_leased_without_start_ends_cancelled_at_lease_expiry() -> None:
    """Cancel while LEASED, never started: lease expiry ends the task CANCELLED, slot freed once."""
    kit = Kit()
    proc = kit.worker().open()
    task_id = kit.enqueue()
    ref = proc.take()
    kit.cancel(task_id)
    assert kit.state.session_snapshots()[0].held == 1
    kit.state.check_invariants()
    kit.advance(31)
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.CANCELLED and snap.attempts[0].state.value == "EXPIRED"
    assert len(snap.attempts) == 1 and not snap.effect_uncertain
    assert kit.state.session_snapshots()[0].held == 0
    assert code(proc.start(ref)) == "LEASE_LOST"
    kit.advance(120)
    assert kit.state.task_snapshot(task_id).state is TaskState.CANCELLED
    kit.state.check_invariants()


def test_cancel_started_then_lost_is_never_retried() -> None:
    """Cancelled, started, then lost: NEEDS_REVIEW, never retried even when IDEMPOTENT."""
    kit = Kit()
    proc = kit.worker().open()
    task_id = kit.enqueue(retry_safety="IDEMPOTENT")
    ref = proc.take()
    kit.cancel(task_id)
    proc.start(ref)
    kit.advance(31)
    snap = kit.state.task_snapshot(task_id)
    assert snap.state is TaskState.NEEDS_REVIEW and len(snap.attempts) == 1
    assert kit.state.session_snapshots()[0].held == 0
    kit.state.check_invariants()


def test_cancel_never_overwrites_uncertain_history() -> None:
    """A cancel after an UNKNOWN attempt ends in NEEDS_REVIEW, not CANCELLED."""
    kit = Kit()
    proc, ref, task_id = _running(kit, retry_safety="IDEMPOTENT", backoff_initial=60)
    proc.finish(ref, "UNKNOWN", {}, "TIMEOUT")
    kit.cancel(task_id)
    assert kit.state.task_snapshot(task_id).state is TaskState.NEEDS_REVIEW


def test_cancel_stops_retries() -> None:
    """A retryable failure after a cancel request does not retry."""
    kit = Kit()
    proc, ref, task_id = _running(kit)
    kit.cancel(task_id)
    proc.finish(ref, "FAILED", {}, "TRANSIENT", True)
    assert kit.state.task_snapshot(task_id).state is TaskState.FAILED


# --------------------------------------------------------------------------- limits


def test_queue_max_concurrency() -> None:
    """A queue never has more live attempts than its max_concurrency, across processes."""
    kit = Kit(max_concurrency=2)
    a = kit.worker().open()
    b = kit.worker().open()
    for _ in range(5):
        kit.enqueue()
    assert len(a.assignments()) + len(b.assignments()) == 2
    kit.route(kit.state.set_max_concurrency(None, 3))
    assert len(a.assignments()) + len(b.assignments()) == 1


def test_assignment_rate_limit() -> None:
    """At most N new assignments per second of server time."""
    kit = Kit(assignment_rate=4)
    proc = kit.worker(capacity=20).open()
    for _ in range(10):
        kit.enqueue()
    assert len(proc.assignments()) == 4
    kit.advance(0.5)
    assert proc.assignments() == []
    kit.advance(0.5)
    assert len(proc.assignments()) == 4


def test_pause_stops_dispatch_and_start() -> None:
    """A paused queue assigns nothing and refuses start with UNAVAILABLE."""
    kit = Kit()
    proc = kit.worker().open()
    kit.enqueue()
    ref = proc.take()
    kit.state.pause_queue()
    kit.enqueue()
    assert proc.assignments() == []
    assert code(proc.start(ref)) == "UNAVAILABLE"
    kit.route(kit.state.resume_queue())
    assert len(proc.assignments()) == 1
    assert proc.start(ref).answer.type == "ack"


def test_request_rate_limit() -> None:
    """Past the per-session request rate the server answers RATE_LIMITED, not applying it."""
    kit = Kit(request_rate=3)
    proc = kit.worker().open()  # capacity counted: 1 request
    assert proc.capacity(sequence=1).answer.type == "ack"
    assert proc.capacity(sequence=1).answer.type == "ack"
    assert code(proc.capacity(sequence=1)) == "RATE_LIMITED"
    kit.advance(1)
    assert proc.capacity(sequence=1).answer.type == "ack"


# --------------------------------------------------------------------------- inspection


def test_invariants_catch_a_double_release() -> None:
    """check_invariants reports a slot counter that no longer matches the attempts."""
    kit = Kit()
    _running(kit)
    kit.state.check_invariants()
    kit.state._queues[kit.queue_id].in_use -= 1
    with pytest.raises(InvariantError, match="counts"):
        kit.state.check_invariants()


def test_invariants_catch_two_running_attempts() -> None:
    """check_invariants reports a task with two RUNNING attempts."""
    kit = Kit()
    _running(kit)
    task = next(iter(kit.state._tasks.values()))
    task.attempts.append(attrs.evolve(task.attempts[0], number=2, epoch=2))
    with pytest.raises(InvariantError, match="RUNNING attempts"):
        kit.state.check_invariants()


def test_event_log_records_transitions_with_server_time() -> None:
    """Every task transition is logged with the server time it happened at."""
    kit = Kit()
    proc, ref, task_id = _running(kit)
    kit.advance(3)
    proc.finish(ref)
    states = [
        (e.old, e.new, e.at.timestamp())
        for e in kit.state.events()
        if e.kind == "task.state" and e.task_id == task_id
    ]
    start = kit.clock.now() - 3
    assert states == [
        ("WAITING", "LEASED", start),
        ("LEASED", "RUNNING", start),
        ("RUNNING", "SUCCEEDED", start + 3),
    ]


def test_snapshots_are_frozen_and_secret_free() -> None:
    """Snapshots are immutable and never carry a lease secret."""
    kit = Kit()
    _, ref, task_id = _running(kit)
    snap = kit.state.task_snapshot(task_id)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snap.state = TaskState.FAILED
    assert ref.lease_secret not in repr(snap)
    assert ref.lease_secret not in repr(kit.state.session_snapshots())
    assert ref.lease_secret not in repr(kit.state.events())


def test_enqueue_validates_arguments() -> None:
    """Bad handlers, payloads and policies raise before anything is stored."""
    kit = Kit()
    with pytest.raises(ValueError):
        kit.enqueue("Bad")
    with pytest.raises(ValueError):
        kit.state.enqueue("resize", None)
    with pytest.raises(ValueError):
        kit.enqueue(payload=float("nan"))
    with pytest.raises(ValueError):
        kit.enqueue(max_attempts=0)
    with pytest.raises(ValueError):
        kit.enqueue(backoff_initial=5, backoff_max=1)
    with pytest.raises(ValueError):
        kit.enqueue(payload="x" * (512 * 1024))
    assert kit.state.task_snapshots() == ()


def test_add_token_with_a_chosen_value() -> None:
    """A chosen token value works like a generated one; bad or duplicate values are refused."""
    kit = Kit()
    scopes = {SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(kit.queue_id)}
    assert kit.state.add_token(scopes, token="fixed-token-1") == "fixed-token-1"
    assert kit.worker(token="fixed-token-1").hello().answer.type == "worker.welcome"
    with pytest.raises(ValueError, match="already registered"):
        kit.state.add_token(scopes, token="fixed-token-1")
    with pytest.raises(ValueError) as info:
        kit.state.add_token(scopes, token="has space")
    assert "has space" not in str(info.value)


# --------------------------------------------------------------------------- wire forms


def _model_form(cls: type[Any], wire: dict[str, Any]) -> dict[str, Any]:
    """*wire* through the strict model and back: the canonical wire form of its content."""
    return unstructure(decode_body(wire, cls))


def test_assignment_and_lease_bodies_are_the_models_wire_forms() -> None:
    """Assignment and lease bodies are wire forms of valid models: strict decoding and
    re-encoding gives them back unchanged."""
    kit = Kit()
    proc = kit.worker(capacity=1).open()
    kit.enqueue(payload={"n": [1, 2.5, "x"]})
    assign = proc.assignments()[0]
    assert assign == _model_form(Assignment, assign)
    ref = ref_of(assign)
    started = body(proc.start(ref))
    assert started["lease"] == _model_form(Lease, started["lease"])
    kit.cancel(ref.task_id)
    renewed = body(proc.renew(ref))
    assert "cancel_requested_at" in renewed["lease"]
    assert renewed["lease"] == _model_form(Lease, renewed["lease"])
    finished = body(proc.finish(ref, "CANCELLED", {}, "STOPPED"))
    assert finished["lease"]["active"] is False
    assert finished["lease"] == _model_form(Lease, finished["lease"])
