"""Prometheus metrics for a Worker (``pip install 'orbit-sync[prometheus]'``).

::

    from prometheus_client import start_http_server
    from orbit_sync.contrib.prometheus import PrometheusListener

    worker = Worker(client, queue_id=Q, listeners=[PrometheusListener()])
    start_http_server(9100)   # or mount prometheus_client's WSGI app in yours

=============================================  =========  ====================================
metric (default namespace ``orbit``)           type       labels
=============================================  =========  ====================================
``orbit_attempts_received_total``              counter    ``handler``
``orbit_attempts_total``                       counter    ``handler``, ``outcome``
``orbit_attempt_duration_seconds``             histogram  ``handler``, ``outcome``
``orbit_attempts_in_flight``                   gauge      ``handler`` (handlers running now)
``orbit_slots_stuck``                          gauge      - (slots held by handlers that could not
                                                          be stopped: see ``WorkerStats.stuck``)
``orbit_slots``                                gauge      - (slots offered to the server: the
                                                          capacity; 0 while draining or
                                                          disconnected)
``orbit_slots_busy``                           gauge      - (offered slots in use: handlers
                                                          running, and stuck ones; 0 while
                                                          draining or disconnected)
``orbit_slot_wait_seconds``                    histogram  - (from an assignment's arrival to its
                                                          handler's start)
``orbit_finishes_undelivered_total``           counter    ``handler``
``orbit_lease_renewals_total``                 counter    -
``orbit_lease_renewal_lag_seconds``            histogram  - (how late renewals were sent)
``orbit_lease_losses_total``                   counter    ``reason``
``orbit_reconnects_total``                     counter    -
``orbit_dial_failures_total``                  counter    -
``orbit_connected``                            gauge      - (1 while a session is up)
=============================================  =========  ====================================

``outcome`` is ``SUCCEEDED``, ``FAILED``, ``CANCELLED`` or ``UNKNOWN``. Pass *registry* to keep
the metrics out of prometheus_client's global registry (one registry per worker, or tests).

``orbit_lease_losses_total`` is 0 from the start for each reason a lease is lost with
(:data:`LEASE_LOSS_REASONS`), and ``orbit_finishes_undelivered_total`` for each handler passed to
:meth:`PrometheusListener.declare_handlers` (``orbit-sync worker --metrics-port`` passes the
registered ones): an alert on their rate reads 0, not "no data", until the first one happens.

Saturation, for an autoscaler: ``sum(orbit_slots_busy) / sum(orbit_slots)`` is the share of the
offered slots in use (the gauges add up over the processes of ``orbit-sync worker --processes
N``); near 1 the server has work waiting for slots. Both gauges count only a process that offers
its slots: a draining or disconnected one reads 0 in both, so its handlers running on do not
count as demand for more pods while it goes away (``orbit_attempts_in_flight`` and
``orbit_slots_stuck`` still count them). ``orbit_slot_wait_seconds`` is how long an
assignment waited before its handler started: the start's round trip and the hand-off to a
handler thread (see ``docs/deploy.md``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from ..worker import (
    AttemptEvent,
    AttemptFinished,
    DisconnectEvent,
    DrainEvent,
    LeaseEvent,
    SessionEvent,
    ShutdownReport,
    StuckEvent,
    WorkerListener,
)

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "orbit_sync.contrib.prometheus needs prometheus_client: "
        "pip install 'orbit-sync[prometheus]'"
    ) from exc

__all__ = ["LEASE_LOSS_REASONS", "PrometheusListener"]

#: The ``reason`` of every lease loss a worker reports (``LeaseEvent.reason``).
LEASE_LOSS_REASONS = ("lease_expired", "lease_lost", "session_replaced")

#: Renewal lag is normally a few milliseconds; past a second the lease margin is at risk.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: An assignment's wait for its handler: a round trip (milliseconds) unless no thread is free.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PrometheusListener(WorkerListener):
    """A :class:`~orbit_sync.worker.WorkerListener` that keeps Prometheus metrics."""

    def __init__(
        self, *, registry: CollectorRegistry | None = None, namespace: str = "orbit"
    ) -> None:
        reg = REGISTRY if registry is None else registry
        ns = namespace
        self.received = Counter(
            "attempts_received", "Assignments accepted.", ["handler"], namespace=ns, registry=reg
        )
        self.finished = Counter(
            "attempts",
            "Attempts finished, by reported outcome.",
            ["handler", "outcome"],
            namespace=ns,
            registry=reg,
        )
        self.duration = Histogram(
            "attempt_duration_seconds",
            "How long handlers ran.",
            ["handler", "outcome"],
            namespace=ns,
            registry=reg,
        )
        # livesum: in prometheus_client's multiprocess mode (orbit-sync worker --metrics-port)
        # the gauges add up over live processes; a single process is unaffected.
        self.in_flight = Gauge(
            "attempts_in_flight",
            "Handlers running now.",
            ["handler"],
            namespace=ns,
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.undelivered = Counter(
            "finishes_undelivered",
            "Finishes not delivered (worker stopped, or refused by the server).",
            ["handler"],
            namespace=ns,
            registry=reg,
        )
        self.renewals = Counter(
            "lease_renewals", "Lease renewals acknowledged.", namespace=ns, registry=reg
        )
        self.renewal_lag = Histogram(
            "lease_renewal_lag_seconds",
            "How late after its schedule each renewal was sent.",
            buckets=LAG_BUCKETS,
            namespace=ns,
            registry=reg,
        )
        self.losses = Counter(
            "lease_losses", "Leases lost while running.", ["reason"], namespace=ns, registry=reg
        )
        for reason in LEASE_LOSS_REASONS:
            self.losses.labels(reason)  # 0 until the first loss, not absent
        self.reconnects = Counter(
            "reconnects",
            "Sessions established after the first one.",
            namespace=ns,
            registry=reg,
        )
        self.dial_failures = Counter(
            "dial_failures", "Connection attempts that failed.", namespace=ns, registry=reg
        )
        self.stuck = Gauge(
            "slots_stuck",
            "Slots held by handlers finished UNKNOWN that still run (past their time limit and"
            " the cancel grace, or at shutdown).",
            namespace=ns,
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.slots = Gauge(
            "slots",
            "Handler slots offered to the server (the capacity; 0 while draining or disconnected).",
            namespace=ns,
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.slots_busy = Gauge(
            "slots_busy",
            "Offered slots in use: handlers running, and stuck ones (0 while draining or"
            " disconnected).",
            namespace=ns,
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.slot_wait = Histogram(
            "slot_wait_seconds",
            "From an assignment's arrival to its handler's start.",
            buckets=WAIT_BUCKETS,
            namespace=ns,
            registry=reg,
        )
        # What the busy gauge sums, and when each attempt not started yet arrived (bounded by
        # the attempts held: each leaves at its start or its finish).
        self._lock = threading.Lock()
        self._running = 0
        self._stuck = 0
        #: The slots are offered (a session is up and the worker is not draining): busy ones
        #: count only then, as orbit_slots does.
        self._offering = False
        self._arrived: dict[str, float] = {}
        self.connected_gauge = Gauge(
            "connected",
            "1 while a session is established.",
            namespace=ns,
            registry=reg,
            multiprocess_mode="livesum",
        )

    def declare_handlers(self, names: Iterable[str]) -> None:
        """Show ``orbit_finishes_undelivered_total`` at 0 for each handler in *names* (the
        worker's registered ones), so an alert on it reads 0 before the first undelivered
        finish; a handler's series otherwise appears with its first one."""
        for name in names:
            self.undelivered.labels(name)

    def attempt_received(self, event: AttemptEvent) -> None:
        """Count the assignment."""
        self.received.labels(event.handler).inc()
        with self._lock:
            self._arrived[event.attempt_id] = time.monotonic()

    def attempt_started(self, event: AttemptEvent) -> None:
        """One more handler running; how long its assignment waited."""
        self.in_flight.labels(event.handler).inc()
        with self._lock:
            arrived = self._arrived.pop(event.attempt_id, None)
            self._running += 1
            self._busy()
        if arrived is not None:
            self.slot_wait.observe(time.monotonic() - arrived)

    def attempt_finished(self, event: AttemptFinished) -> None:
        """Count the outcome and time the handler."""
        outcome = event.outcome.value
        with self._lock:
            self._arrived.pop(event.attempt_id, None)  # one that never started
            if event.ran:
                self._running -= 1
                self._busy()
        if event.ran:
            self.in_flight.labels(event.handler).dec()
        self.finished.labels(event.handler, outcome).inc()
        if event.duration is not None:
            self.duration.labels(event.handler, outcome).observe(event.duration)
        if not event.delivered:
            self.undelivered.labels(event.handler).inc()

    def lease_renewed(self, event: LeaseEvent) -> None:
        """Count the renewal and how late it was."""
        self.renewals.inc()
        self.renewal_lag.observe(event.lag)

    def lease_lost(self, event: LeaseEvent) -> None:
        """Count the loss by reason."""
        self.losses.labels(event.reason or "unknown").inc()

    def handler_stuck(self, event: StuckEvent) -> None:
        """One more slot stuck."""
        self.stuck.set(event.stuck)
        with self._lock:
            self._stuck = event.stuck
            self._busy()

    def handler_unstuck(self, event: StuckEvent) -> None:
        """A stuck slot freed."""
        self.stuck.set(event.stuck)
        with self._lock:
            self._stuck = event.stuck
            self._busy()

    def _busy(self) -> None:
        # Under the lock: the gauge is set from one sum, whatever the order of the events. A
        # draining process's handlers are no demand for slots: counted, they would read as a
        # saturated pool (busy over nothing offered) and scale it out while it scales in.
        self.slots_busy.set(self._running + self._stuck if self._offering else 0)

    def _offer(self, capacity: int) -> None:
        # Busy is cleared before the slots and set after them: a scrape in between reads less
        # than the saturation, never more.
        with self._lock:
            self._offering = capacity > 0
            if not self._offering:
                self._busy()
            self.slots.set(capacity)
            if self._offering:
                self._busy()

    def connected(self, event: SessionEvent) -> None:
        """A session is up: its slots are offered (none once the worker drains)."""
        self.connected_gauge.set(1)
        self._offer(event.capacity)
        if event.reconnect:
            self.reconnects.inc()

    def disconnected(self, event: DisconnectEvent) -> None:
        """The session is down; the worker reconnects."""
        self.connected_gauge.set(0)
        self._offer(0)

    def draining(self, event: DrainEvent) -> None:
        """The worker takes no new work: it offers no slot."""
        self._offer(0)

    def dial_failed(self, event: DisconnectEvent) -> None:
        """Count the failed connection attempt."""
        self.dial_failures.inc()

    def stopped(self, report: ShutdownReport) -> None:
        """The worker is gone."""
        self.connected_gauge.set(0)
        self._offer(0)
