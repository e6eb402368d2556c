"""``orbit-sync worker module:attribute``, run as a subprocess against an in-process mock server."""

from __future__ import annotations

import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli_process import Proc, clean_env, command

from orbit_sync.testing import MockOrbitServer

USER_MODULE = textwrap.dedent(
    """
    import os

    from orbit_sync.client import Client
    from orbit_sync.worker import Worker

    def make():
        worker = Worker(
            Client(os.environ["ORBIT_URL"], os.environ["ORBIT_TOKEN"]),
            queue_id=os.environ["ORBIT_QUEUE_ID"],
            capacity=1,
            drain_timeout=5,
        )

        @worker.handler("echo")
        def echo(ctx, payload):
            print("handled", payload["n"], flush=True)
            return {"echo": payload["n"]}

        return worker

    class App:
        worker = None

    not_a_worker = "just a string"
    """
)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory holding the user's worker module."""
    (tmp_path / "userworker.py").write_text(USER_MODULE)
    return tmp_path


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes started by a test; killed at teardown if the test did not stop them."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


def env_for(server: MockOrbitServer, token: str | None = None) -> dict[str, str]:
    """What the user's module reads to reach *server*."""
    return clean_env(
        ORBIT_URL=server.url,
        ORBIT_TOKEN=server.token if token is None else token,
        ORBIT_QUEUE_ID=server.queue_id,
    )


@pytest.mark.orbit_server(assignment_rate=None)
def test_worker_command_runs_handlers_until_sigterm(
    orbit_server: MockOrbitServer, project: Path, procs: list[Proc]
) -> None:
    """The named factory's Worker runs tasks; SIGTERM drains it and the command exits 0."""
    proc = Proc(command("worker", "userworker:make"), env=env_for(orbit_server), cwd=project)
    procs.append(proc)
    task_id = orbit_server.enqueue("echo", {"n": 7})
    assert proc.line() == "handled 7"
    snap = orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED"}, timeout=10)
    assert snap.state.value == "SUCCEEDED" and snap.result == {"echo": 7}
    assert proc.stop(signal.SIGTERM) == 0
    assert "worker stopped (drained=True" in proc.stderr
    assert orbit_server.token not in proc.stderr


def test_worker_command_reports_a_rejected_token(
    orbit_server: MockOrbitServer, project: Path
) -> None:
    """A worker the server refuses (401) stops: exit 1, and the token is not printed."""
    token = "not-a-valid-token-0123456789"
    done = subprocess.run(
        command("worker", "userworker:make"),
        capture_output=True,
        text=True,
        timeout=30,
        env=env_for(orbit_server, token),
        cwd=project,
    )
    assert done.returncode == 1
    assert "worker stopped on HTTPError" in done.stderr
    assert token not in done.stderr and token not in done.stdout


@pytest.mark.parametrize(
    ("target", "status", "message"),
    [
        ("userworker", 2, "module:attribute"),
        ("nosuchmodule:worker", 1, "cannot load nosuchmodule:worker"),
        ("userworker:missing", 1, "cannot load userworker:missing"),
        ("userworker:not_a_worker", 1, "is a str, not an orbit_sync.worker.Worker"),
        ("userworker:App.worker", 1, "is a NoneType, not an orbit_sync.worker.Worker"),
    ],
)
def test_worker_command_rejects_bad_targets(
    project: Path, target: str, status: int, message: str
) -> None:
    """Targets that are malformed, missing or not Workers fail with a clear message."""
    done = subprocess.run(
        command("worker", target),
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
        cwd=project,
    )
    assert done.returncode == status
    assert message in done.stderr
