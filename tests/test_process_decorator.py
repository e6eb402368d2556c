"""``@worker.handler(..., executor="process")`` on a module-level function: the documented form,
under pytest (an imported module) and under ``orbit-sync worker`` (a subprocess), against the
real mock server over loopback."""

from __future__ import annotations

import importlib
import os
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cli_process import Proc, clean_env, command

from orbit_sync import Client
from orbit_sync.models import TaskState
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Worker

#: The docs' example, as a user writes it: a module-level Worker whose client comes from the
#: environment, and the handler under the decorator.
APP = textwrap.dedent(
    """
    import os

    from orbit_sync import Client, TaskContext, Worker

    worker = Worker(
        Client.from_env(), queue_id=os.environ["ORBIT_QUEUE_ID"], capacity=2, process_pool=1
    )

    @worker.handler("render", executor="process")
    def render(ctx: TaskContext, payload: dict) -> dict:
        return {"pid": os.getpid(), "token_in_env": "ORBIT_TOKEN" in os.environ}
    """
)

#: The same, with the name bound to another object after the decorator ran.
REBOUND = APP + "\nrender = None\n"


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server without an assignment rate limit."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv


def _import(tmp_path: Path, name: str, source: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def _env(server: MockOrbitServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORBIT_URL", server.url)
    monkeypatch.setenv("ORBIT_TOKEN", server.token)
    monkeypatch.setenv("ORBIT_QUEUE_ID", server.queue_id)
    monkeypatch.delenv("ORBIT_TOKEN_FILE", raising=False)


def test_decorator_form_runs_in_a_child_under_pytest(
    server: MockOrbitServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module imports, and its decorated handler runs in a child that has no token."""
    _env(server, monkeypatch)
    app = _import(tmp_path, "decorated_app", APP, monkeypatch)
    worker: Worker = app.worker
    worker.start()
    try:
        assert worker.wait_ready(15)
        task_id = server.enqueue("render", {})
        snap = server.wait_for(task_id, {TaskState.SUCCEEDED, TaskState.FAILED}, timeout=30)
        assert snap.state is TaskState.SUCCEEDED, snap
        assert snap.result["pid"] != os.getpid()
        assert snap.result["token_in_env"] is False
    finally:
        worker.stop()


def test_a_name_bound_to_another_object_fails_at_start(
    server: MockOrbitServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name is looked up at start: a module that rebinds it fails there, naming the handler,
    before anything is sent."""
    _env(server, monkeypatch)
    app = _import(tmp_path, "rebound_app", REBOUND, monkeypatch)
    with pytest.raises(TypeError, match=r"rebound_app\.render cannot run in a process"):
        app.worker.start()
    assert not [e for e in server.events() if e.kind.startswith("session.")]


def test_nested_and_lambda_handlers_still_raise_at_registration(server: MockOrbitServer) -> None:
    """What can never be imported by name is refused by the decorator itself."""
    worker = Worker(Client(server.url, server.token), queue_id=server.queue_id)

    with pytest.raises(TypeError, match="module-level function"):

        @worker.handler("nested", executor="process")
        def nested(ctx: Any, payload: Any) -> Any:
            return {}

    with pytest.raises(TypeError, match="module-level function"):
        worker.register("lam", lambda ctx, payload: {}, executor="process")


def test_decorator_form_under_the_cli(server: MockOrbitServer, tmp_path: Path) -> None:
    """``orbit-sync worker decorated_cli:worker`` runs the decorated handler in a child and
    stops cleanly on SIGTERM."""
    (tmp_path / "decorated_cli.py").write_text(APP)
    env = clean_env(ORBIT_URL=server.url, ORBIT_TOKEN=server.token, ORBIT_QUEUE_ID=server.queue_id)
    proc = Proc(command("worker", "decorated_cli:worker"), env=env, cwd=tmp_path)
    try:
        proc.wait_stderr("handlers:")
        task_id = server.enqueue("render", {})
        snap = server.wait_for(task_id, {TaskState.SUCCEEDED, TaskState.FAILED}, timeout=30)
        assert snap.state is TaskState.SUCCEEDED, (snap, proc.stderr)
        assert snap.result["pid"] != proc.popen.pid
        assert snap.result["token_in_env"] is False
        assert proc.stop(signal.SIGTERM) == 0, proc.stderr
    finally:
        proc.kill()
    assert "Traceback" not in proc.stderr
