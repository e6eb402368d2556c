"""Replay of a durable outbox: deliver what earlier, killed processes left (docs/outbox.md,
docs/architecture.md). :class:`ReplayShell` drives one try on one connection, ended by
:data:`TRY_LIMIT`; what is left waits for the next try, after the backoff.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from functools import partial

from ...errors import HTTPError, OrbitError, WorkerError
from ...models import Finish, Registration, new_message_id
from .._options import WorkerOptions
from ..core._errors import is_fatal_dial_error
from ..core._machine import (
    Action,
    AttemptMachine,
    BreakConnection,
    Ended,
    Event,
    Keep,
    Phase,
    RecordFinish,
    Release,
    Reported,
    Send,
    answered,
    failed,
)
from ..core._outcomes import WORKER_LOST
from ..outbox._outbox import Outbox, Pending
from ..runtime._link import Connection, Dialer, Link, Wakeup
from ..runtime._requests import Caller, waiting_thread
from ..runtime._shutdown import CLOSE_ALLOWANCE

__all__ = ["TRY_LIMIT", "WORKER_LOST", "ReplayShell", "replay", "replay_until_done"]

#: How long one try waits for a dead instance's handler processes to be gone (they exit within
#: ``cancel_grace`` of their worker's death; on Linux at once).
LOCK_WAIT = 1.0

#: The longest one try delivers on its connection; the rest stays stored for the next try.
TRY_LIMIT = 30.0


def replay_until_done(
    outbox: Outbox, dialer: Dialer, *, link: Link, exclude: str, options: WorkerOptions
) -> None:
    """The ``orbit-worker-outbox`` thread: :func:`replay` until done, with ``reconnect_backoff``
    between tries; ends when *link* (the worker's) is closed."""
    waiting_thread()  # it makes the replay's calls and waits for their answers
    failures = 0
    while not link.is_closed():
        try:
            done = replay(outbox, dialer, exclude=exclude, options=options, stop=link)
        except OrbitError:  # the outbox file (OutboxError): try again later
            options.logger.exception("outbox replay failed; retrying")
            done = False
        except Exception:  # a bug of ours: retrying would repeat it
            options.logger.exception(
                "outbox replay stopped by a worker error; stored results wait for a restart"
            )
            return
        if done:
            return
        failures += 1
        link.pause(options.reconnect_backoff.delay(failures))


def replay(
    outbox: Outbox,
    dialer: Dialer,
    *,
    exclude: str,
    options: WorkerOptions,
    lock_wait: float = LOCK_WAIT,
    stop: Link | None = None,
) -> bool:
    """Deliver every stored outcome of instances other than *exclude* (this run's): True when
    nothing is left a later try could deliver, False after a transient failure. Never raises for
    a server or network problem. Closing *stop* ends a try in progress."""
    log = options.logger
    complete = True
    for registration in outbox.instances(exclude=exclude):
        if stop is not None and stop.is_closed():
            return False
        instance = registration.instance_id
        pending = outbox.pending(instance)
        if not pending:
            outbox.forget_instance(instance)
            continue
        with outbox.instance_lock(instance, lock_wait) as gone:
            if not gone:
                log.info(
                    "outbox: a handler process of instance %s still runs; delivery waits for it",
                    instance,
                )
                complete = False
                continue
            log.info(
                "outbox: delivering %d stored outcome(s) of an earlier process (instance %s)",
                len(pending),
                instance,
            )
            try:
                conn: Connection = dialer.dial_worker(registration, options.dial_timeout)
            except (WorkerError, HTTPError) as exc:
                if not is_fatal_dial_error(exc, stored_identity=True):
                    complete = False
                    continue
                # The server refuses the stored identity: no later try can get a session.
                log.error(
                    "outbox: the server refused instance %s (%s): %d stored outcome(s) kept "
                    "undelivered in %s",
                    instance,
                    getattr(exc, "code", None) or getattr(exc, "status_code", None),
                    len(pending),
                    outbox.path,
                )
                continue
            except (OrbitError, OSError) as exc:
                log.warning("outbox: cannot connect to deliver stored outcomes (%s)", exc)
                complete = False
                continue
            if not ReplayShell(outbox, registration, pending, options).run(conn, stop):
                complete = False
            outbox.forget_instance(instance)
    return complete


class _Stored:
    """One stored attempt on the replay session: its record and its machine."""

    __slots__ = ("item", "machine")

    def __init__(self, item: Pending, retry_delay: float) -> None:
        self.item = item
        self.machine = AttemptMachine(item.ref, new_id=new_message_id, retry_delay=retry_delay)


class ReplayShell:
    """One try at delivering what one dead instance left, on one connection. Only :meth:`run`'s
    thread steps the machines, through a queue it drains, one request at a time."""

    def __init__(
        self,
        outbox: Outbox,
        registration: Registration,
        pending: list[Pending],
        options: WorkerOptions,
    ) -> None:
        self._clock = clock = options.clock
        self._wakeup = Wakeup(clock)
        self._link = Link(clock)
        self._log = options.logger
        self._caller = Caller(self._link, options)
        self._outbox = outbox
        self._instance = registration.instance_id
        self._stored = [_Stored(item, options.renew_retry_delay) for item in pending]
        #: Events for the machines, queued for run()'s loop (never a recursion).
        self._events: collections.deque[tuple[_Stored, Event]] = collections.deque()
        #: Stored attempts not yet settled, and those the try gave up (still stored).
        self._open = len(self._stored)
        self._kept = 0

    def _stop(self, conn: Connection) -> None:
        self._link.close()  # ends a retry delay being waited for
        conn.close()  # ends the call being waited for: its record stays for the next try
        self._wakeup.set()

    def run(self, conn: Connection, stop: Link | None) -> bool:
        """Deliver on *conn* (then closed); True when every stored attempt is settled for good."""
        unsubscribe = stop.on_close(partial(self._stop, conn)) if stop is not None else None
        try:
            self._link.publish(conn)
            for s in self._stored:
                item = s.item
                replayed = partial(
                    AttemptMachine.replay, finish=item.finish, message_id=item.message_id
                )
                self._events.append((s, replayed))
            if not self._step_until(
                self._clock.now() + TRY_LIMIT,
                lambda: not self._open or self._link.is_closed() or conn.done.is_set(),
            ):
                self._log.warning("outbox: delivery not done within %.0f s; will retry", TRY_LIMIT)
        finally:
            if unsubscribe is not None:
                unsubscribe()
            # End the try: what is kept gives up, what is in flight fails (its record stays).
            self._link.close()
            conn.close()
            self._step_until(self._clock.now() + CLOSE_ALLOWANCE, lambda: not self._open)
        if self._open or self._kept:
            self._log.warning("outbox: delivery interrupted; will retry")
            return False
        return True

    def _step_until(self, until: float, done: Callable[[], bool]) -> bool:
        """Step the machines' events until *done* (True) or the clock reaches *until* (False)."""
        while True:
            self._wakeup.clear()  # before the checks: a wake-up after them is not lost
            while self._events:
                s, event = self._events.popleft()
                for action in event(s.machine):
                    self._perform(s, action)
            if done():
                return True
            if self._clock.now() >= until:
                return False
            self._wakeup.wait(until - self._clock.now())

    def _perform(self, s: _Stored, action: Action) -> None:
        if isinstance(action, Send):
            request = action.request
            outcome = self._caller.call(request)
            if outcome.gave_up:
                event: Event = partial(AttemptMachine.gave_up, request=request)
            elif outcome.error is not None:
                event = failed(request, outcome.error, outcome.gen)
            else:
                event = answered(request, outcome.value)
            self._events.append((s, event))
        elif isinstance(action, Keep):
            # A failed connection: this try has no newer one; a retry delay is waited for here.
            again = not action.newer_than and self._caller.wait_to_resend(action)
            then = AttemptMachine.resend if again else AttemptMachine.gave_up
            self._events.append((s, partial(then, request=action.request)))
        elif isinstance(action, BreakConnection):
            self._link.broken(action.gen)
        elif isinstance(action, RecordFinish):
            finish = action.request.body
            assert isinstance(finish, Finish)
            # Before it is sent; an OutboxError ends the try with nothing sent for it.
            self._outbox.record_finish(
                self._instance, s.item.handler, finish, action.request.message_id
            )
        elif isinstance(action, Reported):
            self._reported(s, action)
        elif isinstance(action, Ended):
            self._log.info(
                "outbox: attempt %s (task %s) was already ended by the server; its "
                "launch record is dropped",
                s.item.ref.attempt_id,
                s.item.ref.task_id,
            )
            self._outbox.done(s.item.ref.attempt_id)
        elif isinstance(action, Release):
            self._open -= 1
            if s.machine.phase is Phase.UNREPORTED:
                self._kept += 1
        else:
            raise AssertionError(f"unexpected replay action {action!r}")

    def _reported(self, s: _Stored, reported: Reported) -> None:
        ref, outcome = s.item.ref, reported.verdict.outcome
        result, error = reported.result, reported.error
        if result is not None:
            self._log.info(
                "outbox: delivered %s of attempt %s (task %s): %s%s",
                outcome,
                ref.attempt_id,
                ref.task_id,
                result.receipt.disposition.value,
                " (deduplicated)" if result.deduplicated else "",
            )
        elif error is not None:
            self._log.error(
                "outbox: stored finish %s of attempt %s (task %s) refused (%s); dropped",
                outcome,
                ref.attempt_id,
                ref.task_id,
                getattr(error, "code", type(error).__name__),
            )
        else:
            return  # the try ended first: still stored, re-sent by the next one
        self._outbox.done(ref.attempt_id)
