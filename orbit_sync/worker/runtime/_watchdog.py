"""The lease watchdog: one heap of renew times for every running attempt (PROTOCOL §6.3-6.6;
schedule, batching and reconnects: docs/reliability.md, section 3).

:class:`LeaseWatchdog` runs over an injectable clock and a *send* that writes a batch of renewals
without waiting (each answer comes back through its callback): a slow answer never delays another
renewal. :class:`WatchdogThread` sleeps until :meth:`LeaseWatchdog.run_due` says to come back. At
most one renewal per attempt is in flight, its deadline watched, until the attempt's machine has
decided what its :class:`~._machine.RenewAnswer` means. Entries are touched only under the lock.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from ..._realtime import monotonic
from ...errors import OrbitError
from ...models import Lease, new_message_id
from ..core._errors import is_transient
from ..core._machine import MIN_RETRY_DELAY, RenewAnswer
from ._link import Wakeup

__all__ = ["LeaseWatchdog", "RenewDone", "SendRenews", "Timers", "WatchdogStats", "WatchdogThread"]

_LOG = logging.getLogger("orbit_sync.worker")

#: ``on_answer(attempt_id, answer)``: what became of a renewal, for the attempt's machine.
OnAnswer = Callable[[str, RenewAnswer], None]
#: ``on_done(lease, error)``: the renewal's lease (carrying its local ``deadline``) or why not.
RenewDone = Callable[["Lease | None", "BaseException | None"], None]
#: ``send([(attempt_id, message_id, on_done), ...])``: one write, no wait; each ``on_done`` is
#: called exactly once, maybe before ``send`` returns and from any thread.
SendRenews = Callable[[Sequence[tuple[str, str, RenewDone]]], None]
_Batch = list[tuple[str, str, RenewDone]]

#: Never schedule two renewals of one attempt closer than this (a tiny window must not spin).
MIN_RENEW_INTERVAL = 0.05
#: A renewal joins a batch being sent anyway once at most this fraction of its wait is left.
GROUP_FRACTION = 0.25
#: Early renewals stop at this batch size (starts and finishes need request slots too).
MAX_EARLY_BATCH = 16
#: On a new connection, renew at once each lease past this fraction of its last grant's window.
RECONNECT_FRACTION = 0.25
#: Lag above this is logged: handlers are starving the watchdog of the GIL.
LAG_WARNING = 1.0
#: A renewal is scheduled early by the worst lag of this many recent wake-ups (times the factor).
LEAD_WAKES = 16
#: GIL waits have a long tail: the next wake-up is often later than the worst of the last few.
LEAD_FACTOR = 2.0
#: With nothing left to renew, the thread still wakes this long after the last track, so short
#: attempts need not wake it (docs/performance.md, "The watchdog's wake-ups").
BUSY_LINGER = 1.0


@attrs.frozen
class WatchdogStats:
    """Counters of the watchdog."""

    tracked: int
    renewals: int
    renew_failures: int
    #: How late the most recent wake-up came (seconds), and the worst so far.
    lag_last: float
    lag_max: float


@attrs.define
class _Entry:
    attempt_id: str
    deadline: float
    #: When the next renewal is wanted (``inf``: one is in flight until the machine decides).
    due: float
    #: When ``due`` was set (the last grant, track, refresh or failure).
    since: float
    #: The window the last grant gave: (when, deadline).
    granted: tuple[float, float]
    #: The moment this entry's live heap item stands for (older items are stale).
    wake_at: float = math.inf
    #: The ``message_id`` of a renew (maybe) sent and not answered: re-sent as is.
    pending_id: str | None = None
    #: Token of the renewal in flight (0: none); any other completion is stale.
    flight: int = 0
    #: The renewal due goes right behind a new connection's resumes (``behind_resume``).
    reconnected: bool = False


class LeaseWatchdog:
    """Schedules renewals of running attempts and reports what became of each."""

    def __init__(
        self,
        send: SendRenews,
        *,
        clock: Callable[[], float] = monotonic,
        on_change: Callable[[], None] | None = None,
        logger: logging.Logger | None = None,
        cautious_start: bool = False,
    ) -> None:
        self.clock = clock
        self._send = send
        self._on_change = on_change or (lambda: None)
        self._on_answer: OnAnswer = lambda attempt_id, answer: None
        self._log = logger or _LOG
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count(1)
        #: What run_due last returned: pushing anything later needs no wake-up.
        self._sleeping_until = math.inf
        self._last_track = -math.inf
        self._renewals = self._failures = 0
        self._lag_max = 0.0
        #: How late the recent wake-ups came (the lead of the next renewals).
        self._recent_lags: deque[float] = deque(maxlen=LEAD_WAKES)
        #: The lag assumed before any was measured: *cautious_start* takes the worst the lead
        #: allows (the first renewals may come due while handlers already hold the GIL).
        self._unmeasured_lag = math.inf if cautious_start else 0.0

    def report_to(self, on_answer: OnAnswer) -> None:
        """Report what became of each renewal to *on_answer* from now on."""
        self._on_answer = on_answer

    def track(self, attempt_id: str, deadline: float) -> None:
        """Renew *attempt_id* (lease just granted, ending at *deadline*) at half of what remains."""
        now = self.clock()
        remaining = deadline - now
        # Half of what remains, at least MIN_RENEW_INTERVAL away, never past the deadline.
        wait = min(max(remaining, 0.0), max(MIN_RENEW_INTERVAL, remaining / 2))
        with self._lock:
            # Early by twice the worst recent lag (CPU-bound handlers hold the GIL), so it still
            # goes out when due: at most a batch's slack, never under the minimum interval.
            lead = min(
                LEAD_FACTOR * max(self._recent_lags, default=self._unmeasured_lag),
                GROUP_FRACTION * wait,
                max(0.0, wait - MIN_RENEW_INTERVAL),
            )
            entry = _Entry(attempt_id, deadline, now + wait - lead, now, (now, deadline))
            self._entries[attempt_id] = entry
            self._last_track = now
            wake = self._push(entry, entry.due)
        self._wake(wake)

    def refresh(self, attempt_id: str, deadline: float) -> bool:
        """A resume says *attempt_id*'s lease ends at *deadline*; True if that stands. A resume
        grants no time: no renewal is put off, and the later deadline stands."""
        with self._lock:
            entry = self._entries.get(attempt_id)
            if entry is None or deadline <= entry.deadline:
                return False
            entry.deadline = deadline
            # In flight, the entry waits on its deadline: watch the later one. Otherwise its
            # renewal, due before either deadline, stands.
            wake = self._push(entry, deadline) if entry.due == math.inf else False
        self._wake(wake)
        return True

    def connected(self) -> None:
        """A new connection was published behind its resumes: renew on it now every lease past
        :data:`RECONNECT_FRACTION` of its window, not waiting for the resumes' answers."""
        now = self.clock()
        wake = False
        with self._lock:
            for entry in self._entries.values():
                if entry.due == math.inf or entry.due <= now:
                    continue
                start, end = entry.granted
                if now - start < RECONNECT_FRACTION * (end - start):
                    continue
                entry.due = entry.since = now
                entry.reconnected = True
                wake = self._push(entry, now) or wake
        self._wake(wake)

    def retry(self, attempt_id: str, delay: float, error: BaseException) -> None:
        """Re-send *attempt_id*'s failed renewal after *delay*, or at its deadline to expire it."""
        now = self.clock()
        with self._lock:
            entry = self._entries.get(attempt_id)
            if entry is None:
                return
            entry.due, entry.since = min(now + delay, entry.deadline), now
            wake = self._push(entry, entry.due)
            wait = entry.due - now
        level = logging.INFO if is_transient(error) else logging.ERROR
        self._log.log(
            level,
            "renew of attempt %s failed (%s); retrying in %.2fs",
            attempt_id,
            type(error).__name__,
            max(0.0, wait),
            exc_info=error if level == logging.ERROR else None,
        )
        self._wake(wake)

    def untrack(self, attempt_id: str) -> None:
        """Stop renewing *attempt_id*."""
        with self._lock:
            self._entries.pop(attempt_id, None)

    def pending_renewals(self) -> list[str]:
        """Attempts with a renew that was (maybe) sent and never answered."""
        with self._lock:
            return [e.attempt_id for e in self._entries.values() if e.pending_id is not None]

    def stats(self) -> WatchdogStats:
        """A snapshot of the counters."""
        with self._lock:
            return WatchdogStats(
                tracked=len(self._entries),
                renewals=self._renewals,
                renew_failures=self._failures,
                lag_last=self._recent_lags[-1] if self._recent_lags else 0.0,
                lag_max=self._lag_max,
            )

    def next_due(self) -> float | None:
        """When something is next due (clock time), or ``None`` when nothing is tracked."""
        with self._lock:
            return self._next_at()

    def run_due(self) -> float | None:
        """Send every renewal due or nearly due in one batch; return when to call again."""
        while True:
            now = self.clock()
            batch: _Batch = []
            expired: list[str] = []
            woke_lag: float | None = None
            with self._lock:
                while self._heap and self._heap[0][0] <= now:
                    at, _, attempt_id = heapq.heappop(self._heap)
                    entry = self._entries.get(attempt_id)
                    if entry is None or entry.wake_at != at:
                        continue  # stale (see _next_at)
                    entry.wake_at = math.inf
                    lag = now - at
                    if woke_lag is None:  # the earliest item: how late this wake-up is
                        woke_lag = lag
                    # Past its deadline (in flight, it waits on it): a late answer finds it gone.
                    if now >= entry.deadline:
                        del self._entries[attempt_id]
                        expired.append(attempt_id)
                    else:
                        self._start_flight(entry, batch, lag)
                if batch:
                    self._pull_in(now, batch)
                if woke_lag is not None:
                    self._lag_max = max(self._lag_max, woke_lag)
                    self._recent_lags.append(woke_lag)
            # Nothing before this write may release the GIL (no log line, no contended lock): each
            # such call can cost a thread switch under CPU load.
            if batch:
                try:
                    self._send(batch)
                except Exception as exc:  # nothing was sent; anything but an OrbitError is a bug
                    if not isinstance(exc, OrbitError):
                        self._log.error("renewal send failed unexpectedly; retrying", exc_info=exc)
                    # Renewals already completed are stale now: their flight token was used.
                    for _, _, on_done in batch:
                        on_done(None, exc)
            if woke_lag is not None and woke_lag > LAG_WARNING:
                self._log.warning(
                    "lease watchdog woke %.3fs late: CPU-bound handlers are holding the GIL",
                    woke_lag,
                )
            for attempt_id in expired:
                self._on_answer(attempt_id, RenewAnswer())
            with self._lock:
                nxt = self._next_at()
                if nxt is None and self._last_track + BUSY_LINGER > now:
                    nxt = self._last_track + BUSY_LINGER  # see BUSY_LINGER
                self._sleeping_until = math.inf if nxt is None else nxt
            if nxt is None or nxt > self.clock():
                return nxt

    def _start_flight(self, entry: _Entry, batch: _Batch, lag: float) -> None:
        """Put *entry*'s renewal in *batch* (lock held), watching its deadline meanwhile."""
        entry.pending_id = message_id = entry.pending_id or new_message_id()
        entry.flight, entry.due = next(self._seq), math.inf
        self._push(entry, entry.deadline)
        on_done = functools.partial(self._renewed, entry, entry.flight, lag)
        batch.append((entry.attempt_id, message_id, on_done))

    def _pull_in(self, now: float, batch: _Batch) -> None:
        """Add to *batch* every renewal nearly due (lock held; one pass over the entries)."""
        for entry in self._entries.values():
            if len(batch) >= MAX_EARLY_BATCH:
                return
            due = entry.due
            if (
                entry.wake_at != due  # not waiting for its renewal (deadline watch, in flight)
                or due <= now  # handled above, or a retry due now
                or now - entry.since < MIN_RENEW_INTERVAL
                or due - now > GROUP_FRACTION * (due - entry.since)
                or now >= entry.deadline
            ):
                continue
            self._start_flight(entry, batch, 0.0)

    def _renewed(
        self,
        entry: _Entry,
        flight: int,
        lag: float,
        lease: Lease | None,
        error: BaseException | None,
    ) -> None:
        """One renewal's completion (any thread); it stays in flight until the machine decides."""
        with self._lock:
            if entry.flight != flight or self._entries.get(entry.attempt_id) is not entry:
                return  # stale, or finished while the renew was in flight: nothing to do
            entry.flight = 0
            self._renewals += error is None
            self._failures += error is not None
            behind_resume, entry.reconnected = entry.reconnected, False
        self._on_answer(entry.attempt_id, RenewAnswer(lease, error, behind_resume, lag))

    def _wake(self, needed: bool) -> None:
        if needed:
            self._on_change()

    def _push(self, entry: _Entry, at: float) -> bool:
        """Schedule *entry* at *at* (lock held); True if the thread sleeps past it."""
        entry.wake_at = at
        heapq.heappush(self._heap, (at, next(self._seq), entry.attempt_id))
        if at < self._sleeping_until:
            self._sleeping_until = at
            return True
        return False

    def _next_at(self) -> float | None:
        """When the first live item is due, dropping the stale ones before it (lock held)."""
        while self._heap:
            at, _, attempt_id = self._heap[0]
            entry = self._entries.get(attempt_id)
            if entry is not None and entry.wake_at == at:
                return at
            heapq.heappop(self._heap)
        return None


class Timers:
    """One-shot timers on the worker's clock (time limits and their grace) on the watchdog's
    thread (rare, short work); a callback must not block. *on_change*: a new earliest timer."""

    def __init__(self, clock: Callable[[], float], on_change: Callable[[], None]) -> None:
        self.clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int]] = []
        self._due: dict[int, Callable[[], None]] = {}
        self._seq = itertools.count(1)

    def call_at(self, at: float, fn: Callable[[], None]) -> int:
        """Call *fn* once, at clock time *at* (at once if past); return its handle."""
        with self._lock:
            handle = next(self._seq)
            self._due[handle] = fn
            earliest = not self._heap or at < self._heap[0][0]
            heapq.heappush(self._heap, (at, handle))
        if earliest:
            self._on_change()
        return handle

    def cancel(self, handle: int) -> None:
        """Forget the timer *handle* (nothing happens if it already ran)."""
        with self._lock:
            self._due.pop(handle, None)

    def run_due(self) -> float | None:
        """Call every timer due now; return when the next one is due (clock time) or ``None``."""
        now = self.clock()
        due: list[Callable[[], None]] = []
        with self._lock:
            while self._heap and (self._heap[0][0] <= now or self._heap[0][1] not in self._due):
                _, handle = heapq.heappop(self._heap)
                fn = self._due.pop(handle, None)
                if fn is not None:
                    due.append(fn)
            nxt = self._heap[0][0] if self._heap else None
        for fn in due:
            try:
                fn()
            except Exception:
                _LOG.exception("worker timer failed")
        return nxt


class WatchdogThread:
    """Runs a :class:`LeaseWatchdog` and *timers* on one daemon thread; *wake* wakes it."""

    def __init__(
        self, core: LeaseWatchdog, *, wake: Wakeup | threading.Event, timers: Timers
    ) -> None:
        self.core = core
        self._timers = timers
        self._wake = wake
        #: Reports the renewals answered since (each answer sets this thread's wake-up).
        self.answers: Callable[[], None] = lambda: None
        self._stopping = False
        #: Jobs from a connection's reader (listeners: see Hooks.emit), run at the next turn.
        self._handed: deque[Callable[[], None]] = deque()
        self._thread = threading.Thread(target=self._main, name="orbit-lease-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def run_soon(self, job: Callable[[], None]) -> None:
        """Run *job* on this thread at its next turn (from any thread; never blocks)."""
        self._handed.append(job)
        self._wake.set()

    def _run_handed(self) -> None:
        while self._handed:
            job = self._handed.popleft()
            try:
                job()
            except Exception:  # one faulty job must not stop the renewals
                _LOG.exception("lease watchdog job failed")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait up to *timeout* for it."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _main(self) -> None:
        while not self._stopping:
            self._run_handed()
            try:
                self.answers()
                next_due = self.core.run_due()
            except Exception:  # the watchdog must outlive any bug in a callback
                _LOG.exception("lease watchdog iteration failed")
                next_due = self.core.clock() + MIN_RETRY_DELAY
            due = [t for t in (next_due, self._timers.run_due()) if t is not None]
            timeout = max(0.0, min(due) - self.core.clock()) if due else None
            if not self._handed:  # one handed over since its turn: run it now
                self._wake.wait(timeout)
            self._wake.clear()
        self._run_handed()
