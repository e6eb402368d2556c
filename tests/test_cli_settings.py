"""``orbit-sync worker``: a bad ``--url`` or ``ORBIT_*`` setting is one line on stderr and exit 2,
before the user's module is imported (subprocesses of the real console script)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _cli_process import clean_env, run_cli

#: A module that leaves a trace when imported, and builds its client from the environment.
APP = """
from pathlib import Path
Path(__file__).with_name("imported").write_text("")

import os
from orbit_sync import Client, Worker

worker = Worker(Client.from_env(), queue_id="0" * 32)

@worker.handler("echo")
def echo(ctx, payload):
    return payload
"""


def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "settings_app.py").write_text(APP)
    return run_cli("worker", *args, env=clean_env(**env), cwd=tmp_path, timeout=60)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--url", "http://127.0.0.1:8765"], {}, "--url must start with ws:// or wss://"),
        (["--url", "ws://"], {}, "--url needs a host"),
        ([], {"ORBIT_URL": "https://orbit.example"}, "ORBIT_URL must start with ws:// or wss://"),
        (
            [],
            {"ORBIT_URI": "ws://127.0.0.1:8765", "ORBIT_TOKEN": "t0ken"},
            "ORBIT_URL is not set (ORBIT_URI is set: a misspelling?)",
        ),
        (
            [],
            {"ORBIT_URL": "ws://h", "ORBIT_TOKEN": "t0ken", "ORBIT_TOKEN_FILE": "/dev/null"},
            "set only one of ORBIT_TOKEN and ORBIT_TOKEN_FILE",
        ),
        (
            [],
            {"ORBIT_URL": "ws://h", "ORBIT_TOKEN": "t0ken", "ORBIT_QUEUE_ID": "q1"},
            "ORBIT_QUEUE_ID must be 32 lowercase hex characters",
        ),
        (
            [],
            {"ORBIT_URL": "ws://h", "ORBIT_TOKEN": "t0ken", "ORBIT_QUEUEID": "0" * 32},
            "ORBIT_QUEUE_ID is not set (ORBIT_QUEUEID is set: a misspelling?)",
        ),
    ],
)
def test_bad_settings_fail_before_the_module_is_imported(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    """One stderr line naming the setting, exit 2, and the module never imported."""
    proc = _run(tmp_path, *args, "settings_app:worker", **env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"orbit-sync: error: {message}"]
    assert not (tmp_path / "imported").exists()
    assert "t0ken" not in proc.stderr


def test_a_setting_the_module_needs_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """ORBIT_URL unset with no look-alike: the module's Client.from_env() fails at import, and
    that is reported as a setting, not a traceback."""
    proc = _run(tmp_path, "settings_app:worker", ORBIT_TOKEN="t0ken")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "orbit-sync: cannot load settings_app:worker: ORBIT_URL is not set"
    ]


def test_a_target_without_colon_prints_the_subcommand_usage(tmp_path: Path) -> None:
    """``worker myapp.tasks.make_worker`` shows the worker's usage and the colon form."""
    proc = _run(tmp_path, "myapp.tasks.make_worker")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: orbit-sync worker ")
    assert "e.g. myapp.tasks:make_worker" in proc.stderr


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "worker = Worker(Client.from_env())",
            "no queue_id given and ORBIT_QUEUE_ID is not set",
        ),
        (
            'worker = Worker(Client.from_env(), queue_id=os.environ["ORBIT_QUEUE_ID"])',
            "ORBIT_QUEUE_ID is not set (the module reads os.environ['ORBIT_QUEUE_ID'])",
        ),
    ],
)
def test_a_missing_queue_is_one_line_and_exit_2(tmp_path: Path, source: str, message: str) -> None:
    """A module whose Worker takes its queue from the environment (the Worker's own fallback, or
    os.environ[...] in the module) with ORBIT_QUEUE_ID unset: one line, exit 2, like a missing
    token, not a traceback."""
    app = APP.replace('worker = Worker(Client.from_env(), queue_id="0" * 32)', source)
    assert app != APP
    (tmp_path / "queue_app.py").write_text(app)
    env = clean_env(ORBIT_URL="ws://127.0.0.1:9", ORBIT_TOKEN="t0ken")
    proc = run_cli("worker", "queue_app:worker", env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"orbit-sync: cannot load queue_app:worker: {message}"]
