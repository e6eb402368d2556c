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


def test_banner_names_process_handlers_outbox_and_listeners(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The startup banner lists each handler's executor, the outbox path and the listeners."""
    from _process_handlers import pid

    from orbit_sync._cli_banner import banner
    from orbit_sync.contrib.health import HealthProbe

    outbox = tmp_path / "outbox.db"
    worker = Worker(
        Client("ws://127.0.0.1:1", "token-0123456789"),
        queue_id="0" * 32,
        outbox=outbox,
        listeners=[HealthProbe()],
    )
    worker.register("pid", pid, executor="process")
    worker.register("echo", lambda ctx, payload: payload)
    banner(worker, "app:worker")
    err = capsys.readouterr().err
    assert "handlers:  pid (1/1, process), echo (1/1)" in err
    assert f"outbox:    {outbox}" in err
    assert "listeners: health probe" in err
    assert "token-0123456789" not in err


def test_decorator_form_under_the_cli(server: MockOrbitServer, tmp_path: Path) -> None:
    """``orbit-sync worker decorated_cli:worker`` runs the decorated handler in a child and
    stops cleanly on SIGTERM."""
    (tmp_path / "decorated_cli.py").write_text(APP)
    env = clean_env(ORBIT_URL=server.url, ORBIT_TOKEN=server.token, ORBIT_QUEUE_ID=server.queue_id)
    proc = Proc(command("worker", "decorated_cli:worker"), env=env, cwd=tmp_path)
    try:
        # The banner says which handlers run in a process, and that there is no outbox or
        # listener.
        assert "handlers:  render (1/1, process)" in proc.wait_stderr("handlers:")
        assert "outbox:    none" in proc.wait_stderr("outbox:")
        assert "listeners: none" in proc.wait_stderr("listeners:")
        task_id = server.enqueue("render", {})
        snap = server.wait_for(task_id, {TaskState.SUCCEEDED, TaskState.FAILED}, timeout=30)
        assert snap.state is TaskState.SUCCEEDED, (snap, proc.stderr)
        assert snap.result["pid"] != proc.popen.pid
        assert snap.result["token_in_env"] is False
        assert proc.stop(signal.SIGTERM) == 0, proc.stderr
    finally:
        proc.kill()
    assert "Traceback" not in proc.stderr
