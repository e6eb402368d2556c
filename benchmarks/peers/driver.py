"""Runs the peers against a private Redis on loopback and collects their figures.

Redis is Debian's ``redis-server`` on a free loopback port, without persistence, stopped after the
run. Each peer drains N pre-enqueued messages; its figures come from inside its worker process
(:mod:`benchmarks.peers._meter`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._common import ROOT, child_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A throw-away redis-server on 127.0.0.1; yields its URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--loglevel",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _flush(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushall()


def _run_peer(
    url: str, tasks: int, enqueue: list[str], worker: list[str], timeout: float
) -> dict[str, Any]:
    env = child_env()
    _flush(url)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        env.update(BENCH_REDIS_URL=url, BENCH_TASKS=str(tasks), BENCH_OUT=str(out))
        subprocess.run(
            [sys.executable, "-m", *enqueue], env=env, cwd=ROOT, check=True, timeout=timeout
        )
        log = Path(tmp) / "worker.log"
        with open(log, "w") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", *worker],
                env=env,
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                deadline = time.monotonic() + timeout
                while not out.exists():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"peer {worker[0]} did not finish:\n{log.read_text()[-3000:]}"
                        )
                    time.sleep(0.05)
                figures: dict[str, Any] = json.loads(out.read_text())
            finally:
                # Its own process group: the peer's forked workers stop with it.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    figures["ok"] = figures.get("tasks") == tasks
    return figures


def dramatiq(url: str, tasks: int, kind: str, timeout: float = 600) -> dict[str, Any]:
    """Dramatiq 2.x, ``-p 1 -t 32``, draining *tasks* ``kind`` messages (noop or incr)."""
    return _run_peer(
        url,
        tasks,
        ["benchmarks.peers._dramatiq_app", kind, str(tasks)],
        ["dramatiq", "benchmarks.peers._dramatiq_app", "-p", "1", "-t", "32", "-Q", "bench"],
        timeout,
    )


def celery(url: str, tasks: int, timeout: float = 600) -> dict[str, Any]:
    """Celery 5.x, ``--pool threads -c 32``, ``acks_late``, draining *tasks* no-op tasks.

    Gossip, mingle and heartbeats are off: they only add broker traffic for a lone worker, so
    this flatters Celery, if anything.
    """
    return _run_peer(
        url,
        tasks,
        ["benchmarks.peers._celery_app", str(tasks)],
        [
            "celery",
            "-A",
            "benchmarks.peers._celery_app",
            "worker",
            "--pool",
            "threads",
            "-c",
            "32",
            "-Q",
            "bench",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "WARNING",
        ],
        timeout,
    )
