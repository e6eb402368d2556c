"""The chaos run: a user's Worker (its own handlers, its own options) re-pointed at a mock
server through a faulty link, the seeded schedule fired as the run makes progress, then the
checks of :mod:`._chaos_check`. Built only on the Worker's public API (``with_options``,
listeners, ``start``/``request_stop``/``stop``) and the mock server's (enqueue, faults,
snapshots)."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._realtime import monotonic
from ..client import Client
from ..worker import AttemptFinished, ShutdownReport, TaskContext, Worker
from ._chaos_check import Invocation, Violation, check
from ._chaos_plan import FaultRates, PlannedFault, plan, profile
from ._chaos_report import ChaosReport, Progress
from ._cutlink import CuttingLink
from ._server import MockOrbitServer
from ._snapshots import RetrySafety

__all__ = ["effect", "run"]

#: The enqueue policy of a chaos run's tasks unless told otherwise: retries allowed (so a lost
#: lease gives a task its next attempt), quickly, with budget to spare.
ENQUEUE_DEFAULTS: dict[str, Any] = {
    "max_attempts": 25,
    "backoff_initial": 0.05,
    "backoff_max": 0.5,
    "retry_safety": RetrySafety.IDEMPOTENT,
}
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW")

_ACTIVE_LOCK = threading.Lock()
_ACTIVE: list[_Recorder] = []


def effect(ctx: TaskContext, key: str = "effect") -> None:
    """Say, from a handler, that its side effect *key* just happened for *ctx*'s task; a task
    whose effect happens more than once in a chaos run is reported as not idempotent. Outside
    a chaos run it does nothing, so it may stay in production code."""
    with _ACTIVE_LOCK:
        recorders = list(_ACTIVE)
    for recorder in recorders:
        recorder.effect(ctx, key)


class _Recorder:
    """A listener on every worker of the run: each handler call, each finished attempt (the
    run's progress), each effect. A sampler thread watches the running handlers' lease
    deadlines; a lease-expiry fault is armed here and fires as the next handler begins."""

    def __init__(self, start: float, link: CuttingLink) -> None:
        self._start = start
        self._link = link
        self._cond = threading.Condition()
        self.finished = 0
        self.invocations: list[Invocation] = []
        self.effects: list[tuple[str, str, str, int, float]] = []
        self._running: dict[int, tuple[Invocation, TaskContext]] = {}
        self._ours: frozenset[str] = frozenset()
        self._hold: float | None = None
        self._held = threading.Event()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="orbit-chaos-lease", daemon=True)

    def now(self) -> float:
        return monotonic() - self._start

    def begin(self, task_ids: Iterable[str]) -> None:
        self._ours = frozenset(task_ids)
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)
        self._sampler.start()

    def end(self) -> None:
        with _ACTIVE_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        self._stop.set()
        self._sampler.join(5.0)

    # listener -----------------------------------------------------------------------------

    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        if ctx.task_id not in self._ours:
            return call()
        record = Invocation(ctx.task_id, ctx.attempt_id, ctx.attempt, started=self.now())
        with self._cond:
            self.invocations.append(record)
            self._running[id(record)] = (record, ctx)
            hold, self._hold = self._hold, None
        if hold is not None:
            # The link stalls as this handler begins: its renewals and its finish are held
            # past its lease, so the server expires the lease while the attempt is in flight.
            self._link.hold(hold)
            self._held.set()
        try:
            value = call()
        except BaseException as exc:
            record.raised = type(exc).__name__
            raise
        else:
            record.returned = True
            record.value = value
            return value
        finally:
            record.cancelled = ctx.cancelled.is_set()
            record.ended = self.now()
            with self._cond:
                self._running.pop(id(record), None)

    def attempt_finished(self, event: AttemptFinished) -> None:
        with self._cond:
            self.finished += 1
            self._cond.notify_all()

    def effect(self, ctx: TaskContext, key: str) -> None:
        if ctx.task_id in self._ours:
            with self._cond:
                self.effects.append((ctx.task_id, ctx.attempt_id, key, ctx.attempt, self.now()))

    # faults -------------------------------------------------------------------------------

    def wait_finished(self, count: int, stop: threading.Event) -> bool:
        """Wait until *count* attempts finished; False once *stop* is set."""
        with self._cond:
            while self.finished < count:
                if stop.is_set():
                    return False
                self._cond.wait(0.1)
        return True

    def arm_hold(self, seconds: float) -> None:
        """Have the link stall for *seconds* as the next handler begins."""
        self._held.clear()
        with self._cond:
            self._hold = seconds

    def wait_held(self, stop: threading.Event) -> bool:
        """Wait until the armed stall began; False if *stop* came first (the run ended with no
        handler left to run)."""
        while not self._held.wait(0.1):
            if stop.is_set():
                with self._cond:
                    self._hold = None
                return False
        return True

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            with self._cond:
                running = list(self._running.values())
            for record, ctx in running:
                if (
                    record.past_deadline is None
                    and ctx.remaining() == 0.0
                    and not ctx.cancelled.is_set()
                ):
                    record.past_deadline = self.now()


class _Fleet:
    """The run's workers: the current one, and those a deploy is stopping. A deploy stops the
    old worker as SIGTERM does (a drain) and starts a fresh one; with an outbox the old one
    must be gone first (one process per outbox), without one they overlap, as pods do."""

    def __init__(self, build: Callable[[], Worker], sequential: bool) -> None:
        self._build = build
        self._sequential = sequential
        self._lock = threading.Lock()
        self._current: Worker | None = None
        self._all: list[Worker] = []
        self._stoppers: list[threading.Thread] = []
        self.reports: list[ShutdownReport] = []

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._all)

    def start(self) -> None:
        with self._lock:
            old = self._current
        if old is not None and self._sequential:
            self._stopped(old)
        new = self._build()
        with self._lock:
            self._current = new
            self._all.append(new)
        new.start()
        if old is not None and not self._sequential:
            # SIGTERM's drain, on its own thread: the next worker already serves.
            stopper = threading.Thread(
                target=self._stopped, args=(old,), name="orbit-chaos-deploy", daemon=True
            )
            with self._lock:
                self._stoppers.append(stopper)
            stopper.start()

    def _stopped(self, worker: Worker) -> None:
        report = worker.stop(drain=True)
        with self._lock:
            self.reports.append(report)

    def stop(self) -> list[Worker]:
        """Stop every worker still running (draining), wait for the deploys' stops; return
        every worker of the run."""
        with self._lock:
            current, workers, stoppers = self._current, list(self._all), list(self._stoppers)
        if current is not None:
            self._stopped(current)
        for stopper in stoppers:
            stopper.join(120.0)
        return workers


def _rates(profile_name: str, rates: FaultRates | None) -> FaultRates:
    if rates is not None:
        if not isinstance(rates, FaultRates):
            raise TypeError("rates must be a FaultRates")
        return rates
    return profile(profile_name)


def _capability(worker: Worker, handler: str | None) -> tuple[str, str, str]:
    caps = [
        (c.handler, c.handler_version, c.payload_version) for c in worker.registration.capabilities
    ]
    names = sorted({c[0] for c in caps})
    if not names:
        raise ValueError("the worker has no handler registered")
    if handler is None:
        if len(names) != 1:
            raise ValueError(
                f"the worker has handlers {', '.join(names)}: pass handler= to choose one"
            )
        handler = names[0]
    for cap in caps:
        if cap[0] == handler:
            return cap
    raise ValueError(f"the worker has no handler {handler!r} (it has {', '.join(names)})")


def _factory(worker: Worker | Callable[[], Worker]) -> Callable[[], Worker]:
    if isinstance(worker, Worker):
        return lambda: worker
    if not callable(worker):
        raise TypeError("worker must be an orbit_sync.Worker or a function that returns one")

    def made() -> Worker:
        built = worker()
        if not isinstance(built, Worker):
            raise TypeError(f"the worker factory returned a {type(built).__name__}, not a Worker")
        return built

    return made


def run(
    worker: Worker | Callable[[], Worker],
    *,
    seed: int = 0,
    tasks: int = 100,
    profile: str = "default",
    rates: FaultRates | None = None,
    handler: str | None = None,
    payload: Callable[[int], Any] | None = None,
    enqueue: Mapping[str, Any] | None = None,
    time_limit: float = 120.0,
    progress: Callable[[Progress], None] | None = None,
    replay: str | None = None,
    link_cuts: tuple[float, float | None] | None = None,
    listeners: Iterable[object] = (),
) -> ChaosReport:
    """Run *tasks* tasks of *worker*'s *handler* (its only one by default) with payloads
    ``payload(i)`` (default ``{"i": i}``) under the faults *seed* draws from *rates* (default:
    the named *profile*'s), then check the run.

    *worker* is a Worker or a function without arguments that builds one (then each deploy
    gets a fresh one, as a new process would). It is never started itself: each worker of the
    run is ``worker.with_options(...)`` on a client of the faulty link, with its handlers, its
    options and its listeners (plus *listeners*); a worker with an outbox gets a fresh one in
    a temporary folder, shared by the run's workers in turn. *enqueue* overrides the tasks'
    enqueue policy; *time_limit* bounds the wait for every task to end; *progress* is called
    about once a second; *replay* is the line a report prints to replay the run (default:
    this call); *link_cuts* ``(mean, cut_for)`` also cuts the link on its own seeded schedule
    in time (every *mean* seconds on average, for the first *cut_for* seconds unless None).
    """
    chosen = _rates(profile, rates)
    build_user = _factory(worker)
    first = build_user()
    name, version, payload_version = _capability(first, handler)
    schedule = plan(seed, tasks, chosen)  # checks seed and tasks
    if isinstance(time_limit, bool) or not isinstance(time_limit, int | float) or time_limit <= 0:
        raise ValueError("time_limit must be a number of seconds > 0")
    if payload is not None and not callable(payload):
        raise TypeError("payload must be a function of the task's index")
    make_payload = payload or (lambda i: {"i": i})
    policy = {**ENQUEUE_DEFAULTS, **(enqueue or {})}
    if replay is None:
        knobs = f"rates={chosen!r}" if rates is not None else f"profile={profile!r}"
        replay = f"orbit_sync.testing.chaos.run(worker, seed={seed}, tasks={tasks}, {knobs})"
    payloads = [make_payload(i) for i in range(tasks)]
    extra = tuple(listeners)
    folder = tempfile.mkdtemp(prefix="orbit-chaos-") if first.options.outbox is not None else None
    try:
        return _run(
            first,
            build_user,
            seed=seed,
            name=profile if rates is None else "custom",
            rates=chosen,
            schedule=schedule,
            capability=(name, version, payload_version),
            payloads=payloads,
            policy=policy,
            time_limit=float(time_limit),
            progress=progress,
            replay=replay,
            link_cuts=link_cuts,
            listeners=extra,
            outbox=None if folder is None else os.path.join(folder, "outbox"),
        )
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _run(
    first: Worker,
    build_user: Callable[[], Worker],
    *,
    seed: int,
    name: str,
    rates: FaultRates,
    schedule: tuple[PlannedFault, ...],
    capability: tuple[str, str, str],
    payloads: list[Any],
    policy: dict[str, Any],
    time_limit: float,
    progress: Callable[[Progress], None] | None,
    replay: str,
    link_cuts: tuple[float, float | None] | None,
    listeners: tuple[object, ...],
    outbox: str | None,
) -> ChaosReport:
    lease = rates.lease
    handler, version, payload_version = capability
    with MockOrbitServer(
        assignment_rate=None,
        lease_duration=lease,
        session_window=3 * lease,
        exact_recovery=True,
        queue_id=first.options.queue_id,
    ) as server:
        mean_cut, cut_for = link_cuts if link_cuts is not None else (None, None)
        with CuttingLink(server.url, rtt=rates.rtt, mean_cut=mean_cut, seed=seed) as link:
            ids = [
                server.enqueue(
                    handler,
                    body,
                    handler_version=version,
                    payload_version=payload_version,
                    **policy,
                )
                for body in payloads
            ]
            started = monotonic()
            started_wall = time.time()
            recorder = _Recorder(started, link)
            pending = [first]

            def build() -> Worker:
                user = pending.pop() if pending else build_user()
                changes: dict[str, Any] = {}
                if outbox is not None:
                    changes["outbox"] = outbox
                return user.with_options(
                    client=Client(link.url, server.token),
                    # The run is in real time (the link's delays, the server's leases): a worker
                    # built on a test's ManualClock would never renew.
                    clock=None,
                    handle_signals=False,
                    listeners=(*user.listeners, *listeners, recorder),
                    **changes,
                )

            fleet = _Fleet(build, sequential=outbox is not None)
            fired: list[tuple[float, PlannedFault]] = []
            stop = threading.Event()

            # A stall due before any attempt finished is armed before the workers start: armed
            # from the driver's thread, it could come after the first handler already began.
            armed = bool(schedule) and schedule[0].kind == "lease_expiry" and not schedule[0].after
            if armed:
                recorder.arm_hold(schedule[0].seconds)

            def drive() -> None:
                for i, fault in enumerate(schedule):
                    if not recorder.wait_finished(fault.after, stop):
                        return
                    if fault.kind == "lease_expiry":
                        if not (armed and i == 0):
                            recorder.arm_hold(fault.seconds)
                        if not recorder.wait_held(stop):
                            return
                    else:
                        _fire(fault, link, server, fleet)
                    fired.append((recorder.now(), fault))

            recorder.begin(ids)
            calm_timer = None
            if mean_cut is not None and cut_for is not None:
                calm_timer = threading.Timer(cut_for, link.calm)
                calm_timer.daemon = True
                calm_timer.start()
            fleet.start()
            driver = threading.Thread(target=drive, name="orbit-chaos-driver", daemon=True)
            driver.start()
            done = _wait_terminal(server, ids, started + time_limit, progress, fired, recorder)
            seconds = monotonic() - started
            # The states as the run gave up (stopping the workers may still end some tasks).
            at_end = None if done else {t.task_id: t.state.value for t in server.tasks()}
            stop.set()
            driver.join(60.0)
            if calm_timer is not None:
                calm_timer.cancel()
            link.calm()
            link.release()
            server.faults.clear()
            workers = fleet.stop()
            recorder.end()
            cuts, connections = link.cuts, link.connections
        snaps = {t.task_id: t for t in server.tasks()}
        invariant = None
        try:
            server.check_invariants()
        except AssertionError as exc:
            invariant = str(exc)
    ordered = tuple(snaps[t] for t in ids)
    violations, dupes = check(
        ids,
        snaps,
        recorder.invocations,
        recorder.effects,
        fired,
        started_wall=started_wall,
        end=seconds,
        at_end=at_end,
    )
    if invariant is not None:
        violations.append(Violation("server invariant", "-", None, None, invariant, ()))
    for report in fleet.reports:
        if report.error is not None:
            detail = f"a worker stopped with {type(report.error).__name__}: {report.error}"
            violations.append(Violation("worker error", "-", None, None, detail, ()))
    return ChaosReport(
        seed=seed,
        profile=name,
        rates=rates,
        tasks=len(ids),
        seconds=seconds,
        states=dict(collections.Counter(s.state.value for s in ordered)),
        attempts=sum(len(s.attempts) for s in ordered),
        invocations=len(recorder.invocations),
        planned=schedule,
        fired=tuple(fired),
        violations=tuple(violations),
        duplicate_effects=tuple(dupes),
        effects=len(recorder.effects),
        workers=len(workers),
        reconnects=sum(w.stats().reconnects for w in workers),
        connections=connections,
        cuts=cuts,
        unreported=sum(len(r.unreported) for r in fleet.reports),
        replay=replay,
        snapshots=ordered,
        started_wall=started_wall,
    )


def _fire(fault: PlannedFault, link: CuttingLink, server: MockOrbitServer, fleet: _Fleet) -> None:
    kind = fault.kind
    if kind == "cut":
        link.cut_now()
    elif kind == "delay":
        link.hold(fault.seconds)
    elif kind == "lost_ack":
        assert fault.frame_type is not None
        if fault.variant == "drop":
            server.faults.drop_reply(fault.frame_type)
        else:
            server.faults.close_after(fault.frame_type)
    elif kind == "duplicate":
        server.faults.duplicate_push("task.assign")
    elif kind == "restart":
        fleet.start()


def _wait_terminal(
    server: MockOrbitServer,
    ids: list[str],
    deadline: float,
    progress: Callable[[Progress], None] | None,
    fired: list[tuple[float, PlannedFault]],
    recorder: _Recorder,
) -> bool:
    """Wait until every task is terminal or *deadline* passes; report progress meanwhile."""
    done = 0
    last = monotonic()
    while done < len(ids):
        left = deadline - monotonic()
        if left <= 0:
            return False
        try:
            server.wait_for(ids[done], TERMINAL, timeout=min(left, 1.0))
        except TimeoutError:
            pass
        else:
            done += 1
        if progress is not None and monotonic() - last >= 1.0:
            last = monotonic()
            # Tasks end out of order: count them all, not the prefix waited for so far.
            terminal = sum(1 for t in server.tasks() if t.state.value in TERMINAL)
            progress(Progress(terminal, len(ids), len(fired), recorder.now()))
    if progress is not None:
        progress(Progress(done, len(ids), len(fired), recorder.now()))
    return True
