"""A new connection's resumes, for the connection thread: sent in as few writes as the link's
request slots allow, each in its own slot, and each outcome stepped into its attempt's machine
as its answer arrives (the answer also wakes the connection thread)."""

from __future__ import annotations

from functools import partial

from ...connection import BatchCall, PendingCall
from ...errors import OrbitError
from ..core._machine import AttemptMachine, Request
from ..runtime._link import Connection, GaveUp
from ..runtime._registry import Attempt
from ..runtime._shell import AttemptShell

__all__ = ["ResumeBatch"]


class ResumeBatch:
    """The resumes *shell*'s machines decide on the connection thread."""

    def __init__(self, shell: AttemptShell) -> None:
        self._shell = shell
        #: Resumes not sent yet; those sent and not stepped yet, with their connection's gen.
        self._unsent: list[tuple[Attempt, Request]] = []
        self._resuming: list[tuple[Attempt, Request, PendingCall, int]] = []

    def flush(self, conn: Connection, gen: int) -> None:
        """Send the resumes decided since on *conn* in one write, as many as the request slots
        take now (at least one, waiting, when none of ours is in flight); the rest go next."""
        wait = not self._resuming
        self._unsent.extend(self._shell.take_resumes())
        while self._unsent:
            try:
                taken = self._shell.controls.link.gate.acquire(len(self._unsent), wait=wait)
            except GaveUp:
                unsent, self._unsent = self._unsent, []
                for att, request in unsent:
                    self._shell.resumes.sent(request)
                    self._shell.step(att, partial(AttemptMachine.gave_up, request=request))
                return
            if not taken:
                return
            wait = False
            batch, self._unsent = self._unsent[:taken], self._unsent[taken:]
            calls = [
                BatchCall(
                    "worker.resume", r.body, r.message_id, self._shell.options.request_timeout
                )
                for _, r in batch
            ]
            pending = conn.send_many(calls, wake=self._shell.controls.wake)
            for (att, request), call in zip(batch, pending, strict=True):
                self._resuming.append((att, request, call, gen))
                self._shell.resumes.sent(request)

    def take_answered(self) -> bool:
        """Step the outcome of every resume answered (or failed) since; True if there was one."""
        done = [item for item in self._resuming if item[2].done()]
        self._resuming = [item for item in self._resuming if item not in done]
        for att, request, call, gen in done:
            try:
                event = self._shell.answer(att, request, call.result())
            except OrbitError as exc:
                event = self._shell.failure(att, request, exc, gen)
            finally:
                self._shell.controls.link.gate.release()
            self._shell.step(att, event)
        return bool(done)
