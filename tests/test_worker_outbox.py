"""The durable outbox: private, checked files, and no result lost to kill -9."""

from __future__ import annotations

import logging
import os
import select
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _worker_helpers import make_worker, running

from orbit_sync import OutboxError
from orbit_sync.client import Client
from orbit_sync.models import Outcome, TaskState
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import AttemptFinished, TaskContext, WorkerListener, WorkerOptions
from orbit_sync.worker.outbox._outbox import Outbox
from orbit_sync.worker.session._replay import replay

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
CHILD = Path(__file__).with_name("_outbox_child.py")


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server with the default 30 s lease: every wait below is far shorter."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


_OPEN_IN_ANOTHER_PROCESS = """
import sys
from orbit_sync.worker import OutboxError
from orbit_sync.worker.outbox._outbox import Outbox
try:
    Outbox(sys.argv[1])
except OutboxError as exc:
    print(exc)
"""


def test_outbox_file_is_private_locked_and_checked(tmp_path: Path) -> None:
    """Created 0600; one process at a time; readable by others, corrupt or foreign: refused."""
    path = tmp_path / "outbox.sqlite"
    box = Outbox(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # A second Worker of this process is told so; another process is told it is another one.
    with pytest.raises(OutboxError, match="already open in this process"):
        Outbox(path)
    other = subprocess.run(
        [sys.executable, "-c", _OPEN_IN_ANOTHER_PROCESS, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert other.stdout.strip() == f"outbox {path} is in use by another process", other.stderr
    box.close()
    box.close()  # safe twice
    Outbox(path).close()

    path.chmod(0o644)
    with pytest.raises(OutboxError, match="chmod 600"):
        Outbox(path)

    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all, " * 100)
    garbage.chmod(0o600)
    with pytest.raises(OutboxError, match="corrupt or not a database"):
        Outbox(garbage)
    assert garbage.read_bytes() == b"not a database at all, " * 100

    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    foreign.chmod(0o600)
    before = foreign.read_bytes()
    with pytest.raises(OutboxError, match="not an orbit-sync outbox"):
        Outbox(foreign)
    assert foreign.read_bytes() == before


def test_records_are_cleared_once_acknowledged(server: MockOrbitServer, tmp_path: Path) -> None:
    """A finished task leaves nothing behind but this run's identity; a bad path fails start."""
    path = tmp_path / "outbox.sqlite"
    worker = make_worker(server, outbox=path)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        return {"ok": True}

    answered = threading.Event()

    class Finished(WorkerListener):
        def attempt_finished(self, event: AttemptFinished) -> None:
            answered.set()

    worker.add_listener(Finished())
    with running(worker):
        task_id = server.enqueue("work", {})
        assert server.wait_for(task_id, DONE, timeout=15).state is TaskState.SUCCEEDED
        assert answered.wait(15), "the finish's answer never reached the worker"
    with Outbox(path) as box:  # a stop keeps what was not acknowledged: here, nothing
        assert box.counts() == {"instances": 1, "launched": 0, "finishes": 0}
    # The secret is in the file, never in what the outbox or the worker print.
    assert server.token not in repr(worker)

    other = make_worker(server, outbox=tmp_path / "missing-dir" / "outbox.sqlite")
    other.register("work", work)
    with pytest.raises(FileNotFoundError):
        other.start()
    with pytest.raises(TypeError, match="outbox"):
        make_worker(server, outbox=3)


def _spawn(
    server: MockOrbitServer, outbox: Path, directory: Path, mode: str
) -> subprocess.Popen[str]:
    env = {**os.environ, "ORBIT_TEST_TOKEN": server.token}
    return subprocess.Popen(
        [
            sys.executable,
            str(CHILD),
            server.url,
            server.queue_id,
            str(outbox),
            str(directory),
            mode,
        ],
        env=env,
        stdout=subprocess.PIPE,  # the handler says "started-<pid>" here (_await_started)
        stderr=subprocess.PIPE,
        text=True,
    )


def _await_output(
    proc: subprocess.Popen[str], text: str, *, stderr: bool = False, timeout: float = 20.0
) -> str:
    """Block until *proc* writes *text* on its stdout (or stderr); return what was read. Read
    from the descriptor, so that ``communicate()`` later returns only the rest."""
    stream = proc.stderr if stderr else proc.stdout
    assert stream is not None
    fd = stream.fileno()
    deadline = time.monotonic() + timeout
    seen = b""
    want = text.encode()
    while want not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"{text!r} not written within {timeout} s")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise AssertionError(f"the worker exited before writing {text!r}")
        seen += chunk
    return seen.decode()


def _await_started(proc: subprocess.Popen[str], timeout: float = 20.0) -> None:
    """Block until a handler of *proc* (or of its executor child) has started: it writes a
    ``started-<pid>`` line on the worker's stdout."""
    _await_output(proc, "started-", timeout=timeout)


def _kill(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == -signal.SIGKILL
    return err


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return err


def _started(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("started-"))


@pytest.mark.parametrize(
    ("policy", "final"),
    [("RECONCILE_ONLY", TaskState.NEEDS_REVIEW), ("IDEMPOTENT", TaskState.SUCCEEDED)],
)
def test_kill_while_handler_runs_is_reported_unknown_at_once(
    server: MockOrbitServer, tmp_path: Path, policy: str, final: TaskState
) -> None:
    """SIGKILL mid-handler: the next process reports UNKNOWN WORKER_LOST at once, no lease wait."""
    outbox = tmp_path / "outbox.sqlite"
    first = _spawn(server, outbox, tmp_path, "hang")
    try:
        task_id = server.enqueue("work", {"n": 1}, retry_safety=policy, backoff_initial=0.05)
        _await_started(first)
    finally:
        _kill(first)
    second = _spawn(server, outbox, tmp_path, "return")
    try:
        # Well inside the 30 s lease: the replay, not lease expiry, ended the attempt.
        snap = server.wait_for(task_id, {final.value}, timeout=20)
    finally:
        err = _stop(second)
    assert (snap.attempts[0].outcome, snap.attempts[0].error_code) == (
        Outcome.UNKNOWN,
        "WORKER_LOST",
    )
    if final is TaskState.SUCCEEDED:  # retried under IDEMPOTENT, by the new process
        assert len(snap.attempts) == 2 and snap.result is not None
        assert snap.result["pid"] == second.pid
    else:
        assert len(snap.attempts) == 1
    assert server.token not in err


def test_result_of_killed_process_is_delivered_by_the_next(
    server: MockOrbitServer, tmp_path: Path
) -> None:
    """SIGKILL after the handler returned, before the finish was answered, and again during the
    replay: a third process delivers the first one's result; the handler ran once."""
    outbox = tmp_path / "outbox.sqlite"
    held = server.faults.reply_error("task.finish", "UNAVAILABLE", count=1_000_000)
    first = _spawn(server, outbox, tmp_path, "return")
    try:
        task_id = server.enqueue("work", {"n": 7})
        server.wait_until(lambda _: held.fired >= 1, timeout=20)
    finally:
        _kill(first)
    seen = held.fired
    second = _spawn(server, outbox, tmp_path, "return")
    try:
        # The replay re-sends the stored finish; it is refused again; kill during the replay.
        server.wait_until(lambda _: held.fired > seen, timeout=20)
    finally:
        _kill(second)
    held.cancel()
    assert server.task(task_id).state is TaskState.RUNNING
    third = _spawn(server, outbox, tmp_path, "return")
    err = ""
    try:
        snap = server.wait_for(task_id, DONE, timeout=20)
        # The server applied the finish before its answer reached the worker: stopped before
        # then, the replay keeps the record for the next process instead (nothing is lost).
        err = _await_output(third, "delivered SUCCEEDED", stderr=True)
    finally:
        err += _stop(third)
    assert snap.state is TaskState.SUCCEEDED and len(snap.attempts) == 1
    assert snap.result == {"n": 7, "pid": first.pid}  # the first process's result
    assert _started(tmp_path) == [f"started-{first.pid}"]  # ran once, in the first process
    assert "delivered SUCCEEDED" in err
    with Outbox(outbox) as box:
        counts = box.counts()
    assert counts["launched"] == counts["finishes"] == 0


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_forked_grandchild_does_not_keep_the_outbox(
    server: MockOrbitServer, tmp_path: Path, stop: signal.Signals
) -> None:
    """A handler that forks a process which stays behind: once the worker is gone (killed or
    stopped) the outbox opens again at once, while the grandchild still runs."""
    outbox = tmp_path / "outbox.sqlite"
    worker = _spawn(server, outbox, tmp_path, "fork")
    grandchildren: list[int] = []
    try:
        task_id = server.enqueue("work", {"n": 1})
        assert server.wait_for(task_id, DONE, timeout=20).state is TaskState.SUCCEEDED
        grandchildren = [int(p.name.split("-")[1]) for p in tmp_path.glob("grandchild-*")]
        assert len(grandchildren) == 1
    finally:
        worker.send_signal(stop)
        worker.communicate(timeout=30)
    try:
        os.kill(grandchildren[0], 0)  # still there
        Outbox(outbox).close()
    finally:
        for pid in grandchildren:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "directory"])
def test_path_that_is_no_file_is_refused_clearly(tmp_path: Path, kind: str) -> None:
    """A symlink (even to a good outbox), a dangling one or a directory: OutboxError, and
    nothing is created beside it."""
    path = tmp_path / "outbox.sqlite"
    if kind == "directory":
        path.mkdir()
    else:
        target = tmp_path / "real.sqlite"
        if kind == "symlink":
            Outbox(target).close()
        path.symlink_to(target)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(OutboxError, match=f"outbox {path} is a"):
        Outbox(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


_FAILING_START = """
import os, resource, signal, sqlite3, sys
from orbit_sync.worker import OutboxError, Worker
from orbit_sync.worker.outbox import _outbox
from orbit_sync.client import Client

url, path, how = sys.argv[1:4]
_outbox.BUSY_TIMEOUT = 0.2  # the write lock is held for good: no need to wait SQLite's 5 s
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
worker = Worker(Client(url, "t"), queue_id="a" * 32, outbox=path, handle_signals=False)
worker.register("work", lambda ctx, payload: None)
fds = len(os.listdir("/proc/self/fd"))
blocker = None
if how == "full":  # no file of this process may grow
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
else:  # another connection holds SQLite's write lock past the busy timeout
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
try:
    worker.start()
except OutboxError as exc:
    print("refused:", type(exc.__cause__).__name__, flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
if blocker is not None:
    blocker.execute("COMMIT")
    blocker.close()
print("descriptors kept:", len(os.listdir("/proc/self/fd")) - fds, flush=True)
worker.start()  # the cause is gone: the same worker starts
print("started again", flush=True)
worker.stop(drain=False)
"""


@pytest.mark.parametrize("how", ["full", "locked"], ids=["disk full", "sqlite busy"])
def test_failing_start_raises_outbox_error_and_releases_everything(
    server: MockOrbitServer, tmp_path: Path, how: str
) -> None:
    """A start() whose outbox cannot be opened (full disk) or written (SQLite busy in
    register): OutboxError from the sqlite3 error, no lock or descriptor kept, and a later
    start() of the same worker succeeds."""
    path = tmp_path / "outbox.sqlite"
    if how == "locked":
        Outbox(path).close()
    out = subprocess.run(
        [sys.executable, "-c", _FAILING_START, server.url, str(path), how],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.splitlines() == [
        "refused: OperationalError",
        "descriptors kept: 0",
        "started again",
    ]


def test_result_delivered_despite_a_full_disk_is_not_replayed_lost(
    server: MockOrbitServer, tmp_path: Path
) -> None:
    """The disk fills while the handler runs: its finish cannot be recorded but is delivered
    (SUCCEEDED). After a kill, the next process finds the launch record and the server says the
    attempt is over: nothing is reported lost, no evidence contradicts the result."""
    outbox = tmp_path / "outbox.sqlite"
    first = _spawn(server, outbox, tmp_path, "diskfull")
    try:
        task_id = server.enqueue("work", {"n": 1})
        assert server.wait_for(task_id, DONE, timeout=20).state is TaskState.SUCCEEDED
    finally:
        err = _kill(first)
    assert "outbox write failed" in err
    box = Outbox(outbox)
    try:
        assert box.counts()["launched"] == 1  # the launch record the full disk left behind
        options = WorkerOptions(
            queue_id=server.queue_id, logger=logging.getLogger("tests.replay"), dial_timeout=10
        )
        done = replay(box, Client(server.url, server.token), exclude="", options=options)
        assert done is True
        assert box.counts() == {"instances": 0, "launched": 0, "finishes": 0}
    finally:
        box.close()
    snap = server.task(task_id)
    assert snap.state is TaskState.SUCCEEDED and len(snap.attempts) == 1
    assert snap.evidence == ()
