"""Handlers for the process-executor tests: module-level, so a spawned child can import them.

A handler reports to the test through files named in its payload (another process cannot set a
``threading.Event``): it writes ``started`` when it runs, and some wait for a ``release`` file.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from orbit_sync.worker import Fail, TaskContext, UnknownEffect

#: The logger a handler announces its start on (forwarded to the parent's logging).
STARTED_LOGGER = "tests.process.started"

AT = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def _started(payload: dict[str, Any]) -> None:
    Path(payload["dir"], f"started-{os.getpid()}-{time.monotonic_ns()}").write_text("")
    # The parent re-emits this record (WARNING: at the default level children forward) and the
    # test waits on it: an event, not a poll of the file.
    logging.getLogger(STARTED_LOGGER).warning("started")
    # A worker run as its own process (tests/_outbox_child.py) gets the same event on its stdout,
    # which its executor children share.
    print(f"started-{os.getpid()}", flush=True)


def facts(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """What the child can see: its pid, the token variable, the deadline, a datetime result."""
    ctx.logger.info("hello from pid %d", os.getpid())
    logging.getLogger("user.lib").warning("library line from the child")
    return {
        "pid": os.getpid(),
        "token_in_env": "ORBIT_TOKEN" in os.environ,
        "token_file_in_env": "ORBIT_TOKEN_FILE" in os.environ,
        "remaining": ctx.remaining(),
        "attempt": ctx.attempt,
        "payload": payload["n"],
        "at": AT,
    }


def fail(ctx: TaskContext, payload: Any) -> Any:
    """A FAILED outcome with details."""
    raise Fail("DENIED", "no access", details={"user": 7})


def unsure(ctx: TaskContext, payload: Any) -> Any:
    """An UNKNOWN outcome."""
    raise UnknownEffect("CHARGE_UNCONFIRMED", "gateway timed out")


class QuotaError(Exception):
    """An exception type the server sees by name only."""


def broken(ctx: TaskContext, payload: Any) -> Any:
    """Any other exception: HANDLER_ERROR naming the child's exception type."""
    raise QuotaError("password=hunter2 rejected")


def unpicklable(ctx: TaskContext, payload: Any) -> Any:
    """A result that cannot leave the child."""
    return {"lock": __import__("threading").Lock()}


def cooperative(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Waits, honouring cancellation, until cancelled."""
    _started(payload)
    while True:
        ctx.sleep(0.05)


def stubborn(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Ignores cancellation for good (SIGTERM's default is kept: it dies on it)."""
    _started(payload)
    threading.Event().wait()  # never set: only a signal ends this process


def dies(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Exits the process mid-handler, as an OOM kill or a crash would."""
    _started(payload)
    if payload.get("signal"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def effect(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """A side effect that must never run twice at once for a task.

    Holds ``effect-<n>.lock`` (``flock``: the kernel drops it when the process dies) while it
    runs; finding it held means another process is running the same task's effect, and is
    recorded as ``overlap-<pid>``. Runs, honouring cancellation, until ``release`` exists in
    DIR, then returns its pid.
    """
    directory = Path(payload["dir"])
    fd = os.open(directory / f"effect-{payload['n']}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        (directory / f"overlap-{os.getpid()}").write_text("")
        os.close(fd)
        raise
    try:
        _started(payload)
        while not (directory / "release").exists():
            ctx.sleep(0.05)
        (directory / f"effect-{os.getpid()}").write_text("")
    finally:
        os.close(fd)
    return {"pid": os.getpid()}


def pid(ctx: TaskContext, payload: Any) -> Any:
    """Just the child's pid."""
    return {"pid": os.getpid()}


#: What ``hog`` keeps: memory that stays with the child process.
HELD: list[bytes] = []


def hog(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Keep *mb* megabytes (touched) in this process; report the pid."""
    HELD.append(os.urandom(payload["mb"] * 1024 * 1024))
    return {"pid": os.getpid()}


def allocate(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Allocate *mb* megabytes for the attempt only; report the pid."""
    block = bytearray(payload["mb"] * 1024 * 1024)
    return {"pid": os.getpid(), "size": len(block)}


def sleeper(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Blocked in a C call for an hour: an interrupt waits for it, only a kill ends it."""
    _started(payload)
    time.sleep(3600)
    return {"slept": True}


def spinner(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Loops in Python, ignoring its context, until interrupted."""
    _started(payload)
    while True:
        pass
