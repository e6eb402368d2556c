"""``orbit-sync worker``: a mistake inside the worker module, or a failure of its own import, is
one line on stderr naming it (subprocesses of the real console script; nothing is dialled)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _cli_process import clean_env, run_cli

HEAD = """\
from orbit_sync import Client, Worker

worker = Worker(Client.from_env(), queue_id="0" * 32)
"""

ENV = {"ORBIT_URL": "ws://127.0.0.1:9", "ORBIT_TOKEN": "t0ken-never-sent"}


def _run(
    tmp_path: Path, source: str, target: str = "bad_app:worker", *options: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "bad_app.py").write_text(source)
    return run_cli(*options, "worker", target, env=clean_env(**ENV), cwd=tmp_path, timeout=60)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '@worker.handler("x", time_limit=0)\ndef x(ctx, payload):\n    return 1\n',
            "handler 'x': time_limit must be > 0",
        ),
        (
            '@worker.handler("x", time_limit=-1)\ndef x(ctx, payload):\n    return 1\n',
            "handler 'x': time_limit must be > 0",
        ),
        (
            '@worker.handler("x", time_limit="5")\ndef x(ctx, payload):\n    return 1\n',
            "handler 'x': time_limit must be a number of seconds",
        ),
        (
            'worker.register("x", lambda ctx, p: 1)\nworker.register("x", lambda ctx, p: 2)\n',
            "handler 'x' version 1/1 is already registered",
        ),
    ],
    ids=["time-limit-0", "time-limit-negative", "time-limit-string", "registered-twice"],
)
def test_a_refused_registration_at_import_is_one_line_and_exit_2(
    tmp_path: Path, body: str, message: str
) -> None:
    """A handler registered with a bad time_limit, or twice, as the module is imported: one line
    naming the handler and exit 2 (configuration), like --time-limit 0 on the command line."""
    proc = _run(tmp_path, HEAD + body)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"orbit-sync: cannot load bad_app:worker: {message}"]


def test_a_refused_value_in_a_factory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """The same mistake made by a factory (``module:make``) as it builds the Worker."""
    source = (
        "from orbit_sync import Client, Worker\n\n"
        "def make():\n"
        '    w = Worker(Client.from_env(), queue_id="0" * 32)\n'
        '    w.register("x", lambda ctx, p: 1, time_limit=0)\n'
        "    return w\n"
    )
    proc = _run(tmp_path, source, "bad_app:make")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "orbit-sync: cannot load bad_app:make: handler 'x': time_limit must be > 0"
    ]


@pytest.mark.parametrize(
    ("source", "error", "where"),
    [
        (
            "import os\nimport nonexistent_dependency\n",
            "ModuleNotFoundError: No module named 'nonexistent_dependency'",
            "(bad_app.py, line 2)",
        ),
        (
            "import os\n\ndef setup():\n    raise RuntimeError('no database')\n\nsetup()\n",
            "RuntimeError: no database",
            "(bad_app.py, line 4, in setup)",
        ),
    ],
    ids=["import-error", "runtime-error"],
)
def test_a_failing_import_is_one_line_naming_the_file_and_line(
    tmp_path: Path, source: str, error: str, where: str
) -> None:
    """The module's own import fails (a missing dependency, an exception): one line with the
    error and the module's file and line, exit 1; the traceback only at --log-level DEBUG."""
    proc = _run(tmp_path, source)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"orbit-sync: cannot load bad_app:worker: {error} {where}; --log-level DEBUG shows"
        " the traceback"
    ]
    debug = _run(tmp_path, source, "bad_app:worker", "--log-level=DEBUG")
    assert debug.returncode == 1, debug.stderr
    lines = debug.stderr.splitlines()
    assert lines[0] == f"orbit-sync: cannot load bad_app:worker: {error} {where}"
    assert "Traceback (most recent call last):" in debug.stderr
    line = where.split("line ")[1].rstrip(")").split(",")[0]
    assert f'bad_app.py", line {line}' in debug.stderr


def test_a_helper_module_that_fails_is_named_rather_than_the_line_importing_it(
    tmp_path: Path,
) -> None:
    """The innermost frame in the application's own files is named: the helper that raised."""
    (tmp_path / "helpers.py").write_text("x = 1\nraise KeyError('DATABASE_URL')\n")
    proc = _run(tmp_path, "import helpers\n")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        "orbit-sync: cannot load bad_app:worker: KeyError: 'DATABASE_URL' (helpers.py, line 2);"
        " --log-level DEBUG shows the traceback"
    ]
