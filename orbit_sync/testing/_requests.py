"""Requests from workers: ``worker.hello`` and every later frame of a session (PROTOCOL §5-§7).

Each request is answered from the tables in :mod:`._core`; anything it frees or creates (a slot,
a WAITING task, a capacity report) is followed by a dispatch pass from :mod:`._dispatch`.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
from typing import Any

from .._codec import ClientFrame, unstructure
from ..models import (
    AttemptRef,
    AttemptState,
    CapacityReport,
    CommandResult,
    Disposition,
    Finish,
    Lease,
    Operation,
    Outcome,
    Receipt,
    Registration,
    TaskState,
    Welcome,
    new_id,
)
from ._dispatch import Dispatch
from ._records import (
    FINISH_STATE,
    LIVE,
    MSG,
    SCOPE_CONSUME,
    Action,
    Answer,
    Attempt,
    CloseSession,
    Evidence,
    FinishRecord,
    Handled,
    Instance,
    Op,
    Push,
    RateWindow,
    Reject,
    Session,
    Task,
    canonical,
    content_key,
    digest,
    queue_scope,
    receipt_of,
    to_datetime,
)
from ._snapshots import RetrySafety

__all__ = ["Requests"]


def _finish_key(fin: Finish) -> str:
    content = {
        "outcome": fin.outcome.value,
        "result": fin.result,
        "error_code": fin.error_code,
        "retryable": fin.retryable is True,
    }
    return hashlib.sha256(canonical(content).encode()).hexdigest()


class Requests(Dispatch):
    """The session and attempt requests of ``pulse.worker.v1``."""

    # ------------------------------------------------------------------ sessions

    def hello(self, token: str, frame: ClientFrame) -> Handled:
        """Open a session for a validated ``worker.hello`` (PROTOCOL §5.1-§5.4)."""
        try:
            return self._hello(token, frame)
        except Reject as rej:
            self._event("session.refused", detail=rej.code)
            return Handled(Answer("error", error=(rej.code, rej.message), close=True))

    def _hello(self, token: str, frame: ClientFrame) -> Handled:
        reg = frame.body
        assert isinstance(reg, Registration)
        scopes = self.token_scopes(token)
        if scopes is None:
            raise Reject("UNAUTHENTICATED", MSG["UNAUTHENTICATED"], close=True)
        self._check_scopes(scopes, reg.queue_id)
        caps = frozenset(reg.capabilities)
        inst = self._instances.get(reg.instance_id)
        if inst is None:
            inst = Instance(
                instance_id=reg.instance_id,
                secret_digest=digest(reg.instance_secret),
                token_digest=digest(token),
                queue_id=reg.queue_id,
                capabilities=caps,
                order=self._instances_made,
            )
            self._instances_made += 1
            self._instances[inst.instance_id] = inst
        else:
            # Knowing an instance_id is not enough to take a process over (PROTOCOL §5.4).
            if not hmac.compare_digest(
                inst.secret_digest, digest(reg.instance_secret)
            ) or not hmac.compare_digest(inst.token_digest, digest(token)):
                raise Reject(
                    "PERMISSION_DENIED", "the instance is bound to other credentials", close=True
                )
            if inst.queue_id != reg.queue_id:
                raise Reject("STATE_CONFLICT", "a worker process cannot switch queues", close=True)
            if inst.capabilities != caps:
                raise Reject(
                    "STATE_CONFLICT",
                    "a worker process cannot change its capabilities by reconnecting",
                    close=True,
                )
        actions: list[Action] = []
        now = self.now_us()
        inst.epoch += 1
        for old in [self._sessions[sid] for sid in inst.sessions]:
            if not old.stale:
                old.stale = True
                self._event("session.stale", session=old.session_id, detail=f"epoch={old.epoch}")
                self._maybe_ended(old)
                if old.connected and not old.expired:
                    actions.append(
                        Push(
                            old.session_id,
                            "error",
                            error=("STALE_SESSION", "a newer session of this worker exists"),
                        )
                    )
                    actions.append(CloseSession(old.session_id, "stale session"))
        session = Session(
            session_id=new_id(),
            instance_id=inst.instance_id,
            epoch=inst.epoch,
            token=token,
            registration=reg,
            opened_at=now,
            expires_at=now + self.session_us,
            requests=RateWindow(self._request_rate),
            keys=tuple(
                (reg.queue_id, c.handler, c.handler_version, c.payload_version)
                for c in reg.capabilities
            ),
        )
        self._sessions[session.session_id] = session
        self._connected[session.session_id] = None
        heapq.heappush(self._expiries, (session.expires_at, session.session_id))
        inst.sessions.add(session.session_id)
        inst.current_session = session.session_id
        self._event("session.opened", session=session.session_id, detail=f"epoch={inst.epoch}")
        return Handled(
            Answer("worker.welcome", self._welcome(session)),
            tuple(actions),
            session.session_id,
        )

    def _welcome(self, session: Session) -> dict[str, Any]:
        inst = self._instances[session.instance_id]
        now = self.now_us()
        welcome = Welcome(
            session_id=session.session_id,
            epoch=session.epoch,
            server_time=to_datetime(now),
            expires_at=to_datetime(session.expires_at),
            lease_duration_ms=self.lease_us // 1000,
            draining=inst.draining,
        )
        return unstructure(welcome)

    def connection_lost(self, session_id: str) -> list[Action]:
        """The session's WebSocket closed. Its attempts keep their leases until they expire."""
        session = self._sessions.get(session_id)
        if session is None or not session.connected:
            return []
        session.connected = False
        self._connected.pop(session_id, None)
        self._event("session.disconnected", session=session_id)
        self._maybe_ended(session)
        return []

    def handle(self, session_id: str, frame: ClientFrame) -> Handled:
        """Answer one validated request received on *session_id*'s connection."""
        session = self._sessions[session_id]
        try:
            answer, actions = self._handle(session, frame)
        except Reject as rej:
            if rej.close:
                self._event("session.closed", session=session_id, detail=rej.code)
            return Handled(
                Answer("error", error=(rej.code, rej.message), close=rej.close),
                session_id=session_id,
            )
        return Handled(answer, tuple(actions), session_id)

    def _handle(self, session: Session, frame: ClientFrame) -> tuple[Answer, list[Action]]:
        if frame.type == "worker.hello":
            raise Reject("INVALID_FRAME", "worker.hello was already received", close=True)
        if frame.session_id != session.session_id:
            raise Reject(
                "STALE_SESSION", "the frame does not name this connection's session", close=True
            )
        self._check_live(session)
        self._check_token(session)
        self._check_request_rate(session)
        key = content_key(frame.type, frame.raw_body)
        op = self._ops.get(frame.message_id)
        if op is not None and (op.kind != frame.type or op.key != key):
            raise Reject("IDEMPOTENCY_CONFLICT", MSG["IDEMPOTENCY_CONFLICT"])
        if frame.type == "worker.capacity":
            return self._capacity(session, frame, key)
        if frame.type == "worker.resume":
            return self._resume(session, frame, key)
        if op is not None and op.receipt is not None:
            return self._replay(session, frame, op), []
        if frame.type == "task.start":
            return self._start(session, frame, key)
        if frame.type == "task.renew":
            return self._renew(session, frame, key)
        return self._finish(session, frame, key)

    def _check_live(self, session: Session) -> None:
        if session.stale:
            raise Reject("STALE_SESSION", MSG["STALE_SESSION"], close=True)
        if session.expired or session.expires_at <= self.now_us():
            self._expire(session)
            raise Reject("STALE_SESSION", MSG["EXPIRED"], close=True)

    def _check_token(self, session: Session) -> None:
        # Every control operation re-checks the credential (the token may have been revoked).
        scopes = self.token_scopes(session.token)
        if scopes is None:
            raise Reject("UNAUTHENTICATED", MSG["UNAUTHENTICATED"], close=True)
        self._check_scopes(scopes, session.registration.queue_id)

    def _check_scopes(self, scopes: frozenset[str], queue_id: str) -> None:
        """PERMISSION_DENIED (PROTOCOL §11: missing consume or queue scope) saying which."""
        if SCOPE_CONSUME not in scopes:
            raise Reject(
                "PERMISSION_DENIED", f"the token lacks the {SCOPE_CONSUME} scope", close=True
            )
        if queue_scope(queue_id) not in scopes or queue_id not in self._queues:
            # An unknown queue reads as a missing scope (no oracle for queue ids); naming the
            # queue the worker itself sent tells it nothing new.
            raise Reject(
                "PERMISSION_DENIED",
                f"the token has no scope for queue {queue_id}, or this server has no such queue",
                close=True,
            )

    def _check_request_rate(self, session: Session) -> None:
        now = self.now_us()
        if not session.requests.allows(now):
            raise Reject("RATE_LIMITED", MSG["RATE_LIMITED"])
        session.requests.add(now)

    # ------------------------------------------------------------------ capacity

    def _capacity(
        self, session: Session, frame: ClientFrame, key: str
    ) -> tuple[Answer, list[Action]]:
        report = frame.body
        assert isinstance(report, CapacityReport)
        inst = self._instances[session.instance_id]
        # The sequence belongs to the process: it keeps increasing across its sessions.
        if inst.sequence is not None:
            if report.sequence < inst.sequence:
                raise Reject("STATE_CONFLICT", "capacity sequence is older than the current one")
            if report.sequence == inst.sequence and report != inst.report:
                raise Reject("STATE_CONFLICT", "capacity sequence was used with other content")
        if inst.draining and not report.drain:
            raise Reject("STATE_CONFLICT", "drain is persistent for the worker process")
        repeat = inst.sequence == report.sequence
        inst.sequence = report.sequence
        inst.report = report
        if report.drain and not inst.draining:
            inst.draining = True
            self._event("instance.draining", session=session.session_id)
        first = not session.enabled
        session.enabled = True
        session.expires_at = self.now_us() + self.session_us
        if not repeat or first:
            self._event(
                "session.capacity",
                session=session.session_id,
                detail=f"sequence={report.sequence} capacity={report.capacity} "
                f"drain={str(report.drain).lower()}",
            )
        if self._record(frame.message_id, frame.type, key):
            # A report is superseded by the next one (an older sequence is STATE_CONFLICT and
            # a repeat is re-checked by content), so only the latest receipt can ever matter.
            if inst.capacity_op != frame.message_id:
                self._forget_op(inst.capacity_op)
            inst.capacity_op = frame.message_id
        return Answer("ack", self._welcome(session)), self._pump()

    # ------------------------------------------------------------------ attempts

    def _find(self, session: Session, ref: AttemptRef) -> tuple[Task, Attempt]:
        # One answer for every mismatch (unknown, other instance, wrong secret): no oracle.
        att = self._attempts.get(ref.attempt_id)
        if (
            att is None
            or att.task_id != ref.task_id
            or att.epoch != ref.epoch
            or att.instance_id != session.instance_id
            or not hmac.compare_digest(att.lease_secret.encode(), ref.lease_secret.encode())
        ):
            raise Reject("LEASE_LOST", MSG["LEASE_LOST"])
        return self._tasks[att.task_id], att

    def _lease(self, task: Task, att: Attempt, session: Session) -> Lease:
        now = self.now_us()
        active = (
            att.state in LIVE and now < att.lease_until and att.session_id == session.session_id
        )
        cancel = task.cancel_requested_at
        return Lease(
            active=active,
            state=att.state,
            lease_until=to_datetime(att.lease_until),
            server_time=to_datetime(now),
            cancel_requested_at=None if cancel is None else to_datetime(cancel),
        )

    def _answer(
        self,
        frame: ClientFrame,
        key: str,
        session: Session,
        task: Task,
        att: Attempt,
        receipt: Receipt,
        *,
        dedup: bool = False,
    ) -> Answer:
        """Remember *receipt* under the request's message_id and build its CommandResult."""
        self._record(frame.message_id, frame.type, key, receipt, att.attempt_id)
        return self._result(task, att, session, receipt, dedup)

    def _result(
        self, task: Task, att: Attempt, session: Session, receipt: Receipt, dedup: bool
    ) -> Answer:
        result = CommandResult(receipt, self._lease(task, att, session), dedup)
        return Answer("ack", unstructure(result))

    def _replay(self, session: Session, frame: ClientFrame, op: Op) -> Answer:
        # Same operation again: the original receipt, the lease as it is *now* (PROTOCOL §6.5).
        assert op.receipt is not None and op.attempt_id is not None
        att = self._attempts.get(op.attempt_id)
        if att is None:  # its task ended and was forgotten (retention)
            raise Reject("LEASE_LOST", MSG["LEASE_LOST"])
        task = self._tasks[att.task_id]
        self._event(
            "request.deduplicated",
            task=task,
            attempt=att,
            session=session.session_id,
            detail=frame.type,
        )
        return self._result(task, att, session, op.receipt, True)

    def _resume(
        self, session: Session, frame: ClientFrame, key: str
    ) -> tuple[Answer, list[Action]]:
        ref = frame.body
        assert isinstance(ref, AttemptRef)
        task, att = self._find(session, ref)
        if (
            att.state in LIVE
            and self.now_us() < att.lease_until
            and att.session_id != session.session_id
        ):
            old = att.session_id
            att.session_id = session.session_id
            self._event(
                "attempt.resumed",
                task=task,
                attempt=att,
                session=session.session_id,
                old=old,
                new=session.session_id,
            )
        if self._record(frame.message_id, frame.type, key):
            session.resume_ops.append(frame.message_id)
        return Answer("ack", unstructure(self._lease(task, att, session))), []

    def _start(self, session: Session, frame: ClientFrame, key: str) -> tuple[Answer, list[Action]]:
        ref = frame.body
        assert isinstance(ref, AttemptRef)
        task, att = self._find(session, ref)
        now = self.now_us()
        if att.state not in LIVE or now >= att.lease_until:
            raise Reject("LEASE_LOST", MSG["LEASE_LOST"])
        if att.state is AttemptState.RUNNING:
            raise Reject("STATE_CONFLICT", "the attempt was already started")
        if att.session_id != session.session_id:
            raise Reject("LEASE_LOST", "the attempt belongs to another session; resume it first")
        if self._queues[task.queue_id].paused:
            raise Reject("UNAVAILABLE", MSG["PAUSED"])
        until = self._cap(now + self.lease_us, session, task, now)
        if until <= now:
            raise Reject("LEASE_LOST", MSG["LEASE_LOST"])
        att.started_at = now
        att.lease_until = until
        self._set_attempt(att, AttemptState.RUNNING)
        self._set_task(task, TaskState.RUNNING)
        receipt = receipt_of(Operation.START, task, att, Disposition.APPLIED)
        return self._answer(frame, key, session, task, att, receipt), []

    def _renew(self, session: Session, frame: ClientFrame, key: str) -> tuple[Answer, list[Action]]:
        ref = frame.body
        assert isinstance(ref, AttemptRef)
        task, att = self._find(session, ref)
        now = self.now_us()
        if att.state is AttemptState.LEASED and now < att.lease_until:
            raise Reject("STATE_CONFLICT", "only a started attempt can be renewed")
        if att.state is not AttemptState.RUNNING or now >= att.lease_until:
            raise Reject("LEASE_LOST", MSG["LEASE_LOST"])
        if att.session_id != session.session_id:
            raise Reject("LEASE_LOST", "the attempt belongs to another session; resume it first")
        if task.cancel_requested_at is None:
            until = self._cap(now + self.lease_us, session, task, att.started_at)
            if until > att.lease_until:  # a renewal never shortens a lease
                att.lease_until = until
                self._event("attempt.renewed", task=task, attempt=att, detail=str(until))
        receipt = receipt_of(Operation.RENEW, task, att, Disposition.APPLIED)
        return self._answer(frame, key, session, task, att, receipt), []

    def _finish(
        self, session: Session, frame: ClientFrame, key: str
    ) -> tuple[Answer, list[Action]]:
        fin = frame.body
        assert isinstance(fin, Finish)
        task, att = self._find(session, fin.ref)
        now = self.now_us()
        fkey = _finish_key(fin)
        if att.finish is not None and att.finish.key == fkey:
            # Same result re-reported under a new message_id: the first applied receipt.
            receipt = att.finish.receipt
            self._event("finish.repeated", task=task, attempt=att, session=session.session_id)
            return self._answer(frame, key, session, task, att, receipt, dedup=True), []
        if fkey in att.evidence:
            receipt = att.evidence[fkey]
            return self._answer(frame, key, session, task, att, receipt, dedup=True), []
        if att.finish is not None:
            return self._evidence(session, frame, key, task, att, fin, fkey, "conflict"), []
        if att.state is AttemptState.RUNNING and now < att.lease_until:
            if fin.outcome is Outcome.CANCELLED and task.cancel_requested_at is None:
                raise Reject("STATE_CONFLICT", "CANCELLED needs a stored cancel request")
            return self._apply_finish(session, frame, key, task, att, fin, fkey)
        reason = "not_started" if att.started_at is None else "late"
        return self._evidence(session, frame, key, task, att, fin, fkey, reason), []

    def _apply_finish(
        self,
        session: Session,
        frame: ClientFrame,
        key: str,
        task: Task,
        att: Attempt,
        fin: Finish,
        fkey: str,
    ) -> tuple[Answer, list[Action]]:
        now = self.now_us()
        result = canonical(fin.result)
        att.outcome = fin.outcome
        att.error_code = fin.error_code
        att.result = result
        att.retryable = fin.retryable
        att.finished_at = now
        self._set_attempt(att, FINISH_STATE[fin.outcome])
        self._release(att)
        if fin.outcome is Outcome.UNKNOWN:
            task.effect_uncertain = True
        if fin.outcome is Outcome.SUCCEEDED:
            self._finalize(task, TaskState.SUCCEEDED, fin.outcome, result, None)
        elif fin.outcome is Outcome.FAILED:
            if fin.retryable is True and self._retry(task):
                pass
            else:
                self._finalize(task, TaskState.FAILED, fin.outcome, result, fin.error_code)
        elif fin.outcome is Outcome.UNKNOWN:
            if not (task.policy.retry_safety is RetrySafety.IDEMPOTENT and self._retry(task)):
                self._finalize(task, TaskState.NEEDS_REVIEW, fin.outcome, result, fin.error_code)
        else:
            self._finalize(task, TaskState.CANCELLED, fin.outcome, result, fin.error_code)
        receipt = receipt_of(Operation.FINISH, task, att, Disposition.APPLIED)
        att.finish = FinishRecord(fkey, receipt)
        return self._answer(frame, key, session, task, att, receipt), self._pump()

    def _evidence(
        self,
        session: Session,
        frame: ClientFrame,
        key: str,
        task: Task,
        att: Attempt,
        fin: Finish,
        fkey: str,
        reason: str,
    ) -> Answer:
        task.evidence.append(
            Evidence(
                attempt_id=att.attempt_id,
                message_id=frame.message_id,
                outcome=fin.outcome,
                result=canonical(fin.result),
                error_code=fin.error_code,
                retryable=fin.retryable is True,
                received_at=self.now_us(),
                reason=reason,
            )
        )
        receipt = receipt_of(Operation.FINISH, task, att, Disposition.EVIDENCE_ONLY)
        att.evidence[fkey] = receipt
        self._event(
            "finish.evidence", task=task, attempt=att, session=session.session_id, detail=reason
        )
        return self._answer(frame, key, session, task, att, receipt)
