"""The admin API's fault endpoints: arm, list, wait for, cancel and clear faults, and push a raw
frame.

:class:`FaultDesk` numbers the faults armed through the API (from 1, in arming order) so a
caller can refer to one later; it only keeps those, not faults armed through the Python API.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

from .._realtime import monotonic
from ..models import CODE_RE
from ._admin_client import MAX_WAIT
from ._admin_endpoint import Answer, Endpoint
from ._admin_query import Params, Problem, bad, not_found
from ._faults import Fault
from ._http import HttpRequest

if TYPE_CHECKING:
    from ._server import MockOrbitServer

__all__ = ["FaultDesk"]

_FRAME_TYPE = re.compile(r"[a-z]+\.[a-z]+")
#: Fault kinds: the names of ``server.faults``' arming methods.
_FAULT_KINDS = (
    "drop_reply",
    "close_before",
    "close_after",
    "delay_reply",
    "reply_error",
    "duplicate_push",
    "refuse_connections",
)


class FaultDesk:
    """The faults armed through one :class:`~._admin_routes.AdminAPI`, and their endpoints."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def endpoints(self) -> tuple[Endpoint, ...]:
        """This desk's endpoints (they read and arm its faults)."""
        number = r"([1-9][0-9]{0,8})"
        return (
            ("GET", r"/faults", self._list_faults, ""),
            (
                "POST",
                r"/faults",
                self._arm_fault,
                "kind frame_type session_id count seconds code status",
            ),
            ("POST", r"/faults/clear", self._clear_faults, ""),
            ("POST", r"/faults/send-raw", self._send_raw, "text session_id"),
            ("GET", rf"/faults/{number}/wait", self._wait_fault, "timeout"),
            ("POST", rf"/faults/{number}/cancel", self._cancel_fault, ""),
        )

    def _fault_view(self, number: int, fault: Fault) -> dict[str, Any]:
        return {
            "id": number,
            "kind": fault.kind,
            "frame_type": fault.frame_type,
            "session_id": fault.session_id,
            "count": fault.count,
            "fired": fault.fired,
            "armed": fault.armed,
        }

    def _fault(self, m: re.Match[str]) -> tuple[int, Fault]:
        number = int(m.group(1))
        with self._lock:
            if number > len(self._faults):
                raise not_found(f"no fault {number} was armed through this API")
            return number, self._faults[number - 1]

    def _list_faults(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> Answer:
        p.done()
        with self._lock:
            faults = list(enumerate(self._faults, 1))
        return 200, {"faults": [self._fault_view(n, f) for n, f in faults]}

    def _arm_fault(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> Answer:
        kind = p.text("kind")
        if kind not in _FAULT_KINDS:
            raise bad(f"parameter 'kind' must be one of {', '.join(_FAULT_KINDS)}")
        count = p.opt_int("count", 1, 10**6) or 1
        faults = server.faults
        fault: Fault
        if kind == "refuse_connections":
            status = p.opt_int("status", 300, 599) or 503
            p.done()
            fault = faults.refuse_connections(count, status)
        else:
            frame_type = p.opt_text(
                "frame_type", pattern=_FRAME_TYPE, what="a frame type such as task.finish"
            )
            session_id = p.opt_id("session_id")
            seconds = p.opt_seconds("seconds", high=60.0) if kind == "delay_reply" else None
            code = (
                p.opt_text("code", pattern=CODE_RE, what="an error code [A-Z][A-Z0-9_]*")
                if kind == "reply_error"
                else None
            )
            p.done()
            if kind == "duplicate_push":
                fault = faults.duplicate_push(
                    frame_type or "task.assign", count, session_id=session_id
                )
            elif frame_type is None:
                raise bad(f"parameter 'frame_type' is required for {kind}")
            elif kind == "delay_reply":
                fault = faults.delay_reply(
                    frame_type, 0.5 if seconds is None else seconds, count, session_id=session_id
                )
            elif kind == "reply_error":
                fault = faults.reply_error(
                    frame_type, code or "UNAVAILABLE", count, session_id=session_id
                )
            elif kind == "drop_reply":
                fault = faults.drop_reply(frame_type, count, session_id=session_id)
            elif kind == "close_before":
                fault = faults.close_before(frame_type, count, session_id=session_id)
            else:
                fault = faults.close_after(frame_type, count, session_id=session_id)
        with self._lock:
            self._faults.append(fault)
            number = len(self._faults)
        return 201, {"fault": self._fault_view(number, fault)}

    def _wait_fault(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> Answer:
        timeout = p.opt_seconds("timeout", high=MAX_WAIT)
        p.done()
        number, fault = self._fault(m)
        deadline = monotonic() + (10.0 if timeout is None else timeout)
        # A fault's firing does not always notify the server's condition (a refused upgrade
        # changes no state), so wait on the fault's own event, in slices short enough to notice
        # a stopping server (whose stop() joins this thread).
        reached = fault.wait(0)
        while not reached and not server.stopping:
            remaining = deadline - monotonic()
            if remaining <= 0:
                break
            reached = fault.wait(min(remaining, 0.1))
        return 200, {"reached": reached, "fault": self._fault_view(number, fault)}

    def _cancel_fault(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> Answer:
        p.done()
        number, fault = self._fault(m)
        fault.cancel()
        return 200, {"fault": self._fault_view(number, fault)}

    def _clear_faults(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> Answer:
        p.done()
        server.faults.clear()
        return 200, {"cleared": True}

    def _send_raw(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> Answer:
        text = p.text("text")
        session_id = p.opt_id("session_id")
        p.done()
        try:
            server.faults.send_raw(text, session_id)
        except LookupError:
            raise Problem(409, "NO_SESSION", "no connected session to send to") from None
        return 200, {"sent": True}
