"""``examples/django_project`` run as a user would: ``manage.py migrate``, then ``manage.py
orbit_worker`` (or ``orbit-sync worker orbit_sync.contrib.django:make_worker``) as a subprocess
against the mock server, stopped with SIGTERM; the rows are read back from the SQLite file."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_process import Proc, clean_env, command

pytest.importorskip("django")  # the test extra installs it; skipped only where absent

from orbit_sync.testing import MockOrbitServer

PROJECT = Path(__file__).resolve().parent.parent / "examples" / "django_project"


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example project's SQLite database after ``manage.py migrate`` (run once a module)."""
    db = tmp_path_factory.mktemp("django") / "db.sqlite3"
    done = run_in_project(
        [sys.executable, "manage.py", "migrate", "--verbosity", "0"], project_env(None, db)
    )
    assert done.returncode == 0, done.stderr
    return db


@pytest.fixture
def database(migrated: Path, tmp_path: Path) -> Path:
    """A migrated SQLite database of this test's own: a copy of :func:`migrated`'s (closed by
    the migrate process, so the file alone is the whole database)."""
    db = tmp_path / "db.sqlite3"
    shutil.copyfile(migrated, db)
    return db


def run_in_project(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run *argv* to completion in the example project's directory."""
    return subprocess.run(argv, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60)


def project_env(server: MockOrbitServer | None, db: Path, **extra: str) -> dict[str, str]:
    """The example's environment: its database and, with *server*, the ORBIT_* variables."""
    orbit = {}
    if server is not None:
        orbit = {
            "ORBIT_URL": server.url,
            "ORBIT_TOKEN": server.token,
            "ORBIT_QUEUE_ID": server.queue_id,
        }
    return clean_env(EXAMPLE_DB=str(db), PYTHONDONTWRITEBYTECODE="1", **orbit, **extra)


def paid(db: Path) -> list[tuple[str, int]]:
    """The invoices in *db*, as (number, paid)."""
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT number, paid FROM billing_invoice ORDER BY number").fetchall()


@pytest.mark.orbit_server(assignment_rate=None)
def test_manage_py_orbit_worker_runs_the_apps_handlers(
    orbit_server: MockOrbitServer, database: Path, procs: list[Proc]
) -> None:
    """The command finds billing/orbit_tasks.py, writes rows through the ORM, returns encoded
    Decimal/datetime results, and drains to exit 0 on SIGTERM."""
    argv = [sys.executable, "manage.py", "orbit_worker", "--capacity", "2"]
    proc = Proc(argv, env=project_env(orbit_server, database), cwd=PROJECT)
    procs.append(proc)
    ids = [
        orbit_server.enqueue("invoice.charge", {"number": f"E-{n}", "amount": "9.90"})
        for n in (1, 2)
    ]
    snaps = [orbit_server.wait_for(i, {"SUCCEEDED", "FAILED"}, timeout=20) for i in ids]
    assert [s.state.value for s in snaps] == ["SUCCEEDED", "SUCCEEDED"], proc.stderr
    assert snaps[1].result["number"] == "E-2" and snaps[1].result["amount"] == "9.90"
    assert proc.stop(signal.SIGTERM) == 0, proc.stderr
    assert "worker manage.py orbit_worker" in proc.stderr
    assert "capacity:  2, drain timeout 30 s" in proc.stderr
    assert "invoice.charge (1/1)" in proc.stderr
    assert orbit_server.token not in proc.stderr + proc.stdout
    assert paid(database) == [("E-1", 1), ("E-2", 1)]


@pytest.mark.orbit_server(assignment_rate=None)
def test_orbit_sync_worker_sets_django_up_itself(
    orbit_server: MockOrbitServer, database: Path, procs: list[Proc]
) -> None:
    """Outside manage.py, the make_worker factory calls django.setup() from
    DJANGO_SETTINGS_MODULE; the command line's options still apply."""
    argv = command("worker", "orbit_sync.contrib.django:make_worker", "--capacity", "1")
    env = project_env(orbit_server, database, DJANGO_SETTINGS_MODULE="mysite.settings")
    proc = Proc(argv, env=env, cwd=PROJECT)
    procs.append(proc)
    task_id = orbit_server.enqueue("invoice.charge", {"number": "S-1", "amount": "1.00"})
    assert orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED"}, timeout=20).result
    assert proc.stop(signal.SIGTERM) == 0, proc.stderr
    assert "capacity:  1," in proc.stderr
    assert paid(database) == [("S-1", 1)]


def test_configuration_errors_are_one_message(database: Path) -> None:
    """No server configured: manage.py orbit_worker exits 2 with the setting to set; outside
    manage.py without DJANGO_SETTINGS_MODULE the factory says what to set."""
    done = run_in_project(
        [sys.executable, "manage.py", "orbit_worker"], project_env(None, database)
    )
    assert done.returncode == 2
    assert "no Orbit server: set ORBIT_SYNC['URL'] or $ORBIT_URL" in done.stderr
    assert "Traceback" not in done.stderr
    argv = command("worker", "orbit_sync.contrib.django:make_worker")
    done = run_in_project(argv, project_env(None, database))
    assert done.returncode == 1
    assert "set DJANGO_SETTINGS_MODULE" in done.stderr


@pytest.mark.orbit_server(assignment_rate=None)
def test_manage_py_orbit_worker_runs_several_processes(
    orbit_server: MockOrbitServer, database: Path, procs: list[Proc]
) -> None:
    """--processes 2: manage.py is run again for each child (its own Django setup and database
    connection, its own session); SIGTERM drains both and the supervisor exits 0."""
    argv = [sys.executable, "manage.py", "orbit_worker", "--processes", "2", "--capacity", "1"]
    proc = Proc(argv, env=project_env(orbit_server, database), cwd=PROJECT)
    procs.append(proc)
    orbit_server.wait_until(lambda s: sum(x.connected for x in s.sessions()) == 2, 30)
    ids = [
        orbit_server.enqueue("invoice.charge", {"number": f"P-{n}", "amount": "1.00"})
        for n in range(4)
    ]
    snaps = [orbit_server.wait_for(i, {"SUCCEEDED", "FAILED"}, timeout=20) for i in ids]
    assert {s.state.value for s in snaps} == {"SUCCEEDED"}, proc.stderr
    assert len({s.capacity for s in orbit_server.sessions()}) == 1
    assert proc.stop(signal.SIGTERM, timeout=30) == 0, proc.stderr
    assert "running 2 worker processes of manage.py orbit_worker" in proc.stderr
    assert proc.stderr.count("worker manage.py orbit_worker (pid") == 2
    assert "capacity:  1, drain timeout 30 s" in proc.stderr
    assert paid(database) == [(f"P-{n}", 1) for n in range(4)]


def test_readme_enqueue_reaches_the_example_handler(database: Path, procs: list[Proc]) -> None:
    """The example README's Python block, run as a script with the mock server's admin
    variables, enqueues its sample payload through the admin API, and the example's worker
    charges that invoice (the README's links to the docs resolve in a checkout)."""
    from orbit_sync.testing import AdminAPI

    readme = (PROJECT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)", readme):
        assert (PROJECT / target).resolve().exists(), target
    (block,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    api = AdminAPI("admin-token-for-the-readme-0123")
    with MockOrbitServer(admin_handler=api, assignment_rate=None) as server:
        argv = [sys.executable, "manage.py", "orbit_worker"]
        proc = Proc(argv, env=project_env(server, database), cwd=PROJECT)
        procs.append(proc)
        env = clean_env(ORBIT_ADMIN_URL=f"{server.url.replace('ws:', 'http:')}/admin/v1")
        env["ORBIT_ADMIN_TOKEN"] = api.token
        done = subprocess.run(
            [sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr + proc.stderr
        assert "'number': 'INV-1'" in done.stdout and "'amount': '19.90'" in done.stdout
        assert proc.stop(signal.SIGTERM) == 0, proc.stderr
    assert paid(database) == [("INV-1", 1)]


def test_manage_py_names_a_refused_token_and_honours_first_connect_timeout(
    orbit_server: MockOrbitServer, database: Path, tmp_path: Path
) -> None:
    """manage.py orbit_worker: a refused --token-file is named by its path with what 401 means
    (exit 4, the token never shown); --first-connect-timeout against a closed port exits 6."""
    token = "not-a-valid-token-0123456789"
    token_file = tmp_path / "token"
    token_file.write_text(token)
    argv = [sys.executable, "manage.py", "orbit_worker", "--token-file", str(token_file)]
    done = run_in_project(argv, project_env(orbit_server, database))
    assert done.returncode == 4, done.stderr
    assert f"the server does not accept the token from --token-file {token_file} (401" in (
        done.stderr
    )
    assert token not in done.stderr + done.stdout
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"ws://127.0.0.1:{closed.getsockname()[1]}"
    argv = [sys.executable, "manage.py", "orbit_worker", "--first-connect-timeout", "0.5"]
    env = {**project_env(orbit_server, database), "ORBIT_URL": url}
    done = run_in_project(argv, env)
    assert done.returncode == 6, done.stderr
    assert f"ServerUnreachable: {url} was not reached within 0.5 s" in done.stderr
