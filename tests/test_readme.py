"""Every Python block of README.md runs, the way its marker says.

A block is preceded by ``<!-- readme-test: MODE -->`` on the line before its opening fence:

* ``run``: executed as it stands;
* ``mock-server``: executed with ``ORBIT_URL``, ``TOKEN`` and ``QUEUE_ID`` naming a mock server that
  holds one ``resize`` task, which must end ``SUCCEEDED``;
* ``worker-process``: run as a script in its own process with ``ORBIT_URL``, ``ORBIT_TOKEN`` and
  ``ORBIT_QUEUE_ID`` in its environment; a ``resize`` task must succeed, then SIGTERM must stop it
  cleanly;
* ``pytest``: written to a test file and run by pytest with orbit-sync's plugin.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orbit_sync.testing import MockOrbitServer

pytest_plugins = ["pytester"]

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(
    r"^(?:<!-- readme-test: (?P<mode>[a-z-]+) -->\n)?```python\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
MODES = ("run", "mock-server", "worker-process", "pytest")


def _blocks() -> list[Any]:
    text = README.read_text(encoding="utf-8")
    params = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code"))
        mode = match.group("mode") or "unmarked"
        params.append(pytest.param(mode, match.group("code"), line, id=f"line{line}-{mode}"))
    return params


BLOCKS = _blocks()


def test_readme_has_python_blocks_of_every_mode() -> None:
    """The extraction finds the README's blocks (a broken pattern would silently test nothing)."""
    assert {p.values[0] for p in BLOCKS} >= set(MODES)


@pytest.mark.parametrize(("mode", "code", "line"), BLOCKS)
def test_readme_block(mode: str, code: str, line: int, pytester: pytest.Pytester) -> None:
    """One README Python block runs as its marker says and does what it shows."""
    assert mode in MODES, (
        f"README.md line {line}: mark this Python block with one of "
        f"<!-- readme-test: {' | '.join(MODES)} --> on the line before its fence"
    )
    compiled = compile(code, f"README.md:{line}", "exec")
    if mode == "run":
        exec(compiled, {"__name__": "readme_block"})
    elif mode == "mock-server":
        _run_against_mock_server(compiled)
    elif mode == "worker-process":
        _run_worker_process(code, pytester.path)
    else:
        pytester.makepyfile(test_readme_example=code)
        result = pytester.runpytest_inprocess("-q", "-p", "no:randomly")
        result.assert_outcomes(passed=code.count("\ndef test_"))


def _run_against_mock_server(compiled: Any) -> None:
    with MockOrbitServer(assignment_rate=None) as server:
        task_id = server.enqueue("resize", {"w": 640})
        env = {"ORBIT_URL": server.url, "TOKEN": server.token, "QUEUE_ID": server.queue_id}
        exec(compiled, {"__name__": "readme_block", **env})
        snap = server.wait_for(task_id, {"SUCCEEDED", "FAILED", "NEEDS_REVIEW"}, timeout=10)
        assert snap.state.value == "SUCCEEDED", snap
        server.check_invariants()


def _run_worker_process(code: str, folder: Path) -> None:
    script = folder / "readme_worker.py"
    script.write_text(code, encoding="utf-8")
    with MockOrbitServer(assignment_rate=None) as server:
        env = dict(
            os.environ,
            ORBIT_URL=server.url,
            ORBIT_TOKEN=server.token,
            ORBIT_QUEUE_ID=server.queue_id,
        )
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            task_id = server.enqueue("resize", {"w": 3})
            snap = server.wait_for(task_id, {"SUCCEEDED", "FAILED", "NEEDS_REVIEW"}, timeout=20)
            assert snap.state.value == "SUCCEEDED" and snap.result == {"resized": 3}, snap
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err[-3000:]
        assert server.token not in out + err
