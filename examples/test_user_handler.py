"""Testing your own handler against the mock Orbit server: the hard cases.

Run with ``pytest examples/test_user_handler.py``. The fixtures (``orbit_server``,
``orbit_worker``, ``orbit_clock``) come from orbit-sync's pytest plugin, installed with the
package. The handler under test charges an invoice through a payment gateway; the test passes a
hand-written fake gateway that records charges and can fail or hold a charge on demand.

What is shown:

* a lost acknowledgement: the server stores the finish but the connection drops before its
  ``ack`` arrives; the worker reconnects and re-sends the same operation, and the invoice is
  charged once;
* an expired lease: ``orbit_server.advance(...)`` moves server time past the lease while the
  handler is stuck; the task is retried (the policy says the charge is idempotent), the stuck
  handler learns it lost the lease, and its late result is kept only as evidence;
* a retry after a transient failure, with its backoff skipped by moving server time;
* a cancellation that the handler honours at its next checkpoint.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Fail, TaskContext, Worker

# --------------------------------------------------------------------------- the code under test


class GatewayUnavailable(Exception):
    """The payment gateway could not be reached (a transient failure)."""


def charge_invoice(gateway: Any) -> Any:
    """Build the ``invoice.charge`` handler around a payment gateway."""

    def handle(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
        ctx.raise_if_cancelled()
        try:
            receipt = gateway.charge(payload["invoice_id"], payload["amount"], ctx.cancelled)
        except GatewayUnavailable:
            raise Fail("GATEWAY_UNAVAILABLE", retryable=True) from None
        # A cancel (or a lost lease) that arrived while we waited wins over the result.
        ctx.raise_if_cancelled()
        return {"receipt": receipt}

    return handle


# --------------------------------------------------------------------------- a fake gateway


class FakeGateway:
    """Records charges; can fail the next calls, or hold the next one until it is cancelled."""

    def __init__(self) -> None:
        self.charges: list[str] = []
        self.calls = 0
        self.failures_left = 0
        self.holding = False
        self.held = threading.Event()  # set when a call is being held
        self._lock = threading.Lock()

    def charge(self, invoice_id: str, amount: int, cancelled: threading.Event) -> str:
        with self._lock:
            self.calls += 1
            if self.failures_left:
                self.failures_left -= 1
                raise GatewayUnavailable
            hold, self.holding = self.holding, False  # hold only the first call after hold()
        if hold:
            self.held.set()
            # A stuck downstream call: it ends only when the worker cancels the attempt.
            if cancelled.wait(timeout=30.0):
                return "aborted"
        with self._lock:
            self.charges.append(invoice_id)
        return f"rcpt-{invoice_id}-{amount}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def gateway() -> FakeGateway:
    """A fresh fake gateway per test."""
    return FakeGateway()


@pytest.fixture
def worker(orbit_worker: Any, gateway: FakeGateway) -> Worker:
    """A started worker running the handler under test (stopped after the test)."""
    w: Worker = orbit_worker(capacity=2, call_timeout=2.0)
    w.register("invoice.charge", charge_invoice(gateway))
    w.start()
    assert w.wait_ready(5.0), "the worker did not connect"
    return w


def running(server: MockOrbitServer, task_id: str, attempts: int = 1) -> None:
    """Wait until attempt number *attempts* of the task is running."""
    server.wait_until(
        lambda s: (
            len(s.task(task_id).attempts) == attempts and s.task(task_id).state.value == "RUNNING"
        ),
        timeout=10.0,
    )


# --------------------------------------------------------------------------- the tests


def test_happy_path(orbit_server: MockOrbitServer, worker: Worker, gateway: FakeGateway) -> None:
    """A task runs once and succeeds with the handler's result."""
    task_id = orbit_server.enqueue("invoice.charge", {"invoice_id": "inv-1", "amount": 42})
    snap = orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED"}, timeout=10.0)
    assert snap.state.value == "SUCCEEDED"
    assert snap.result == {"receipt": "rcpt-inv-1-42"}
    assert gateway.charges == ["inv-1"]


def test_lost_acknowledgement_charges_once(
    orbit_server: MockOrbitServer, worker: Worker, gateway: FakeGateway
) -> None:
    """The finish is stored but its ack is lost with the connection: no second charge."""
    # Apply the next task.finish, then cut the connection before the ack is written.
    fault = orbit_server.faults.close_after("task.finish")
    task_id = orbit_server.enqueue("invoice.charge", {"invoice_id": "inv-2", "amount": 7})
    snap = orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED"}, timeout=10.0)
    assert fault.fired == 1
    assert snap.state.value == "SUCCEEDED"
    assert len(snap.attempts) == 1 and not snap.evidence
    assert gateway.charges == ["inv-2"]
    # The worker reconnected and re-sent the finish under its original message_id: the server
    # answered the repeat from its record, on a session other than the one it was assigned on.
    # (A wait_until predicate reads the server: it is re-checked only when the server changes.)
    orbit_server.wait_until(lambda s: bool(repeats(s, task_id)), timeout=10.0)
    events = orbit_server.events()
    (assigned,) = [e for e in events if e.kind == "attempt.assigned" and e.task_id == task_id]
    assert repeats(orbit_server, task_id)[0].session_id != assigned.session_id
    orbit_server.check_invariants()


def repeats(server: MockOrbitServer, task_id: str) -> list[Any]:
    """The task's finishes the server answered from its record (the same message_id again)."""
    return [
        e
        for e in server.events()
        if e.kind == "request.deduplicated" and e.detail == "task.finish" and e.task_id == task_id
    ]


@pytest.mark.orbit_server(lease_duration=2.0, assignment_rate=None)
def test_expired_lease_is_retried_and_the_late_result_kept_as_evidence(
    orbit_server: MockOrbitServer, orbit_clock: Any, worker: Worker, gateway: FakeGateway
) -> None:
    """Server time jumps past a stuck attempt's lease: the task is retried, the stuck handler
    stops with LEASE_LOST, and what it reports late is evidence only."""
    # Requesting orbit_clock gives this test a server whose time moves only when told to.
    gateway.holding = True
    task_id = orbit_server.enqueue(
        "invoice.charge",
        {"invoice_id": "inv-3", "amount": 5},
        retry_safety="IDEMPOTENT",  # charging twice is safe for this gateway
        backoff_initial=0.5,
    )
    running(orbit_server, task_id)
    assert gateway.held.wait(5.0)
    # Server time, and the worker's (orbit_worker builds it on the server's clock), stands still
    # while the handler is stuck. Jump to the lease's expiry: the attempt is lost and the task
    # waits for its backoff.
    orbit_server.advance(orbit_server.lease_duration)
    lost = orbit_server.task(task_id)
    assert lost.state.value == "WAITING" and lost.attempts[0].state.value == "UNKNOWN"
    # Then skip the backoff. advance() runs everything that falls due on the way, at its own
    # moment: one big jump would also assign attempt 2 on the way and expire its fresh lease.
    orbit_server.advance(0.5)
    snap = orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED", "NEEDS_REVIEW"}, timeout=10.0)
    assert snap.state.value == "SUCCEEDED"
    assert snap.effect_uncertain  # attempt 1 may have had an effect: the history says so
    first, second = snap.attempts
    assert first.state.value == "UNKNOWN" and second.state.value == "SUCCEEDED"
    # The stuck handler learns of the loss at its next renewal, stops, and reports late.
    orbit_server.wait_until(lambda s: len(s.task(task_id).evidence) == 1, timeout=10.0)
    evidence = orbit_server.task(task_id).evidence[0]
    assert evidence.attempt_id == first.attempt_id and evidence.reason == "late"
    assert gateway.charges == ["inv-3"]


@pytest.mark.orbit_server(manual_clock=True, assignment_rate=None)
def test_transient_failure_is_retried_after_backoff(
    orbit_server: MockOrbitServer, worker: Worker, gateway: FakeGateway
) -> None:
    """A retryable failure waits for its backoff (skipped by moving server time), then succeeds."""
    gateway.failures_left = 1
    task_id = orbit_server.enqueue(
        "invoice.charge", {"invoice_id": "inv-4", "amount": 9}, backoff_initial=30.0
    )
    orbit_server.wait_until(
        lambda s: len(s.task(task_id).attempts) == 1 and s.task(task_id).state.value == "WAITING",
        timeout=10.0,
    )
    first = orbit_server.task(task_id).attempts[0]
    assert first.outcome is not None and first.outcome.value == "FAILED"
    assert first.error_code == "GATEWAY_UNAVAILABLE"
    # Server time stands still: nothing happens until we skip the 30 s backoff.
    orbit_server.advance(30.0)
    snap = orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED"}, timeout=10.0)
    assert snap.state.value == "SUCCEEDED" and len(snap.attempts) == 2
    assert gateway.calls == 2 and gateway.charges == ["inv-4"]


def test_cancellation_stops_the_handler(
    orbit_server: MockOrbitServer, worker: Worker, gateway: FakeGateway
) -> None:
    """A cancel request reaches the running handler, which stops without charging."""
    gateway.holding = True
    task_id = orbit_server.enqueue("invoice.charge", {"invoice_id": "inv-5", "amount": 1})
    running(orbit_server, task_id)
    assert gateway.held.wait(5.0)
    orbit_server.request_cancel(task_id)
    snap = orbit_server.wait_for(task_id, {"CANCELLED", "SUCCEEDED", "FAILED"}, timeout=10.0)
    assert snap.state.value == "CANCELLED"
    assert snap.attempts[0].outcome is not None and snap.attempts[0].outcome.value == "CANCELLED"
    assert gateway.charges == []
