"""The supervisor process: N worker processes, drained together, restarted, recycled.

Children are fresh interpreters (``subprocess``: fork + exec of ``sys.executable``), never forks
of this process: the supervisor imports no application code, and an application that opens
sockets, database connections or threads at import (Django, SQLAlchemy engines, gRPC clients)
opens them in each child, not once to be shared by all. Each child builds its own Worker (a new
``instance_id``, its own connection) exactly as a single ``orbit-sync worker`` does.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the supervisor) with two
pipes (:mod:`._wire`). Everything happens on the main thread, which sleeps in ``select`` on the
children's status pipes and the signal wake-up pipe.

Stop: the first SIGTERM/SIGINT asks every child to drain, the second to stop at once, over
their control pipes (not with signals: see :mod:`._child`). Children still running at the stop
deadline, the longest child's ``drain_timeout + cancel_grace + flush_timeout`` plus
:data:`STOP_MARGIN` after the first signal, are killed (SIGKILL). The exit status is the worst of
the children's final ones (:func:`._policy.worst`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import attrs

from .._cli_report import EXIT_FAILED, EXIT_OK
from ..clock import Clock, now_reader
from ._observe import HostHealth, MetricsTarget
from ._policy import Restarts, status_of, worst
from ._wire import DRAIN, ENV, STOP_NOW, ChildSettings, LineReader

__all__ = ["DEFAULT_CHILD_BOUND", "STOP_MARGIN", "Supervisor", "SupervisorOptions"]

_LOG = logging.getLogger("orbit_sync.supervisor")

#: Seconds past the children's own stop bound before the supervisor kills them: the time a
#: child needs to exit once its worker has stopped (interpreter shutdown, atexit handlers).
STOP_MARGIN = 5.0
#: A child's stop bound before it said hello (Worker defaults: drain 30 + grace 5 + flush 10).
DEFAULT_CHILD_BOUND = 45.0
#: What remains of it after the second signal (grace 5 + flush 10): handlers are cancelled at once.
DEFAULT_CHILD_GRACE = 15.0
#: Seconds between two looks at whether a child exited without closing its status pipe.
_POLL = 1.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@attrs.frozen
class SupervisorOptions:
    """What ``--processes`` and its companions say."""

    processes: int
    command: tuple[str, ...]
    label: str
    max_tasks_per_child: int | None = None
    max_memory_per_child: int | None = None
    #: Recycle a process once this many of its slots are stuck (a handler past its time limit
    #: that cannot be stopped holds one).
    max_stuck_per_child: int = 1
    health_port: int | None = None
    metrics_port: int | None = None
    http_host: str = "127.0.0.1"  # where both listen: loopback unless asked


class _Child:
    """One worker process, seen from the supervisor."""

    def __init__(
        self, slot: int, popen: subprocess.Popen[bytes], status_fd: int, control_fd: int
    ) -> None:
        self.slot = slot
        self.control_fd = control_fd
        self.popen = popen
        self.pid = popen.pid
        self.reader = LineReader(status_fd)
        self.ready = False  # its worker reported a session at least once
        self.retiring = False  # draining to be replaced (a recycling limit)
        self.killed = False  # the supervisor sent SIGKILL
        self.bound: float | None = None  # drain + grace + flush, from its hello
        self.grace: float | None = None  # cancel_grace + flush, from its hello
        self.message: str | None = None

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(signum)

    def command(self, what: bytes) -> None:
        # Full (it holds a command already) or closed (the child is gone): nothing to add.
        with contextlib.suppress(OSError):
            os.write(self.control_fd, what)


class Supervisor:
    """Runs :attr:`SupervisorOptions.processes` children of :attr:`SupervisorOptions.command`
    until a signal; :meth:`run` returns the exit status."""

    def __init__(
        self,
        options: SupervisorOptions,
        *,
        out: Callable[[str], None] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.options = options
        self._say = out or _stderr
        self._clock = now_reader(clock)
        self._selector = selectors.DefaultSelector()
        self._children: dict[int, _Child] = {}  # by pid
        self._current: dict[int, _Child] = {}  # slot -> its child (not a retiring one)
        self._last_pid: dict[int, int] = {}  # slot -> the pid of the child started last in it
        self._restarts = {slot: Restarts() for slot in range(options.processes)}
        self._restart_at: dict[int, float] = {}  # slot -> when to start its next child
        self._statuses: list[int] = []
        self._fatal: int | None = None
        self._signals = 0
        self._deadline: float | None = None
        self.health = HostHealth(options.processes, clock=clock)
        self._metrics: MetricsTarget | None = None
        #: Memory recycles after the first task in a row, by slot; said once (see _retire).
        self._first_task_recycles: dict[int, int] = {}
        self._said_no_room = False
        #: Counters for the banner at the end and for tests.
        self.started = 0
        self.recycled = 0
        self.restarted = 0

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        """Start the children, supervise them until they are all gone; the exit status."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the supervisor must run on the main thread (signals)")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        previous = {sig: signal.signal(sig, _ignore) for sig in _STOP_SIGNALS}
        previous_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self._selector.register(wake_r, selectors.EVENT_READ, None)
        servers: list[Any] = []
        try:
            servers = self._serve()
            self._banner()
            for slot in range(self.options.processes):
                self._spawn(slot)
            while self._children or not self._stopping:
                self._step(wake_r)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_wakeup)
            self._selector.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            for child in list(self._children.values()):  # only after an error of our own
                child.signal(signal.SIGKILL)
                child.popen.wait()
            self.health.stopped()
            for server in servers:
                server.close()
        status = self._fatal if self._fatal is not None else worst(self._statuses)
        self._say(
            f"supervisor stopped ({_processes(self.started)} started, {self.recycled} recycled,"
            f" {self.restarted} restarted; exit {status})"
        )
        return status

    @property
    def _stopping(self) -> bool:
        return self._signals > 0 or self._fatal is not None

    def _step(self, wake_r: int) -> None:
        timeout = self._next_timer()
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                with contextlib.suppress(BlockingIOError):
                    for number in os.read(wake_r, 64):
                        if number in _STOP_SIGNALS:
                            self._on_signal(number)
            else:
                self._on_readable(key.data)
        for child in list(self._children.values()):
            if child.popen.poll() is not None and child.pid in self._children:
                self._on_readable(child)  # what it wrote last, then end-of-file
                if child.pid in self._children:
                    self._selector.unregister(child.reader.fd)
                    self._reap(child)
        now = self._clock()
        for slot, at in list(self._restart_at.items()):
            if at <= now:
                del self._restart_at[slot]
                if not self._stopping:
                    self._spawn(slot)
        if self._deadline is not None and now >= self._deadline:
            self._deadline = None
            for child in self._children.values():
                self._say(f"worker process {child.pid} still running at the stop deadline: killed")
                child.killed = True
                child.signal(signal.SIGKILL)

    def _next_timer(self) -> float | None:
        times = list(self._restart_at.values())
        if self._deadline is not None:
            times.append(self._deadline)
        # A child whose pipe a forked grandchild still holds exits without end-of-file: look.
        times.append(self._clock() + _POLL)
        return max(0.0, min(times) - self._clock())

    # ------------------------------------------------------------------ children

    def _spawn(self, slot: int) -> None:
        status_r, status_w = os.pipe()
        os.set_blocking(status_r, False)
        control_r, control_w = os.pipe()
        os.set_blocking(control_w, False)  # a full pipe holds a command already: never wait
        settings = ChildSettings(
            status_fd=status_w,
            control_fd=control_r,
            supervisor_pid=os.getpid(),
            slot=slot,
            max_tasks=self.options.max_tasks_per_child,
            max_memory_mb=self.options.max_memory_per_child,
            max_stuck=self.options.max_stuck_per_child,
            metrics=self._metrics is not None,
            replaces=self._last_pid.get(slot),
        )
        env = {**os.environ, ENV: settings.to_env()}
        if self._metrics is not None:
            env.update(self._metrics.env())
        try:
            popen = subprocess.Popen(
                self.options.command,
                env=env,
                pass_fds=(status_w, control_r),
                start_new_session=True,  # Ctrl-C reaches the supervisor only; it forwards once
            )
        except OSError as exc:
            os.close(status_r)
            os.close(control_w)
            self._say(f"cannot start a worker process: {exc}")
            self._fatal = EXIT_FAILED
            self._stop_all()
            return
        finally:
            os.close(status_w)
            os.close(control_r)
        child = _Child(slot, popen, status_r, control_w)
        self._children[child.pid] = child
        self._current[slot] = child
        self._last_pid[slot] = child.pid
        self._selector.register(status_r, selectors.EVENT_READ, child)
        self.health.child_started(slot, child.pid)
        self.started += 1

    def _on_readable(self, child: _Child) -> None:
        for message in child.reader.read():
            self._on_message(child, message)
        if child.reader.eof:
            self._selector.unregister(child.reader.fd)
            self._reap(child)

    def _on_message(self, child: _Child, message: dict[str, Any]) -> None:
        kind = message["kind"]
        if kind == "hello":
            drain, grace, flush = (
                float(message.get(k) or 0)
                for k in ("drain_timeout", "cancel_grace", "flush_timeout")
            )
            child.bound, child.grace = drain + grace + flush, grace + flush
        elif kind == "state" and isinstance(message.get("state"), dict):
            state = message["state"]
            if state.get("ready") and not child.ready:
                child.ready = True
                self._restarts[child.slot].ready()
            if not child.retiring:
                self.health.child_reported(child.slot, child.pid, state)
        elif kind == "recycle":
            self._retire(
                child, str(message.get("reason")), first_task=bool(message.get("first_task"))
            )
        elif kind == "exit":
            child.message = message.get("message")

    def _retire(self, child: _Child, reason: str, *, first_task: bool = False) -> None:
        """*child* drains to be recycled: its replacement starts now, not once it has exited.
        *first_task*: it passed the memory limit with its first task; twice in a row in a slot,
        the limit leaves no room for a task, and that is said once."""
        if child.retiring or self._current.get(child.slot) is not child:
            return
        streak = self._first_task_recycles
        streak[child.slot] = streak.get(child.slot, 0) + 1 if first_task else 0
        if streak[child.slot] == 2 and not self._said_no_room:
            self._said_no_room = True
            self._say(
                f"worker process {child.pid} recycled after its first task, as the one before it"
                f" in slot {child.slot}: {reason}. Each process now runs about one task; give"
                " --max-memory-per-child more room (this is reported once)"
            )
        child.retiring = True
        del self._current[child.slot]
        self.health.child_gone(child.slot, child.pid)
        self.recycled += 1
        _LOG.info("worker process %d recycled after %s", child.pid, reason)
        if not self._stopping:
            self._spawn(child.slot)

    def _reap(self, child: _Child) -> None:
        """*child* closed its status pipe: wait for it (it is exiting), then decide."""
        try:
            returncode = child.popen.wait(5.0)
        except subprocess.TimeoutExpired:  # it closed the pipe and lives on: end it
            child.killed = True
            child.signal(signal.SIGKILL)
            returncode = child.popen.wait()
        os.close(child.reader.fd)
        os.close(child.control_fd)
        del self._children[child.pid]
        if self._metrics is not None:
            self._metrics.child_exited(child.pid)
        status = status_of(returncode, killed=child.killed, stopping=self._stopping)
        current = self._current.get(child.slot) is child
        if current:
            del self._current[child.slot]
            self.health.child_gone(child.slot, child.pid)
        if self._stopping:
            self._statuses.append(status)
            return
        if child.retiring:
            if status != EXIT_OK:
                self._say(f"recycled worker process {child.pid} exited with status {status}")
            return
        how = "before it was ready" if not child.ready else "unexpectedly"
        why = f": {child.message}" if child.message else ""
        ended = f"exited with status {status}"
        if returncode < 0:
            ended = f"was killed by {_signal_name(-returncode)}"
        delay = self._restarts[child.slot].after_exit(
            status, was_ready=child.ready, returncode=returncode
        )
        if delay is None:
            self._say(f"worker process {child.pid} {ended} {how}{why}; not restarting it: stopping")
            self._fatal = status
            self._stop_all()
            return
        self._say(f"worker process {child.pid} {ended} {how}{why}; restarting it in {delay:.1f} s")
        self.restarted += 1
        self._restart_at[child.slot] = self._clock() + delay

    # ------------------------------------------------------------------ stop

    def _on_signal(self, number: int) -> None:
        self._signals += 1
        name = signal.Signals(number).name
        if self._signals == 1:
            self._say(
                f"{name} received: draining {_processes(len(self._children), 'worker ')}, {name}"
                " again to stop them now"
            )
            self._stop_all()
        else:
            self._say(f"{name} received again: stopping worker processes now")
            now = self._clock()
            for child in self._children.values():
                child.command(STOP_NOW)
            grace = max(
                (c.grace for c in self._children.values() if c.grace is not None),
                default=DEFAULT_CHILD_GRACE,
            )
            end = now + grace + STOP_MARGIN
            self._deadline = end if self._deadline is None else min(self._deadline, end)

    def _stop_all(self) -> None:
        """Drain every child (the first signal, or a child the supervisor gave up on)."""
        self.health.stopping()
        self._restart_at.clear()
        bound = max(
            (
                c.bound if c.bound is not None else DEFAULT_CHILD_BOUND
                for c in self._children.values()
            ),
            default=0.0,
        )
        if self._deadline is None:
            self._deadline = self._clock() + bound + STOP_MARGIN
        for child in self._children.values():
            child.command(DRAIN)

    # ------------------------------------------------------------------ endpoints

    def _serve(self) -> list[Any]:
        servers: list[Any] = []
        o = self.options
        if o.metrics_port is not None:
            self._metrics = MetricsTarget(o.http_host, o.metrics_port)
            servers.append(self._metrics)
            self._say(f"metrics of every worker process on port {self._metrics.port}")
        if o.health_port is not None:
            server = self.health.serve(port=o.health_port, host=o.http_host)
            servers.append(server)
            self._say(f"health of every worker process on port {server.port}")
        return servers

    def _banner(self) -> None:
        o = self.options
        limits = []
        if o.max_tasks_per_child is not None:
            limits.append(f"{o.max_tasks_per_child} tasks")
        if o.max_memory_per_child is not None:
            limits.append(f"{o.max_memory_per_child} MB RSS")
        limits.append(
            f"{o.max_stuck_per_child} stuck slot{'s' if o.max_stuck_per_child > 1 else ''}"
        )
        recycle = f", recycled after {' or '.join(limits)}" if limits else ""
        self._say(
            f"supervisor (pid {os.getpid()}) running {_processes(o.processes, 'worker ')} of"
            f" {o.label}{recycle}; SIGTERM or Ctrl-C drains them all, a second signal stops"
            " them at once"
        )


def _processes(count: int, kind: str = "") -> str:
    """``1 worker process``, ``2 worker processes``."""
    return f"{count} {kind}process{'' if count == 1 else 'es'}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _ignore(signum: int, frame: Any) -> None:
    """The wake-up pipe carries the signal; the handler only replaces the default action."""


def _stderr(message: str) -> None:
    print(f"orbit-sync: {message}", file=sys.stderr, flush=True)
