"""``orbit_sync.contrib.django`` in-process: handlers found in installed apps, the ORM used from
pool threads, and each task's database connection closed as Django closes a request's."""

from __future__ import annotations

import datetime
import inspect
import sqlite3
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

django = pytest.importorskip("django")  # the test extra installs it; skipped only where absent

from django.core.exceptions import ImproperlyConfigured  # noqa: E402

from orbit_sync.testing import MockOrbitServer  # noqa: E402

PROJECT = Path(__file__).resolve().parent.parent / "examples" / "django_project"


@pytest.fixture(scope="module")
def django_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Django configured with the example's billing app on a fresh SQLite file, migrated."""
    from django.conf import settings

    if settings.configured:
        pytest.skip("Django was configured by something else in this process")
    sys.path.insert(0, str(PROJECT))
    db = tmp_path_factory.mktemp("django") / "db.sqlite3"
    settings.configure(
        DATABASES={
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(db), "CONN_MAX_AGE": 0}
        },
        INSTALLED_APPS=["orbit_sync.contrib.django", "billing"],
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        ORBIT_SYNC={"CAPACITY": 1, "DRAIN_TIMEOUT": 5},
    )
    from django.core.management import call_command

    from orbit_sync.contrib.django import setup_django

    setup_django()
    call_command("migrate", verbosity=0)
    yield
    sys.path.remove(str(PROJECT))


class Opened:
    """Every database connection opened by a worker thread (the raw sqlite3 connections: Django
    reuses one wrapper object per thread and opens new connections in it)."""

    def __init__(self) -> None:
        self.raw: list[sqlite3.Connection] = []
        self.wrappers: list[Any] = []

    def __call__(self, sender: object, connection: Any, **kwargs: object) -> None:
        if threading.current_thread().name.startswith("orbit-handler"):
            self.raw.append(connection.connection)
            self.wrappers.append(connection)


def is_closed(raw: sqlite3.Connection) -> bool:
    """True once *raw* has been closed (Django opens SQLite with check_same_thread=False)."""
    try:
        raw.total_changes  # noqa: B018 (any use of a closed connection raises)
    except sqlite3.ProgrammingError:
        return True
    return False


@pytest.fixture
def opened(django_project: None) -> Iterator[Opened]:
    """Records connections opened while the test runs."""
    from django.db.backends.signals import connection_created

    recorder = Opened()
    connection_created.connect(recorder)
    yield recorder
    connection_created.disconnect(recorder)


def build(server: MockOrbitServer, **kw: Any) -> Any:
    """The project's Worker for *server* (handlers discovered from the installed apps)."""
    from orbit_sync.contrib.django import build_worker, discover_handlers

    assert "billing.orbit_tasks" in discover_handlers()
    return build_worker(url=server.url, token=server.token, queue_id=server.queue_id, **kw)


@pytest.mark.orbit_server(assignment_rate=None)
def test_handlers_write_with_the_orm_and_close_each_tasks_connection(
    orbit_server: MockOrbitServer, opened: Opened
) -> None:
    """Two tasks write rows through the ORM on a pool thread; each task's connection is closed
    when it ends (CONN_MAX_AGE = 0), so the second task opens a new one."""
    from billing.models import Invoice

    worker = build(orbit_server)
    with worker:
        ids = [
            orbit_server.enqueue("invoice.charge", {"number": f"INV-{n}", "amount": "12.50"})
            for n in (1, 2)
        ]
        snaps = [orbit_server.wait_for(i, {"SUCCEEDED", "FAILED"}, timeout=10) for i in ids]
    assert [s.state.value for s in snaps] == ["SUCCEEDED", "SUCCEEDED"], snaps
    assert snaps[0].result["number"] == "INV-1" and snaps[0].result["amount"] == "12.50"
    charged_at = datetime.datetime.fromisoformat(
        snaps[0].result["charged_at"].replace("Z", "+00:00")
    )
    assert charged_at.utcoffset() == datetime.timedelta(0)
    assert sorted(Invoice.objects.filter(paid=True).values_list("number", flat=True)) == [
        "INV-1",
        "INV-2",
    ]
    assert len(opened.raw) == 2  # one per task: the first was closed, not reused
    assert all(is_closed(raw) for raw in opened.raw)


@pytest.mark.orbit_server(assignment_rate=None)
def test_a_persistent_connection_is_kept_until_it_expires(
    orbit_server: MockOrbitServer, opened: Opened, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CONN_MAX_AGE > 0 the handler thread reuses its connection (capacity 1: one handler
    thread runs every task); once it is past its age it is closed before the next task instead
    of being used."""
    from django.db import connections

    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 600)
    worker = build(orbit_server, capacity=1)
    with worker:
        first = orbit_server.enqueue("invoice.charge", {"number": "P-1", "amount": "1"})
        orbit_server.wait_for(first, {"SUCCEEDED"}, timeout=10)
        second = orbit_server.enqueue("invoice.charge", {"number": "P-2", "amount": "2"})
        orbit_server.wait_for(second, {"SUCCEEDED"}, timeout=10)
        assert len(opened.raw) == 1 and not is_closed(opened.raw[0])  # reused, kept open
        # As if CONN_MAX_AGE had passed while the thread waited for work.
        opened.wrappers[0].close_at = 0.0
        third = orbit_server.enqueue("invoice.charge", {"number": "P-3", "amount": "3"})
        assert orbit_server.wait_for(third, {"SUCCEEDED", "FAILED"}, timeout=10).result
    assert len(opened.raw) == 2  # the expired one was closed before the third task and replaced
    assert is_closed(opened.raw[0]) and not is_closed(opened.raw[1])


def test_settings_are_checked(django_project: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in ORBIT_SYNC and a missing server are ImproperlyConfigured, naming the setting."""
    from django.conf import settings

    from orbit_sync.contrib.django import build_worker

    for name in ("ORBIT_URL", "ORBIT_TOKEN", "ORBIT_TOKEN_FILE", "ORBIT_QUEUE_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ImproperlyConfigured, match="ORBIT_URL"):
        build_worker()
    monkeypatch.setattr(settings, "ORBIT_SYNC", {"CAPACTY": 2})
    with pytest.raises(ImproperlyConfigured, match=r"unknown ORBIT_SYNC setting.*CAPACTY"):
        build_worker()


def test_manage_py_reports_a_misspelled_setting_as_a_command_error(
    django_project: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``manage.py orbit_worker`` with a typo in ORBIT_SYNC: a CommandError with exit status 2,
    as for a missing URL, not an ImproperlyConfigured traceback."""
    from django.conf import settings
    from django.core.management import CommandError, call_command

    monkeypatch.setattr(settings, "ORBIT_SYNC", {"CAPACTY": 2})
    with pytest.raises(CommandError, match=r"unknown ORBIT_SYNC setting.*CAPACTY") as info:
        call_command("orbit_worker")
    assert info.value.returncode == 2


def test_handler_declarations_are_checked() -> None:
    """@handler without parentheses, a bad name, and a second function under one name raise."""
    from orbit_sync.contrib.django import HandlerRegistry

    reg = HandlerRegistry()
    with pytest.raises(TypeError, match="parentheses"):
        reg.handler(lambda ctx, payload: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        reg.handler("not a name!")

    @reg.handler("a")
    def first(ctx: Any, payload: Any) -> None: ...

    with pytest.raises(ValueError, match="already registered"):

        @reg.handler("a")
        def second(ctx: Any, payload: Any) -> None: ...

    reg.handler("a")(first)  # the same function again (a module imported twice) is fine
    assert reg.keys() == [("a", "1", "1")]


def test_time_limit_comes_from_the_argument_then_settings_then_the_handler(
    django_project: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ORBIT_SYNC['TIME_LIMIT'] (or manage.py orbit_worker --time-limit, passed to build_worker)
    is the worker's default; a handler declared with its own time_limit keeps it (what the
    worker makes of both: test_worker_time_limits)."""
    import importlib

    from django.conf import settings

    from orbit_sync.contrib.django import handler, registry
    from orbit_sync.worker import Worker

    unset = inspect.signature(Worker.register).parameters["time_limit"].default
    registered: dict[str, tuple[Any, bool]] = {}
    register = Worker.register

    def recording(worker: Worker, name: str, fn: Any, **kwargs: Any) -> None:
        registered[name] = (kwargs["time_limit"], kwargs["time_limit_retryable"])
        register(worker, name, fn, **kwargs)

    monkeypatch.setattr(Worker, "register", recording)
    with MockOrbitServer() as server:
        monkeypatch.setattr(settings, "ORBIT_SYNC", {"TIME_LIMIT": 7})
        assert build(server).options.time_limit == 7.0
        assert registered["invoice.charge"] == (unset, False)  # the worker's default applies
        assert build(server, time_limit=3).options.time_limit == 3.0

        @handler("report.build", time_limit=None)
        def report(ctx: Any, payload: Any) -> Any:
            return {}

        @handler("report.send", time_limit=2, time_limit_retryable=True)
        def send(ctx: Any, payload: Any) -> Any:
            return {}

        try:
            assert build(server).options.time_limit == 7.0
            assert registered["report.build"] == (None, False)
            assert registered["report.send"] == (2, True)
        finally:  # the project's own declarations only, as the app declares them
            registry.clear()
            importlib.reload(importlib.import_module("billing.orbit_tasks"))


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ('@handler("bad.limit", time_limit=0)', "handler 'bad.limit': time_limit must be > 0"),
        (
            '@handler("bad.limit", time_limit="5")',
            "handler 'bad.limit': time_limit must be a number of seconds",
        ),
    ],
)
def test_manage_py_reports_a_bad_handler_time_limit_as_a_command_error(
    django_project: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    declaration: str,
    message: str,
) -> None:
    """A handler declared with time_limit=0 or "5": ``manage.py orbit_worker`` stops with a
    CommandError naming the handler (exit status 2), not a traceback."""
    import importlib

    from django.conf import settings
    from django.core.management import CommandError, call_command

    from orbit_sync.contrib.django import registry

    module = f"bad_limits_{len(message)}"
    (tmp_path / f"{module}.py").write_text(
        "from orbit_sync.contrib.django import handler\n\n"
        f"{declaration}\ndef bad(ctx, payload):\n    return {{}}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(settings, "ORBIT_SYNC", {"TASK_MODULES": [module]})
    monkeypatch.setenv("ORBIT_URL", "ws://127.0.0.1:9")
    monkeypatch.setenv("ORBIT_TOKEN", "t0ken-for-a-server-never-dialled")
    monkeypatch.setenv("ORBIT_QUEUE_ID", "0" * 32)
    try:
        with pytest.raises(CommandError) as info:
            call_command("orbit_worker")
        assert str(info.value) == message
        assert info.value.returncode == 2
    finally:  # the project's own declarations only, as the app declares them
        registry.clear()
        importlib.reload(importlib.import_module("billing.orbit_tasks"))
