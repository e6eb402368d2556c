"""Health and readiness for process supervisors and Kubernetes probes (standard library only).

::

    from orbit_sync.contrib.health import HealthProbe

    probe = HealthProbe()
    worker = Worker(client, queue_id=Q, listeners=[probe])
    probe.serve(port=8080, host="0.0.0.0")       # GET /livez, /readyz, /healthz (JSON)
    probe.write_heartbeat("/tmp/orbit-health.json")   # and/or a file for an exec probe

- **ready** (``/readyz``): a session is established and the worker is not draining or stopped;
  take the pod out of rotation otherwise (nothing is served over HTTP by a worker, so this is
  mostly for rollouts and dashboards).
- **live** (``/livez``; ``/healthz`` is the same): the worker has not stopped, while handlers
  are running a lease was renewed within *stale_after* seconds (a wedged process renews
  nothing), and not every slot is stuck (held by a handler that ran past its time limit and
  could not be stopped: such a worker can run nothing more). Disconnected is still live: the
  worker is reconnecting on its own.

Both answer ``200`` or ``503`` with the state as JSON: ``status`` (one word: ``starting``,
``unreached``: not once connected since the start and its dials fail, ``ready``,
``reconnecting``: connected before and lost, ``draining``, ``stopped``), ``reached`` (a session
was established since the start), ``unreached_s`` (while unreached: seconds since the first
failed dial), ``connected``, ``session_age_s``, ``last_renewal_age_s``, ``in_flight``,
``stuck_slots`` (see *live*), ``draining``, ``stopped``, ``reconnects`` (sessions
established after the first), ``dial_failures`` (connection attempts that failed) (no session id:
anyone who can reach the port reads this). The HTTP server is bounded (``_probe_server``): one
thread, a connection cap and a deadline per connection. The heartbeat file holds the same JSON,
rewritten atomically every *interval* seconds; an exec probe checks it with::

    python -m orbit_sync.contrib.health /tmp/orbit-health.json --max-age 30

which exits 0 when the file is fresh and says live, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._seconds import parse_seconds, seconds
from ..clock import Clock, now_reader
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
from ._probe_server import ProbeServer

__all__ = ["FileHeartbeat", "HealthProbe", "HealthServer", "check_heartbeat"]


class HealthProbe(WorkerListener):
    """A :class:`~orbit_sync.worker.WorkerListener` that knows whether the worker is healthy.

    Ages (the session's, the last renewal's, a running handler's) are read on *clock*, an
    :class:`orbit_sync.Clock` (real time when left out; give it the worker's clock in tests; a plain
    function still works, with a ``DeprecationWarning``, until the next release).
    """

    def __init__(
        self, *, stale_after: float = 60.0, clock: Clock | Callable[[], float] | None = None
    ) -> None:
        self._stale_after = seconds(stale_after, "stale_after", positive=True)
        self._clock = now_reader(clock)
        self._lock = threading.Lock()
        self._session_id: str | None = None
        self._session_since: float | None = None
        self._last_renewal: float | None = None
        self._running_since: dict[str, float] = {}
        self._draining = False
        self._stopped = False
        self._reconnects = 0
        self._dial_failures = 0
        #: Slots held by stuck handlers, out of the worker's capacity (None: none seen).
        self._stuck = 0
        self._capacity: int | None = None
        self._reached = False
        #: When the first dial failed, while no session was ever established.
        self._unreached_since: float | None = None

    # ------------------------------------------------------------------ events

    def connected(self, event: SessionEvent) -> None:
        """A session is up."""
        with self._lock:
            self._session_id = event.session_id
            self._session_since = self._clock()
            self._reconnects += event.reconnect
            self._reached = True
            self._unreached_since = None

    def disconnected(self, event: DisconnectEvent) -> None:
        """The session is down (the worker reconnects)."""
        with self._lock:
            self._session_id = self._session_since = None

    def dial_failed(self, event: DisconnectEvent) -> None:
        """A connection attempt failed (the worker retries)."""
        with self._lock:
            self._dial_failures += 1
            if not self._reached and self._unreached_since is None:
                self._unreached_since = self._clock()

    def attempt_started(self, event: AttemptEvent) -> None:
        """A handler is running."""
        with self._lock:
            self._running_since[event.attempt_id] = self._clock()

    def attempt_finished(self, event: AttemptFinished) -> None:
        """A handler's attempt ended."""
        with self._lock:
            self._running_since.pop(event.attempt_id, None)

    def handler_stuck(self, event: StuckEvent) -> None:
        """A handler that could not be stopped holds a slot."""
        with self._lock:
            self._stuck, self._capacity = event.stuck, event.capacity

    def handler_unstuck(self, event: StuckEvent) -> None:
        """A stuck handler returned: its slot is free."""
        self.handler_stuck(event)

    def lease_renewed(self, event: LeaseEvent) -> None:
        """The watchdog is alive and the server answered."""
        with self._lock:
            self._last_renewal = self._clock()

    def draining(self, event: DrainEvent) -> None:
        """The worker takes no new work."""
        with self._lock:
            self._draining = True

    def stopped(self, report: ShutdownReport) -> None:
        """The worker has stopped."""
        with self._lock:
            self._stopped = True
            self._session_id = self._session_since = None
            self._running_since.clear()

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        """The worker's health as JSON-ready values (``live`` and ``ready`` included)."""
        now = self._clock()
        with self._lock:
            connected = self._session_id is not None and not self._stopped
            renewal_age = None if self._last_renewal is None else now - self._last_renewal
            # Renewals are due at least every half lease: the oldest running handler (or the
            # last renewal, if newer) must have seen one within stale_after.
            oldest = min(self._running_since.values(), default=None)
            wedged = False
            if oldest is not None:
                latest = max(oldest, self._last_renewal or oldest)
                wedged = now - latest > self._stale_after
            # Every slot held by a handler that cannot be stopped: nothing more can run here.
            all_stuck = self._capacity is not None and self._stuck >= self._capacity
            live = not self._stopped and not wedged and not all_stuck
            ready = connected and not self._draining
            return {
                "live": live,
                "ready": ready,
                "status": self._status(ready),
                "reached": self._reached,
                "unreached_s": None
                if self._unreached_since is None
                else round(now - self._unreached_since, 3),
                "connected": connected,
                "session_age_s": None
                if self._session_since is None
                else round(now - self._session_since, 3),
                "last_renewal_age_s": None if renewal_age is None else round(renewal_age, 3),
                "in_flight": len(self._running_since),
                "stuck_slots": self._stuck,
                "draining": self._draining,
                "stopped": self._stopped,
                "reconnects": self._reconnects,
                "dial_failures": self._dial_failures,
            }

    def _status(self, ready: bool) -> str:
        """The state in one word (under the lock)."""
        if self._stopped:
            return "stopped"
        if self._draining:
            return "draining"
        if ready:
            return "ready"
        if self._reached:
            return "reconnecting"
        return "unreached" if self._unreached_since is not None else "starting"

    def serve(
        self,
        port: int = 8080,
        host: str = "127.0.0.1",
        *,
        max_connections: int = 8,
        timeout: float = 5.0,
    ) -> HealthServer:
        """Serve ``/livez``, ``/readyz`` and ``/healthz`` on a daemon thread; ``port=0`` picks one.

        The default host is loopback: only this machine (a sidecar, an exec probe with curl)
        can ask. A Kubernetes ``httpGet`` probe connects to the pod's address: pass
        ``host="0.0.0.0"`` (or ``"::"``) to listen on every interface. At most
        *max_connections* are served at once (more are closed at once), each for at most
        *timeout* seconds, all on one thread.
        """
        return HealthServer(self, host, port, max_connections=max_connections, timeout=timeout)

    def write_heartbeat(self, path: str | os.PathLike[str], interval: float = 5.0) -> FileHeartbeat:
        """Rewrite *path* with :meth:`state` every *interval* seconds on a daemon thread."""
        return FileHeartbeat(self, path, interval)


class HealthServer:
    """A tiny HTTP server answering health probes; :meth:`close` stops it."""

    def __init__(
        self,
        probe: HealthProbe,
        host: str,
        port: int,
        *,
        max_connections: int = 8,
        timeout: float = 5.0,
    ) -> None:
        self._probe = probe
        self._server = ProbeServer(
            self._answer, host, port, max_connections=max_connections, timeout=timeout
        )
        #: The address it listens on (host, port), and its port (useful with ``port=0``).
        self.address: tuple[str, int] = self._server.address
        self.port: int = self._server.port

    def _answer(self, path: str) -> tuple[int, bytes]:
        path = path.rstrip("/")
        state = self._probe.state()
        if path in ("/livez", "/healthz"):
            ok = state["live"]
        elif path == "/readyz":
            ok = state["ready"]
        else:
            return 404, b""
        return (200 if ok else 503), json.dumps(state).encode()

    @property
    def open_connections(self) -> int:
        """How many client connections are open now."""
        return self._server.open_connections

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.close()

    def __enter__(self) -> HealthServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class FileHeartbeat:
    """Rewrites a JSON file with the probe's state every *interval* seconds; :meth:`close` stops.

    Each write is atomic (a temporary file renamed over the old one), so a reader never sees a
    half-written file; the file's mtime is the heartbeat.
    """

    def __init__(
        self, probe: HealthProbe, path: str | os.PathLike[str], interval: float = 5.0
    ) -> None:
        self._interval = seconds(interval, "interval", positive=True)
        self._probe = probe
        self.path = os.fspath(path)
        self._stop = threading.Event()
        self.write()  # fail here, not on the thread, if the path is unusable
        self._thread = threading.Thread(
            target=self._main, name="orbit-sync-health-file", daemon=True
        )
        self._thread.start()

    def write(self) -> None:
        """Write the current state now."""
        state = self._probe.state()
        state["written_at"] = time.time()
        directory = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = tempfile.mkstemp(prefix=".orbit-health-", dir=directory)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(state, out)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise

    def _main(self) -> None:
        while not self._stop.wait(self._interval):
            # A full disk must not kill the worker; the file going stale says it.
            with contextlib.suppress(OSError):
                self.write()

    def close(self) -> None:
        """Stop rewriting; the last write (with ``stopped`` if the worker stopped) stays."""
        self._stop.set()
        self._thread.join(5.0)
        self.write()


def check_heartbeat(path: str | os.PathLike[str], max_age: float = 30.0) -> tuple[bool, str]:
    """``(ok, why)``: the heartbeat file exists, is at most *max_age* seconds old, says live."""
    # Checked first: a NaN bound compares false with every age and would call any file fresh.
    max_age = seconds(max_age, "max_age")
    try:
        age = time.time() - os.stat(path).st_mtime
        with open(path) as src:
            state = json.load(src)
    except (OSError, ValueError) as exc:
        # The path and the reason (the OS's words, or where the JSON broke), never the content.
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        if isinstance(exc, json.JSONDecodeError):
            why = f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        return False, f"cannot read heartbeat {os.fspath(path)}: {why}"
    if age > max_age:
        return False, f"heartbeat is {age:.0f}s old (over {max_age:g}s)"
    if not state.get("live"):
        return False, "worker is not live"
    return True, "ok"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m orbit_sync.contrib.health PATH [--max-age S]``: exit 0 if healthy, else 1."""
    parser = argparse.ArgumentParser(prog="python -m orbit_sync.contrib.health")
    parser.add_argument("path", help="the heartbeat file the worker writes")
    parser.add_argument("--max-age", type=parse_seconds, default=30.0, help="seconds (default 30)")
    args = parser.parse_args(argv)
    ok, why = check_heartbeat(args.path, args.max_age)
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
