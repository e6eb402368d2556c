"""One health endpoint and one Prometheus target for every worker process of a host.

Health: each child reports its :class:`~orbit_sync.contrib.health.HealthProbe` state to the
supervisor (:mod:`._wire`); :class:`HostHealth` combines them, and is served by the same
:class:`~orbit_sync.contrib.health.HealthServer` a single worker uses (same paths, every JSON key
of a single worker's, plus ``processes``):

- ready when every slot's current child is ready (a recycled child's replacement included) and
  the supervisor is not stopping;
- live unless the supervisor has stopped or a child is not live (a wedged worker renews nothing)
  or has not reported for :data:`STALE_REPORT` seconds. A child that is being restarted does not
  make the host unlive: the supervisor is handling it;
- ``status``: the supervisor's own while it stops (``draining``, then ``stopped``), ``ready``
  when the host is, else the first of :data:`_STATUS_ORDER` a slot is in (one whose process has
  not reported yet is ``starting``): the one that most needs someone. ``unreached`` is the host's
  only while no process has reached the server since the supervisor started; after that a
  process that cannot reach it is ``reconnecting``;
- ``reached`` (sticky) once any process established a session; ``unreached_s`` until then, from
  the first failed dial of any process;
- ``session_age_s`` and ``last_renewal_age_s``: the most recent session and renewal of any
  process (the youngest session shows a reconnect; a process's own renewals already decide its
  ``live``, and an idle one renews nothing);
- ``in_flight`` and ``stuck_slots`` summed over the current processes; ``reconnects`` and
  ``dial_failures`` over every process since the start (recycled ones included).

Ages in a child's report are as of the report: the host adds the report's age.

Metrics: the children count in ``prometheus_client``'s multiprocess mode (a directory of
memory-mapped files, one set per process); the supervisor serves the sum. Counters and
histograms of children that exited stay in the sum (no counter goes backwards when a child is
recycled); the gauges (``orbit_attempts_in_flight``, ``orbit_connected``) count live children
only.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import threading
from typing import Any

from ..clock import Clock
from ..contrib.health import HealthProbe

__all__ = ["STALE_REPORT", "HostHealth", "MetricsTarget"]

#: A child silent for this long (its reports come every half second) is not live.
STALE_REPORT = 30.0
#: Gauges summed over the current children.
_SUMMED = ("in_flight", "stuck_slots")
#: Counts summed over every child since the start (an exited child's last report included).
_COUNTED = ("reconnects", "dial_failures")
#: A host that is not ready says the first of these a slot is in: the one that most needs
#: someone (the server never reached from here, then lost, then a process going away).
_STATUS_ORDER = ("unreached", "reconnecting", "stopped", "draining", "starting")


def _number(value: Any) -> float | None:
    """*value* if a child reported a number there (JSON ``null`` and anything else: None)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class HostHealth(HealthProbe):
    """The host's health from its children's reports (a probe for ``HealthServer``; it listens to
    no worker itself)."""

    def __init__(self, processes: int, *, clock: Clock | None = None) -> None:
        super().__init__(clock=clock)
        self._processes = processes
        self._host_lock = threading.Lock()
        #: slot -> (pid, state, when reported) of the slot's current child
        self._slots: dict[int, tuple[int, dict[str, Any] | None, float]] = {}
        self._stopping = False
        self._done = False
        #: A child established a session since the start (it stays so).
        self._host_reached = False
        #: When a child's first dial failed, while none has reached the server.
        self._first_failed_dial: float | None = None
        #: _COUNTED of the children that are no longer their slot's current one.
        self._past = dict.fromkeys(_COUNTED, 0)

    def child_started(self, slot: int, pid: int) -> None:
        """*slot* has a new child (not ready until it reports so)."""
        with self._host_lock:
            self._retire(slot)
            self._slots[slot] = (pid, None, self._clock())

    def child_reported(self, slot: int, pid: int, state: dict[str, Any]) -> None:
        """A child's state, if it is still its slot's current one."""
        now = self._clock()
        with self._host_lock:
            current = self._slots.get(slot)
            if current is None or current[0] != pid:
                return
            self._slots[slot] = (pid, state, now)
            if state.get("reached"):
                self._host_reached = True
            unreached = _number(state.get("unreached_s"))
            if unreached is not None:
                since = now - unreached
                first = self._first_failed_dial
                self._first_failed_dial = since if first is None else min(first, since)

    def child_gone(self, slot: int, pid: int) -> None:
        """*slot*'s child exited or is draining to be replaced."""
        with self._host_lock:
            current = self._slots.get(slot)
            if current is not None and current[0] == pid:
                self._retire(slot)

    def _retire(self, slot: int) -> None:
        """Keep the counts of *slot*'s child, and forget it (under the host lock)."""
        gone = self._slots.pop(slot, None)
        if gone is None or gone[1] is None:
            return
        for key in _COUNTED:
            self._past[key] += int(_number(gone[1].get(key)) or 0)

    def stopping(self) -> None:
        """The supervisor is draining every child."""
        with self._host_lock:
            self._stopping = True

    def stopped(self, report: Any = None) -> None:
        """The supervisor is done."""
        with self._host_lock:
            self._stopping = self._done = True

    def state(self) -> dict[str, Any]:
        """The host's state: every key of a single worker's (combined as the module says) and
        ``processes``."""
        now = self._clock()
        with self._host_lock:
            slots = dict(self._slots)
            stopping, done = self._stopping, self._done
            reached, first_failed = self._host_reached, self._first_failed_dial
            past = dict(self._past)
        children = []
        for slot in range(self._processes):
            pid, state, at = slots.get(slot, (None, None, now))
            age = now - at
            child: dict[str, Any] = {"slot": slot, "pid": pid, "report_age_s": round(age, 3)}
            if state is None:
                child.update(live=True, ready=False, starting=pid is not None)
            else:
                child.update(state)
                child["live"] = bool(state.get("live")) and age <= STALE_REPORT
            children.append(child)
        ready = not stopping and all(c.get("ready") for c in children)
        return {
            "live": not done and all(c["live"] for c in children),
            "ready": ready,
            "status": _host_status(
                children, ready=ready, stopping=stopping, done=done, reached=reached
            ),
            "reached": reached,
            "unreached_s": None
            if reached or first_failed is None
            else round(now - first_failed, 3),
            "connected": all(c.get("connected") for c in children),
            "session_age_s": _youngest(children, "session_age_s"),
            "last_renewal_age_s": _youngest(children, "last_renewal_age_s"),
            **{key: sum(int(_number(c.get(key)) or 0) for c in children) for key in _SUMMED},
            "draining": stopping,
            "stopped": done,
            **{
                key: past[key] + sum(int(_number(c.get(key)) or 0) for c in children)
                for key in _COUNTED
            },
            "processes": children,
        }


def _host_status(
    children: list[dict[str, Any]], *, ready: bool, stopping: bool, done: bool, reached: bool
) -> str:
    """The host's state in one word (see the module)."""
    if done:
        return "stopped"
    if stopping:
        return "draining"
    if ready:
        return "ready"
    found = {c.get("status") or "starting" for c in children if not c.get("ready")}
    if reached and "unreached" in found:
        found = (found - {"unreached"}) | {"reconnecting"}  # the host did reach the server
    return next((word for word in _STATUS_ORDER if word in found), "starting")


def _youngest(children: list[dict[str, Any]], key: str) -> float | None:
    """The smallest *key* age of the children, each aged by its report's age (None: none)."""
    ages = [age + c["report_age_s"] for c in children if (age := _number(c.get(key))) is not None]
    return round(min(ages), 3) if ages else None


class MetricsTarget:
    """The children's Prometheus metrics, summed, served on *host*:*port*.

    Needs ``prometheus_client`` (``pip install 'orbit-sync[prometheus]'``): :meth:`check` says
    so before any child starts.
    """

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.directory = tempfile.mkdtemp(prefix="orbit-sync-metrics-")
        registry = CollectorRegistry()
        registry.register(_ChildrenMetrics(self.directory))
        try:
            self._server, self._thread = start_http_server(port, host, registry=registry)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        #: The port it listens on (useful with port 0).
        self.port: int = self._server.server_address[1]

    @staticmethod
    def check() -> str | None:
        """Why metrics cannot be served here (None: they can)."""
        try:
            import prometheus_client.multiprocess  # noqa: F401
        except ImportError:
            return "--metrics-port needs prometheus_client: pip install 'orbit-sync[prometheus]'"
        return None

    def env(self) -> dict[str, str]:
        """What a child's environment needs to count into this target."""
        return {"PROMETHEUS_MULTIPROC_DIR": self.directory}

    def child_exited(self, pid: int) -> None:
        """Drop an exited child's live gauges (its counters stay in the sum)."""
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self.directory)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        """Stop serving; remove the directory."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
        shutil.rmtree(self.directory, ignore_errors=True)


#: Bytes of the header (bytes used) a ``prometheus_client`` multiprocess file starts with.
_MMAP_HEADER = 8


class _ChildrenMetrics:
    """``MultiProcessCollector``, without the files a process is still creating.

    A process creates its file empty, then sizes it: a scrape in between would fail on it (HTTP
    500) with the library's own collector, and so would every scrape after a child killed in
    between. Such a file holds no value yet, so leaving it out loses nothing.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Any:
        from prometheus_client.multiprocess import MultiProcessCollector

        files = []
        for path in glob.glob(os.path.join(self.directory, "*.db")):
            try:
                if os.stat(path).st_size >= _MMAP_HEADER:
                    files.append(path)
            except FileNotFoundError:  # a live gauge of a child that exited meanwhile
                continue
        return MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
