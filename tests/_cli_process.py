"""Run the ``orbit-sync`` command in a subprocess; read its output line by line, with timeouts."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

#: The installed console script (``pip install -e .`` puts it beside the interpreter).
SCRIPT = Path(sys.executable).with_name("orbit-sync")


#: Python source that makes every later ``import websockets`` fail, as if it were not installed
#: (prepend it to a ``python -c`` program).
REFUSE_WEBSOCKETS = """
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "websockets" or name.startswith("websockets."):
            raise ImportError("websockets is not installed")
        return None

sys.meta_path.insert(0, Refuse())
"""


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes started by a test; killed at teardown if the test did not stop them (import
    this fixture into the test module)."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


def command(*args: str) -> list[str]:
    """The console script with *args* (or the same entry point through the interpreter)."""
    if SCRIPT.exists():
        return [str(SCRIPT), *args]
    return [
        sys.executable,
        "-c",
        "from orbit_sync.cli import main; raise SystemExit(main())",
        *args,
    ]


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without ORBIT_* variables, plus *extra*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORBIT_")}
    env.update(extra)
    return env


def run_cli(
    *args: str, env: dict[str, str], cwd: Path, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run ``orbit-sync`` with *args* to completion, its output captured as text."""
    return subprocess.run(
        command(*args), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


class Proc:
    """A child process whose stdout and stderr are drained by threads into line queues."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stdin: bool = False,
    ) -> None:
        # faulthandler: a process that hangs is sent SIGABRT by wait(), which then prints every
        # thread's stack (file, line and function only: no values) to its stderr.
        env = {**(clean_env() if env is None else env), "PYTHONFAULTHANDLER": "1"}
        self.popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.out: queue.Queue[str | None] = queue.Queue()
        self.err_lines: list[str] = []
        self.out_lines: list[str] = []
        self._err_cond = threading.Condition()
        self._err_done = False
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self._threads = [
            threading.Thread(target=self._drain_out, daemon=True),
            threading.Thread(target=self._drain_err, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _drain_out(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.out_lines.append(line)
            self.out.put(line.rstrip("\n"))
        self.out.put(None)

    def _drain_err(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            with self._err_cond:
                self.err_lines.append(line)
                self._err_cond.notify_all()
        with self._err_cond:
            self._err_done = True
            self._err_cond.notify_all()

    def wait_stderr(self, text: str, timeout: float = 15.0) -> str:
        """Wait until a stderr line contains *text*; return that line."""

        def found() -> str | None:
            return next((line for line in self.err_lines if text in line), None)

        with self._err_cond:
            ok = self._err_cond.wait_for(lambda: found() is not None or self._err_done, timeout)
            line = found()
        if not ok or line is None:
            raise AssertionError(f"no stderr line with {text!r}; stderr: {self.stderr}")
        return line

    def send(self, text: str) -> None:
        """Write *text* to the process's standard input (``stdin=True``)."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(text)
        self.popen.stdin.flush()

    def line(self, timeout: float = 15.0) -> str:
        """The next stdout line; AssertionError on timeout or end of output."""
        try:
            line = self.out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output within {timeout} s; stderr: {self.stderr}") from None
        if line is None:
            raise AssertionError(f"the process ended; stderr: {self.stderr}")
        return line

    def banner(self) -> dict[str, str]:
        """Read the mock server's banner up to ``# ready``; return its ``export KEY=value``
        pairs (values unquoted as the shell would)."""
        values: dict[str, str] = {}
        while True:
            line = self.line()
            if line == "# ready":
                return values
            if not line.startswith("#"):
                assert line.startswith("export "), line
                key, _, value = line.removeprefix("export ").partition("=")
                (values[key],) = shlex.split(value)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send *sig*; wait for the exit status and for the output to be drained."""
        self.popen.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 15.0) -> int:
        """Wait for the exit status and for the output to be drained; a process still running
        after *timeout* is aborted and the test fails with its threads' stacks."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGABRT)
            self.popen.wait(timeout)
            for thread in self._threads:
                thread.join(timeout)
            raise AssertionError(
                f"the process did not exit within {timeout} s; its stacks:\n{self.stderr}"
            ) from None
        for thread in self._threads:
            thread.join(timeout)
        return code

    @property
    def stderr(self) -> str:
        """Everything written to stderr so far."""
        return "".join(self.err_lines)

    @property
    def stdout(self) -> str:
        """Everything written to stdout so far."""
        return "".join(self.out_lines)

    def kill(self) -> None:
        """Make sure the process is gone (for test teardown)."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.wait()
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()
