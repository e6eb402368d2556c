"""OrbitState at scale: bulk enqueue, dispatch order, exact timers, bounded state."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
from _independent import parse_time
from _rawclient import RawClient
from _serverkit import CAP, SCOPE_CONNECT, SCOPE_CONSUME, Kit, Proc, body, code, queue_scope

from orbit_sync.models import Capability, TaskState, new_message_id
from orbit_sync.testing import AdminAPI, AdminClient, ManualClock, MockOrbitServer


def test_enqueue_many_creates_in_order_and_dispatches_once() -> None:
    """enqueue_many stores every task in order and assigns the oldest first."""
    kit = Kit()
    proc = kit.worker(capacity=2).open()
    ids, actions = kit.state.enqueue_many(
        [{"handler": "resize", "payload": {"n": i}} for i in range(5)]
    )
    kit.route(actions)
    assert len(ids) == 5 and len(set(ids)) == 5
    assert [t.task_id for t in kit.state.task_snapshots()] == ids
    assert [b["task"]["task_id"] for b in proc.assignments()] == ids[:2]


def test_enqueue_many_is_all_or_nothing() -> None:
    """A bad spec raises naming its index and creates none of the tasks."""
    kit = Kit()
    good = {"handler": "resize", "payload": {"n": 1}}
    with pytest.raises(ValueError, match="spec 1"):
        kit.state.enqueue_many([good, {"handler": "resize", "payload": None}])
    with pytest.raises(TypeError, match="spec 1 has unknown keys: colour"):
        kit.state.enqueue_many([good, {**good, "colour": "red"}])
    with pytest.raises(ValueError, match="spec 0 lacks 'payload'"):
        kit.state.enqueue_many([{"handler": "resize"}])
    with pytest.raises(TypeError):
        kit.state.enqueue_many(good)  # type: ignore[arg-type]
    assert kit.state.task_snapshots() == ()
    ids, _ = kit.state.enqueue_many([{**good, "max_attempts": 2, "backoff_initial": 0.5}])
    snap = kit.state.task_snapshot(ids[0])
    assert snap.state is TaskState.WAITING and snap.policy.max_attempts == 2


# --------------------------------------------------------------------------- dispatch order


def _assigned_ids(proc: Proc) -> list[str]:
    return [b["task"]["task_id"] for b in proc.assignments()]


def test_dispatch_is_oldest_ready_first_across_capabilities() -> None:
    """Tasks go out in (ready time, enqueue order) across every heap a session can take from."""
    kit = Kit()
    crop = Capability("crop", "1", "1")
    proc = kit.worker(capacity=1, capabilities=[CAP, crop]).open()
    first = kit.enqueue()  # assigned at once
    ids = [kit.enqueue("crop"), kit.enqueue(), kit.enqueue("crop"), kit.enqueue()]
    taken = []
    for _ in range(5):
        ref = proc.take()
        taken.append(ref.task_id)
        proc.start(ref)
        proc.finish(ref)
    assert taken == [first, *ids]


def test_unservable_tasks_do_not_block_servable_ones() -> None:
    """Tasks no session can take stay WAITING without holding back a later servable task."""
    kit = Kit()
    proc = kit.worker(capacity=1).open()
    stuck = [kit.enqueue("crop") for _ in range(50)]
    wanted = kit.enqueue()
    assert _assigned_ids(proc) == [wanted]
    assert {kit.state.task_snapshot(t).state for t in stuck} == {TaskState.WAITING}


def test_retry_waits_behind_tasks_ready_before_it() -> None:
    """A retried task rejoins the order at its backoff end, after tasks ready earlier."""
    kit = Kit()
    proc = kit.worker(capacity=1).open()
    retried = kit.enqueue(backoff_initial=1.0)
    ref = proc.take()
    proc.start(ref)
    later = kit.enqueue()
    proc.finish(ref, "FAILED", {}, "BOOM", retryable=True)
    kit.advance(5)  # the retry is ready now, but `later` was ready first
    ref2 = proc.take()
    assert ref2.task_id == later
    proc.start(ref2)
    proc.finish(ref2)
    assert _assigned_ids(proc) == [retried]


def test_queue_limits_and_pause_gate_their_own_heap_only() -> None:
    """A paused queue's tasks wait while another queue's tasks keep flowing."""
    kit = Kit()
    other = kit.state.add_queue()
    token = kit.state.add_token({SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(other)})
    a = kit.worker(capacity=2).open()
    b = kit.worker(capacity=2, token=token, queue_id=other).open()
    kit.route(kit.state.pause_queue(kit.queue_id))
    held = kit.enqueue()
    flowing = kit.enqueue(queue_id=other)
    assert _assigned_ids(a) == [] and _assigned_ids(b) == [flowing]
    kit.route(kit.state.resume_queue(kit.queue_id))
    assert _assigned_ids(a) == [held]


# --------------------------------------------------------------------------- exact timers


def test_backoff_retry_is_reassigned_at_its_moment() -> None:
    """A retry with a 50 ms backoff is due exactly then, and assigned then, not a scan later."""
    kit = Kit()
    proc = kit.worker(capacity=1).open()
    task_id = kit.enqueue(backoff_initial=0.05, backoff_max=0.05)
    ref = proc.take()
    proc.start(ref)
    proc.finish(ref, "FAILED", {}, "BOOM", retryable=True)
    moment = kit.state.now_us() + 50_000
    assert kit.state.next_due() == moment
    kit.advance(0.049)
    assert proc.assignments() == []
    kit.advance(0.001)
    bodies = proc.assignments()
    assert [b["task"]["task_id"] for b in bodies] == [task_id]
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    assert parse_time(bodies[0]["server_time"]) == epoch + dt.timedelta(microseconds=moment)


def test_passed_moment_stays_due_until_run() -> None:
    """Time that passes a backoff end on its own (a real clock) leaves the work due now."""
    kit = Kit()
    proc = kit.worker(capacity=1).open()
    kit.enqueue(backoff_initial=0.05, backoff_max=0.05)
    ref = proc.take()
    proc.start(ref)
    proc.finish(ref, "FAILED", {}, "BOOM", retryable=True)
    kit.clock.advance(0.2)  # the clock moves without the state stepping through it
    due = kit.state.next_due()
    assert due is not None and due <= kit.state.now_us()
    kit.route(kit.state.run_due())
    assert len(proc.assignments()) == 1


def test_passed_rate_window_stays_due_until_run() -> None:
    """A full assignment-rate window that frees on its own leaves the dispatch due now."""
    kit = Kit(assignment_rate=1)
    proc = kit.worker(capacity=4).open()
    kit.enqueue()
    kit.enqueue()
    assert len(proc.assignments()) == 1
    kit.clock.advance(1.5)  # the window frees without the state stepping through it
    due = kit.state.next_due()
    assert due is not None and due <= kit.state.now_us()
    kit.route(kit.state.run_due())
    assert len(proc.assignments()) == 1


def test_assignment_rate_window_releases_on_time() -> None:
    """At 4 per second the 5th assignment is due one second after the first, exactly."""
    kit = Kit(assignment_rate=4)
    proc = kit.worker(capacity=8).open()
    t0 = kit.state.now_us()
    for _ in range(6):
        kit.enqueue()
    assert len(proc.assignments()) == 4
    assert kit.state.next_due() == t0 + 1_000_000
    kit.advance(0.999)
    assert proc.assignments() == []
    kit.advance(0.001)
    assert len(proc.assignments()) == 2


def test_session_expires_at_its_moment() -> None:
    """A session that is not renewed expires at expires_at, not at the next scan tick."""
    kit = Kit()
    kit.advance(1)  # off the 2 s scan grid
    proc = kit.worker().open()
    sid = proc.session_id
    assert sid is not None
    kit.advance(44.999)
    assert sid not in kit.closed
    kit.advance(0.001)
    assert sid in kit.closed
    assert [p.error for p in kit.inbox[sid] if p.type == "error"] == [
        ("STALE_SESSION", "the session expired without a renewal")
    ]


def test_idle_state_schedules_nothing() -> None:
    """With no lease, backoff, session or retention pending, there is no due moment."""
    kit = Kit(retention=None)
    assert kit.state.next_due() is None
    kit.enqueue()  # nobody to take it: still nothing timed
    assert kit.state.next_due() is None


def test_real_time_backoff_retries_are_not_held_for_the_scan() -> None:
    """On a real clock, back-to-back 50 ms retries are reassigned at their moment each time."""
    with MockOrbitServer(assignment_rate=None) as server:
        client = RawClient(server).open(capacity=1)
        task_id = server.enqueue(
            "resize", {"n": 1}, max_attempts=3, backoff_initial=0.05, backoff_max=0.05
        )
        for number in range(3):
            ref = RawClient.ref(client.next_push(timeout=5.0))
            client.start(ref)
            if number < 2:
                client.finish(ref, "FAILED", {}, "BOOM", retryable=True)
        client.close()
        attempts = server.task(task_id).attempts
    for before, after in itertools.pairwise(attempts):
        assert before.finished_at is not None
        late = after.assigned_at - before.finished_at
        # Due 50 ms later; a 2 s scan would hold a retry that follows a scan for ~2 s.
        assert dt.timedelta(milliseconds=50) <= late < dt.timedelta(seconds=1)


def test_real_time_rate_window_releases_on_time() -> None:
    """On a real clock at 4 assignments/s, the 5th follows the 1st by one second."""
    with MockOrbitServer(assignment_rate=4) as server:
        client = RawClient(server, capacity=8).open()
        for _ in range(5):
            server.enqueue("resize", {"n": 1})
        times = [parse_time(client.next_push(timeout=5.0)["body"]["server_time"]) for _ in range(5)]
        client.close()
    assert dt.timedelta(seconds=1) <= times[4] - times[0] < dt.timedelta(seconds=1.5)


def test_exact_recovery_expires_each_lease_at_its_moment() -> None:
    """With exact_recovery, an off-grid lease expiry is recovered at lease_until, all at once."""
    kit = Kit(exact_recovery=True)
    procs = [kit.worker(capacity=1).open() for _ in range(101)]  # one more than a scan batch
    kit.advance(1)  # leases now end between the 2 s scan ticks
    ids = [kit.enqueue(max_attempts=1) for _ in range(101)]
    for p in procs:
        p.take()
    kit.advance(30 - 0.001)
    assert {kit.state.task_snapshot(t).state for t in ids} == {TaskState.LEASED}
    assert kit.state.next_due() == kit.state.now_us() + 1000
    kit.advance(0.001)
    assert {kit.state.task_snapshot(t).state for t in ids} == {TaskState.FAILED}  # no batches
    overdue = kit.enqueue("crop", deadline=0.5)
    kit.advance(0.5)
    assert kit.state.task_snapshot(overdue).state is TaskState.FAILED
    kit.state.check_invariants()


# --------------------------------------------------------------------------- bounded state


def test_ended_task_session_and_instance_are_forgotten_after_retention() -> None:
    """An ended task, a closed expired session and its process are dropped a retention later."""
    kit = Kit(retention=60)
    proc = kit.worker().open()
    task_id = kit.enqueue()
    ref = proc.take()
    proc.start(ref)
    proc.finish(ref)
    sid = proc.session_id
    assert sid is not None
    kit.route(kit.state.connection_lost(sid))
    kit.advance(59)
    assert kit.state.task_snapshot(task_id).state is TaskState.SUCCEEDED
    kit.advance(1)
    with pytest.raises(KeyError):
        kit.state.task_snapshot(task_id)
    assert [s.session_id for s in kit.state.session_snapshots()] == [sid]  # not ended yet
    kit.advance(45 + 60)  # expired at 45 s, then a retention
    assert kit.state.session_snapshots() == ()
    assert kit.state.bounds()["instances"] == 0
    kit.state.check_invariants()
    # The process may come back: a fresh record, as for a new process.
    assert proc.hello().answer.type == "worker.welcome"


def test_live_session_and_waiting_task_are_kept() -> None:
    """Retention never drops a connected session or an unfinished task."""
    kit = Kit(retention=1)
    proc = kit.worker().open()
    waiting = kit.enqueue("crop")
    for _ in range(10):
        kit.advance(10)
        assert proc.capacity(sequence=1).answer.type == "ack"  # renew the session
    assert kit.state.task_snapshot(waiting).state is TaskState.WAITING
    assert len(kit.state.session_snapshots()) == 1


def test_receipts_are_kept_for_the_idempotency_window() -> None:
    """A message_id replays its receipt within the window; after it, it names a new request."""
    kit = Kit(idempotency_window=10)
    proc = kit.worker().open()
    kit.enqueue()
    ref = proc.take()
    proc.start(ref)
    renewal = new_message_id()
    assert body(proc.renew(ref, message_id=renewal))["deduplicated"] is False
    kit.advance(9)
    assert proc.capacity(sequence=1).answer.type == "ack"
    assert body(proc.renew(ref, message_id=renewal))["deduplicated"] is True
    kit.advance(1)
    assert body(proc.renew(ref, message_id=renewal))["deduplicated"] is False


def test_capacity_heartbeats_keep_only_the_latest_receipt() -> None:
    """A process's capacity reports keep one receipt between them: each supersedes the last."""
    kit = Kit()
    proc = kit.worker().open()
    first = new_message_id()
    assert proc.capacity(sequence=1, message_id=first).answer.type == "ack"
    for _ in range(50):
        assert proc.capacity(sequence=1).answer.type == "ack"
    assert kit.state.bounds()["receipts"] == 1
    # The first message_id was forgotten: it now names a new report, not a conflict.
    assert code(proc.capacity(sequence=2, message_id=first)) is None
    assert kit.state.bounds()["receipts"] == 1
    assert code(proc.capacity(sequence=3, message_id=first)) == "IDEMPOTENCY_CONFLICT"


def test_resume_receipts_end_with_their_session() -> None:
    """A resume's receipt is kept while its session lives and dropped when it ends."""
    kit = Kit()
    proc = kit.worker().open()
    kit.enqueue()
    ref = proc.take()
    resumed = new_message_id()
    before = kit.state.bounds()["receipts"]
    assert body(proc.resume(ref, message_id=resumed))["active"] is True
    assert kit.state.bounds()["receipts"] == before + 1
    sid = proc.session_id
    assert sid is not None
    proc.hello()  # a reconnect: the old session is stale ...
    kit.route(kit.state.connection_lost(sid))  # ... and closed, so it ended
    assert kit.state.bounds()["receipts"] == before
    assert proc.capacity(sequence=2).answer.type == "ack"
    assert body(proc.resume(ref, message_id=resumed))["active"] is True


def test_forgotten_process_takes_its_capacity_receipt_along() -> None:
    """When retention forgets a worker process, its last capacity receipt goes with it."""
    kit = Kit(retention=5, idempotency_window=3600)
    proc = kit.worker().open()
    assert kit.state.bounds()["receipts"] == 1
    assert proc.session_id is not None
    kit.route(kit.state.connection_lost(proc.session_id))
    kit.advance(45 + 5)  # the session expires, then a retention
    assert kit.state.bounds()["instances"] == kit.state.bounds()["receipts"] == 0


def test_receipt_count_cap_forgets_the_oldest_first() -> None:
    """Past max_receipts the oldest receipt goes: a start re-sent then is a new request."""
    kit = Kit(max_receipts=3)
    proc = kit.worker().open()  # receipt 1: capacity
    kit.enqueue()
    ref = proc.take()
    started = new_message_id()
    assert body(proc.start(ref, message_id=started))["deduplicated"] is False  # receipt 2
    assert body(proc.start(ref, message_id=started))["deduplicated"] is True
    renewals = [new_message_id() for _ in range(2)]
    for renewal in renewals:  # receipts 3 and 4: the capacity receipt goes
        proc.renew(ref, message_id=renewal)
    assert kit.state.receipts_evicted == 1
    assert body(proc.start(ref, message_id=started))["deduplicated"] is True
    proc.renew(ref)  # receipt 5: the start's receipt goes
    assert kit.state.bounds()["receipts"] == 3 and kit.state.receipts_evicted == 2
    assert code(proc.start(ref, message_id=started)) == "STATE_CONFLICT"
    assert body(proc.renew(ref, message_id=renewals[1]))["deduplicated"] is True
    with pytest.raises(ValueError, match="max_receipts"):
        Kit(max_receipts=0)


def test_event_log_is_a_ring_that_says_it_was_truncated() -> None:
    """The event log keeps the newest events and counts the ones it dropped."""
    kit = Kit(event_log_size=5)
    assert not kit.state.events().truncated
    ids = [kit.enqueue() for _ in range(10)]
    log = kit.state.events()
    assert len(log) == 5 and log.truncated
    assert log.dropped == 11 - 5  # queue.created + 10 task.enqueued
    assert [e.task_id for e in log] == ids[-5:]


def test_state_stays_flat_under_steady_load() -> None:
    """Hundreds of short sessions and tasks leave tables and heaps at a steady size."""
    kit = Kit(retention=20, idempotency_window=15)
    sizes = []
    for cycle in range(160):
        proc = kit.worker(capacity=1).open()
        kit.enqueue(deadline=3600)
        ref = proc.take()
        proc.start(ref)
        proc.renew(ref)
        proc.finish(ref)
        assert proc.session_id is not None
        kit.route(kit.state.connection_lost(proc.session_id))
        kit.inbox.clear()
        kit.advance(1)
        if cycle in (100, 159):
            bounds = kit.state.bounds()
            kept = ("tasks", "attempts", "sessions", "instances", "receipts", "timers")
            sizes.append(tuple(bounds[name] for name in kept))
    # Tables hold what the retention and window cover, the same at cycle 100 as at 159;
    # heaps hold at most about twice what they index before they are compacted.
    assert sizes[0][:5] == sizes[1][:5] == (19, 19, 64, 64, 56)
    assert sizes[1][5] < 200
    kit.state.check_invariants()


def test_admin_event_paging_survives_a_truncated_ring() -> None:
    """GET /events counts from the first event ever: a cursor older than the ring resumes at
    its oldest event, and the answer says how many were dropped."""
    api = AdminAPI()
    with MockOrbitServer(
        clock=ManualClock(), admin_handler=api, assignment_rate=None, event_log_size=4
    ) as server:
        client = AdminClient(server.url, api.token)
        for _ in range(3):
            server.enqueue("resize", {"n": 1})
        _, first = client.request("GET", "/events", {"limit": 2})
        assert first["dropped"] == 0 and first["next"] == 2
        ids = [server.enqueue("resize", {"n": 1}) for _ in range(6)]  # 10 events, ring of 4
        _, page = client.request("GET", "/events", {"since": first["next"]})
        assert page["dropped"] == 6
        assert [e["task_id"] for e in page["events"]] == ids[-4:]
        assert page["next"] == 10
        _, tail = client.request("GET", "/events", {"since": page["next"]})
        assert tail["events"] == [] and tail["next"] == 10
