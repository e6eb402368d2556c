"""One health endpoint and one Prometheus target for every worker process of a host.

Health: each child reports its :class:`~orbit_sync.contrib.health.HealthProbe` state to the
supervisor (:mod:`._wire`); :class:`HostHealth` combines them, and is served by the same
:class:`~orbit_sync.contrib.health.HealthServer` a single worker uses (same paths, same JSON
keys, plus ``processes``):

- ready when every slot's current child is ready (a recycled child's replacement included) and
  the supervisor is not stopping;
- live unless the supervisor has stopped or a child is not live (a wedged worker renews nothing)
  or has not reported for :data:`STALE_REPORT` seconds. A child that is being restarted does not
  make the host unlive: the supervisor is handling it.

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
#: Keys summed over the children in the host's state.
_SUMMED = ("in_flight", "reconnects", "stuck_slots")


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

    def child_started(self, slot: int, pid: int) -> None:
        """*slot* has a new child (not ready until it reports so)."""
        with self._host_lock:
            self._slots[slot] = (pid, None, self._clock())

    def child_reported(self, slot: int, pid: int, state: dict[str, Any]) -> None:
        """A child's state, if it is still its slot's current one."""
        with self._host_lock:
            current = self._slots.get(slot)
            if current is not None and current[0] == pid:
                self._slots[slot] = (pid, state, self._clock())

    def child_gone(self, slot: int, pid: int) -> None:
        """*slot*'s child exited or is draining to be replaced."""
        with self._host_lock:
            current = self._slots.get(slot)
            if current is not None and current[0] == pid:
                del self._slots[slot]

    def stopping(self) -> None:
        """The supervisor is draining every child."""
        with self._host_lock:
            self._stopping = True

    def stopped(self, report: Any = None) -> None:
        """The supervisor is done."""
        with self._host_lock:
            self._stopping = self._done = True

    def state(self) -> dict[str, Any]:
        """The host's state: the single-worker keys (summed or combined) and ``processes``."""
        now = self._clock()
        with self._host_lock:
            slots = dict(self._slots)
            stopping, done = self._stopping, self._done
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
            "connected": all(c.get("connected") for c in children),
            "draining": stopping,
            "stopped": done,
            **{key: sum(int(c.get(key) or 0) for c in children) for key in _SUMMED},
            "processes": children,
        }


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
