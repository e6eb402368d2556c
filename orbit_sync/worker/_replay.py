"""Replay of a durable outbox: deliver what earlier, killed processes left behind.

How a restarted process delivers (docs/protocol.md, "Durable outbox"): it speaks *as the
instance that left the records* — that instance's id and secret come from the outbox — on a
session of its own. That session fences any session the dead process still had (the epoch
grows), ``worker.resume``s each stored attempt, then sends:

- each stored finish with its original ``message_id``: the server applies it while the lease
  lasts, keeps it as evidence after, and answers a repeat with the original receipt;
- for each attempt that was launched but never finished, and whose lease it could resume, a
  finish ``UNKNOWN`` with ``WORKER_LOST`` (recorded before it is sent, so a replay cut midway
  re-sends the same operation): the uncertain effect reaches the server now instead of at lease
  expiry. An attempt whose resume is refused, or answers an inactive lease, was already ended by
  the server (lease expiry, or a finish the dead process delivered but could not record, e.g.
  on a full disk): reporting it lost would only contradict what the server knows, so its
  record is dropped.

No attempt is reported lost while a handler process of the dead instance may still run it: the
replay first takes the instance's lock, which every such process holds while it lives
(``_locks``); while it cannot, the instance waits for the next try.

The replay session never reports capacity, so nothing is ever assigned to it, and it runs no
handler: replay cannot run anything twice.
"""

from __future__ import annotations

import logging

from ..errors import HTTPError, OrbitError, WorkerError
from ..models import Finish, Outcome, Registration, new_message_id
from ._backoff import Backoff
from ._errors import is_fatal_dial_error, is_transient
from ._link import Dialer, Link
from ._outbox import Outbox, Pending

__all__ = ["WORKER_LOST", "replay", "replay_until_done"]

#: The outcome code of an attempt whose process stopped while its handler ran.
WORKER_LOST = "WORKER_LOST"

#: How long one try waits for a dead instance's handler processes to be gone (they exit within
#: ``cancel_grace`` of their worker's death; on Linux at once).
LOCK_WAIT = 1.0


def replay_until_done(
    outbox: Outbox,
    dialer: Dialer,
    *,
    link: Link,
    backoff: Backoff,
    exclude: str,
    log: logging.Logger,
    dial_timeout: float,
    call_timeout: float,
) -> None:
    """The ``orbit-worker-outbox`` thread: :func:`replay` until it is done, waiting per
    *backoff* between tries; ends early when *link* is closed (shutdown)."""
    failures = 0
    while not link.is_closed():
        try:
            done = replay(
                outbox,
                dialer,
                exclude=exclude,
                log=log,
                dial_timeout=dial_timeout,
                call_timeout=call_timeout,
            )
        except OrbitError:  # the outbox file (OutboxError): try again later
            log.exception("outbox replay failed; retrying")
            done = False
        except Exception:  # a bug of ours: retrying would repeat it
            log.exception(
                "outbox replay stopped by a worker error; stored results wait for a restart"
            )
            return
        if done:
            return
        failures += 1
        link.pause(backoff.delay(failures))


def replay(
    outbox: Outbox,
    dialer: Dialer,
    *,
    exclude: str,
    log: logging.Logger,
    dial_timeout: float,
    call_timeout: float,
    lock_wait: float = LOCK_WAIT,
) -> bool:
    """Deliver every stored outcome of instances other than *exclude* (this run's).

    Returns True when nothing is left that a later try could deliver; False after a transient
    failure (the caller retries with backoff). Never raises for a server or network problem.
    """
    complete = True
    for stored in outbox.instances(exclude=exclude):
        registration = stored.registration
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
            if not _deliver(outbox, dialer, registration, pending, log, dial_timeout, call_timeout):
                complete = False
    return complete


def _deliver(
    outbox: Outbox,
    dialer: Dialer,
    registration: Registration,
    pending: list[Pending],
    log: logging.Logger,
    dial_timeout: float,
    call_timeout: float,
) -> bool:
    """Deliver what one dead instance left; False when a later try has something to do."""
    instance = registration.instance_id
    try:
        conn = dialer.dial_worker(registration, dial_timeout)
    except (WorkerError, HTTPError) as exc:
        code = getattr(exc, "code", None) or getattr(exc, "status_code", None)
        if is_fatal_dial_error(exc, stored_identity=True):
            log.error(
                "outbox: the server refused instance %s (%s): %d stored outcome(s) kept "
                "undelivered in %s",
                instance,
                code,
                len(pending),
                outbox.path,
            )
            return True
        return False
    except (OrbitError, OSError) as exc:
        log.warning("outbox: cannot connect to deliver stored outcomes (%s)", exc)
        return False
    complete = True
    try:
        # Every lease first (those still running become this session's), then the finishes.
        ended: set[str] = set()
        for item in pending:
            try:
                lease = conn.resume(item.ref, timeout=call_timeout)
            except WorkerError as exc:
                if is_transient(exc):
                    raise
                ended.add(item.ref.attempt_id)  # refused: the lease is gone
                continue
            if not lease.active:  # the attempt is over (finished or expired)
                ended.add(item.ref.attempt_id)
        # A stored finish is sent either way: after the lease it becomes evidence.
        for item in pending:
            finish, message_id = item.finish, item.message_id
            if finish is None or message_id is None:
                if item.ref.attempt_id in ended:
                    log.info(
                        "outbox: attempt %s (task %s) was already ended by the server; its "
                        "launch record is dropped",
                        item.ref.attempt_id,
                        item.ref.task_id,
                    )
                    outbox.done(item.ref.attempt_id)
                    continue
                finish = Finish(
                    ref=item.ref,
                    outcome=Outcome.UNKNOWN,
                    result={
                        "error": WORKER_LOST,
                        "message": "the worker process stopped while the handler ran",
                    },
                    error_code=WORKER_LOST,
                )
                message_id = new_message_id()
                outbox.record_finish(instance, item.handler, finish, message_id)
            try:
                result = conn.finish(finish, message_id=message_id, timeout=call_timeout)
            except WorkerError as exc:
                if is_transient(exc):
                    complete = False
                    continue
                log.error(
                    "outbox: stored finish %s of attempt %s (task %s) refused (%s); dropped",
                    finish.outcome,
                    item.ref.attempt_id,
                    item.ref.task_id,
                    exc.code,
                )
                outbox.done(item.ref.attempt_id)
                continue
            log.info(
                "outbox: delivered %s of attempt %s (task %s): %s%s",
                finish.outcome,
                item.ref.attempt_id,
                item.ref.task_id,
                result.receipt.disposition.value,
                " (deduplicated)" if result.deduplicated else "",
            )
            outbox.done(item.ref.attempt_id)
    except OrbitError as exc:
        # Disconnected, timed out, a transient refusal, or the server broke the protocol: try
        # again later with the same message_ids.
        log.warning("outbox: delivery interrupted (%s); will retry", type(exc).__name__)
        complete = False
    finally:
        conn.close()
    outbox.forget_instance(instance)
    return complete
