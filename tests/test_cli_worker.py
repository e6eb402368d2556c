"""``orbit-sync worker module:attribute``, run as a subprocess against an in-process mock server,
stopped with real signals."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest
from _cli_process import Proc, clean_env, command, run_cli

from orbit_sync import __version__
from orbit_sync.testing import MockOrbitServer

USER_MODULE = textwrap.dedent(
    """
    import os
    import sys

    from orbit_sync.client import Client
    from orbit_sync.worker import Worker

    print("userworker imported", file=sys.stderr)

    def make():
        worker = Worker(
            Client(os.environ["ORBIT_URL"], os.environ["ORBIT_TOKEN"]),
            queue_id=os.environ["ORBIT_QUEUE_ID"],
            capacity=1,
            drain_timeout=5,
        )
        register(worker)
        return worker

    def register(worker):
        @worker.handler("echo")
        def echo(ctx, payload):
            print("handled", payload["n"], flush=True)
            return {"echo": payload["n"]}

        @worker.handler("gate")
        def gate(ctx, payload):
            # Blocks until the test writes a line: a handler still running at the signal.
            print("started", payload["n"], flush=True)
            return {"line": sys.stdin.readline().strip()}

        @worker.handler("slow", time_limit=120)
        def slow(ctx, payload):
            print("started", payload["n"], flush=True)
            ctx.sleep(60)  # returns early (TaskCancelled) only when cancelled

    def from_env():
        worker = Worker(Client.from_env())  # the queue too comes from the environment
        register(worker)
        return worker

    # Hard-coded elsewhere: the command line must override all of it.
    elsewhere = Worker(
        Client("ws://127.0.0.1:9", "module-token-0123456789"),
        queue_id="0" * 32,
        capacity=1,
        handle_signals=False,
    )
    register(elsewhere)

    def echo_handler(ctx, payload):
        return payload

    def returns_none():
        return None

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
    """The factory's Worker runs tasks after a banner; SIGTERM is announced, drains, exits 0."""
    proc = Proc(command("worker", "userworker:make"), env=env_for(orbit_server), cwd=project)
    procs.append(proc)
    task_id = orbit_server.enqueue("echo", {"n": 7})
    assert proc.line() == "handled 7"
    snap = orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED"}, timeout=10)
    assert snap.state.value == "SUCCEEDED" and snap.result == {"echo": 7}
    banner = proc.stderr
    assert f"orbit-sync {__version__} worker userworker:make" in banner
    assert f"server:    {orbit_server.url}" in banner
    assert f"queue:     {orbit_server.queue_id}" in banner
    assert "capacity:  1, drain timeout 5 s" in banner
    assert "echo (1/1), gate (1/1), slow (1/1, time limit 120 s)" in banner
    assert proc.stop(signal.SIGTERM) == 0
    # The echo attempt may still count while its finish's answer is on its way.
    assert re.search(
        r"SIGTERM received: draining [01] tasks? \(up to 5s\), SIGTERM again", proc.stderr
    )
    assert "worker stopped (drained=True" in proc.stderr and "exit 0)" in proc.stderr
    assert orbit_server.token not in proc.stderr + proc.stdout


@pytest.mark.orbit_server(assignment_rate=None)
def test_first_signal_drains_a_running_handler_to_exit_0(
    orbit_server: MockOrbitServer, project: Path, procs: list[Proc]
) -> None:
    """A handler running at SIGTERM is announced, finishes during the drain, and the exit is 0."""
    proc = Proc(
        command("worker", "userworker:make"), env=env_for(orbit_server), cwd=project, stdin=True
    )
    procs.append(proc)
    task_id = orbit_server.enqueue("gate", {"n": 1})
    assert proc.line() == "started 1"
    proc.popen.send_signal(signal.SIGTERM)
    proc.wait_stderr("SIGTERM received: draining 1 task (up to 5s), SIGTERM again to stop now")
    proc.send("go on\n")
    assert proc.wait() == 0
    snap = orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED"}, timeout=10)
    assert snap.state.value == "SUCCEEDED" and snap.result == {"line": "go on"}


@pytest.mark.orbit_server(assignment_rate=None)
def test_second_signal_forces_the_stop_and_exits_3(
    orbit_server: MockOrbitServer, project: Path, procs: list[Proc]
) -> None:
    """A second SIGINT cancels the running handler at once: announced, reported, exit 3."""
    # A drain far longer than the test: only the second signal can end it, so the handler is
    # still running (and counted) when that signal is announced.
    argv = command("worker", "userworker:make", "--drain-timeout", "60")
    proc = Proc(argv, env=env_for(orbit_server), cwd=project)
    procs.append(proc)
    task_id = orbit_server.enqueue("slow", {"n": 2}, max_attempts=1)
    assert proc.line() == "started 2"
    proc.popen.send_signal(signal.SIGINT)
    proc.wait_stderr("SIGINT received: draining 1 task")
    proc.popen.send_signal(signal.SIGINT)
    assert proc.wait() == 3
    assert "SIGINT received again: stopping now, cancelling 1 task" in proc.stderr
    assert "worker stopped (drained=False, cancelled=1" in proc.stderr
    snap = orbit_server.wait_for(task_id, {"FAILED", "NEEDS_REVIEW"}, timeout=10)
    assert snap.error_code == "WORKER_SHUTDOWN"


@pytest.mark.orbit_server(assignment_rate=None)
def test_options_override_the_module_and_the_token_comes_from_a_file(
    orbit_server: MockOrbitServer, project: Path, procs: list[Proc]
) -> None:
    """--url, --queue, --token-file, --capacity and --drain-timeout replace what the module
    hard-coded; the token is read from the file and printed nowhere."""
    token_file = project / "token"
    token_file.write_text(orbit_server.token + "\n")
    argv = ["worker", "userworker:elsewhere", "--url", orbit_server.url]
    argv += ["--queue", orbit_server.queue_id, "--token-file", str(token_file)]
    argv += ["--capacity", "3", "--drain-timeout", "7", "--log-level", "INFO"]
    proc = Proc(command(*argv), env=clean_env(ORBIT_TOKEN="ignored-token-0123456789"), cwd=project)
    procs.append(proc)
    task_id = orbit_server.enqueue("echo", {"n": 5})
    assert proc.line() == "handled 5"
    assert orbit_server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).result == {"echo": 5}
    assert [s.capacity for s in orbit_server.sessions()] == [3]
    assert "capacity:  3, drain timeout 7 s" in proc.stderr
    assert proc.stop(signal.SIGTERM) == 0  # handle_signals=False was overridden
    assert "session" in proc.stderr  # --log-level INFO after the subcommand took effect
    for secret in (orbit_server.token, "module-token-0123456789", "ignored-token-0123456789"):
        assert secret not in proc.stderr + proc.stdout


@pytest.mark.orbit_server(assignment_rate=None)
def test_client_from_env_sees_the_command_line(
    orbit_server: MockOrbitServer, project: Path, procs: list[Proc]
) -> None:
    """A module using Client.from_env() gets --url, --queue and --token-file through the
    environment, with no ORBIT_* variable set by the caller."""
    token_file = project / "token"
    token_file.write_text(orbit_server.token)
    argv = ["worker", "userworker:from_env", "--url", orbit_server.url]
    argv += ["--queue", orbit_server.queue_id, "--token-file", str(token_file)]
    proc = Proc(command(*argv), env=clean_env(), cwd=project)
    procs.append(proc)
    task_id = orbit_server.enqueue("echo", {"n": 9})
    assert proc.line() == "handled 9"
    assert orbit_server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).result == {"echo": 9}
    assert proc.stop(signal.SIGTERM) == 0


def test_rejected_token_exits_4(orbit_server: MockOrbitServer, project: Path) -> None:
    """A worker the server refuses (401) stops with exit 4 and one line about the refusal (not
    the worker's log line as well), and the token is not printed."""
    token = "not-a-valid-token-0123456789"
    done = run_cli("worker", "userworker:make", env=env_for(orbit_server, token), cwd=project)
    assert done.returncode == 4
    assert "worker stopped on HTTPError" in done.stderr and "(exit 4)" in done.stderr
    # "HTTP 401", not "401": the banner's server line can hold a port such as 40113.
    about = [line for line in done.stderr.splitlines() if "HTTP 401" in line]
    assert len(about) == 1 and about[0].startswith("orbit-sync: worker stopped on"), about
    assert token not in done.stderr and token not in done.stdout


@pytest.mark.parametrize("where", ["module", "env", "option", "env-file"])
def test_a_refused_token_is_named_by_where_it_came_from(
    orbit_server: MockOrbitServer, project: Path, where: str
) -> None:
    """The 401 line names the credential used ($ORBIT_TOKEN, the --token-file path or the
    $ORBIT_TOKEN_FILE path) and what 401 means, never the token."""
    token = "not-a-valid-token-0123456789"
    token_file = project / "token"
    token_file.write_text(token + "\n")
    env = clean_env(ORBIT_URL=orbit_server.url, ORBIT_QUEUE_ID=orbit_server.queue_id)
    argv = ["worker", "userworker:from_env"]
    if where == "module":  # the module reads os.environ["ORBIT_TOKEN"] itself
        argv, env["ORBIT_TOKEN"], source = ["worker", "userworker:make"], token, "$ORBIT_TOKEN"
    elif where == "env":
        env["ORBIT_TOKEN"], source = token, "$ORBIT_TOKEN"
    elif where == "option":
        argv += ["--token-file", "token"]
        source = "--token-file token"
    else:
        env["ORBIT_TOKEN_FILE"], source = str(token_file), f"$ORBIT_TOKEN_FILE ({token_file})"
    done = run_cli(*argv, env=env, cwd=project)
    assert done.returncode == 4, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("orbit-sync: ")]
    assert f"the server does not accept the token from {source} (401: it does not know" in line
    assert line.endswith("(exit 4)"), line
    assert token not in done.stderr + done.stdout


def test_a_token_without_the_scope_says_what_403_means(
    orbit_server: MockOrbitServer, project: Path
) -> None:
    """A token the server knows but that lacks workers:connect: exit 4, and the line says the
    token is known but lacks a permission."""
    token = orbit_server.add_token({"workers:consume"})
    done = run_cli("worker", "userworker:from_env", env=env_for(orbit_server, token), cwd=project)
    assert done.returncode == 4, done.stderr
    assert "HTTP 403" in done.stderr
    assert "knows the token from $ORBIT_TOKEN but it lacks a permission" in done.stderr
    assert token not in done.stderr + done.stdout


def test_a_server_that_is_not_orbit_exits_5(project: Path) -> None:
    """A WebSocket server that does not speak pulse.worker.v1 stops the worker with exit 5."""
    from websockets.sync.server import serve

    with serve(lambda ws: ws.close(), "127.0.0.1", 0) as other:
        thread = threading.Thread(target=other.serve_forever, daemon=True)
        thread.start()
        port = other.socket.getsockname()[1]
        env = clean_env(ORBIT_TOKEN="some-token-0123456789", ORBIT_QUEUE_ID="a" * 32)
        done = run_cli(
            "worker", "userworker:from_env", "--url", f"ws://127.0.0.1:{port}", env=env, cwd=project
        )
        other.shutdown()
    thread.join(5)
    assert done.returncode == 5, done.stderr
    assert "WorkerProtocolError" in done.stderr and f"ws://127.0.0.1:{port}" in done.stderr


def test_unreachable_server_is_logged_with_url_and_reason(project: Path, procs: list[Proc]) -> None:
    """While the server refuses connections, each retry names the URL and the reason (not the
    token) at the default level; SIGTERM then stops the idle worker with exit 0."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once it is closed
    url = f"ws://127.0.0.1:{port}"
    token = "unused-token-0123456789"
    env = clean_env(ORBIT_URL=url, ORBIT_TOKEN=token, ORBIT_QUEUE_ID="b" * 32)
    proc = Proc(command("worker", "userworker:make"), env=env, cwd=project)
    procs.append(proc)
    line = proc.wait_stderr("retrying")
    assert f"cannot connect to {url}" in line and "Connection refused" in line, line
    # The first failure of a worker that never reached its server is loud and says so.
    assert "ERROR" in line and "not reached once since this worker started" in line, line
    assert proc.stop(signal.SIGTERM) == 0
    assert token not in proc.stderr


@pytest.mark.parametrize("processes", [[], ["--processes", "1"]])
def test_first_connect_timeout_exits_6(project: Path, processes: list[str]) -> None:
    """--first-connect-timeout: a server not reached within it ends the command with exit 6 and
    a line naming the URL and the last failure (under a supervisor too: it does not restart)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    url = f"ws://127.0.0.1:{port}"
    token = "unused-token-0123456789"
    env = clean_env(ORBIT_URL=url, ORBIT_TOKEN=token, ORBIT_QUEUE_ID="b" * 32)
    argv = ["worker", "userworker:make", "--first-connect-timeout", "0.5", *processes]
    done = run_cli(*argv, env=env, cwd=project)
    assert done.returncode == 6, done.stderr
    assert f"worker stopped on ServerUnreachable: {url} was not reached within 0.5 s" in done.stderr
    assert "Connection refused" in done.stderr and "(exit 6)" in done.stderr
    assert token not in done.stderr


def test_version() -> None:
    """``orbit-sync --version`` prints the package version."""
    done = subprocess.run(command("--version"), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    assert done.stdout.strip() == f"orbit-sync {__version__}"


@pytest.mark.parametrize(
    ("target", "status", "message"),
    [
        ("userworker", 2, "module:attribute"),
        ("nosuchmodule:worker", 1, "cannot load nosuchmodule:worker"),
        ("userworker:missing", 1, "cannot load userworker:missing"),
        ("userworker:not_a_worker", 1, "is a str, not an orbit_sync.worker.Worker"),
        ("userworker:App.worker", 1, "is a NoneType, not an orbit_sync.worker.Worker"),
        ("userworker:echo_handler", 1, "takes arguments (a handler?), not a Worker or a factory"),
        ("userworker:returns_none", 1, "returns_none() returned a NoneType, not an orbit_sync"),
    ],
)
def test_worker_command_rejects_bad_targets(
    project: Path, target: str, status: int, message: str
) -> None:
    """Targets that are malformed, missing, plain handler functions or not Workers fail with a
    clear message and no traceback."""
    done = run_cli("worker", target, env=clean_env(), cwd=project)
    assert done.returncode == status
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity", "0"], "--capacity"),
        (["--capacity", "257"], "--capacity"),
        (["--drain-timeout", "nan"], "--drain-timeout"),
        (["--queue", "not-a-queue"], "--queue"),
        (["--token-file", "/nonexistent/token"], "cannot read the token file /nonexistent/token"),
    ],
)
def test_bad_options_exit_2_before_loading(project: Path, args: list[str], message: str) -> None:
    """Bad options are usage errors (exit 2), reported before the module is imported."""
    done = run_cli("worker", "userworker:make", *args, env=clean_env(), cwd=project)
    assert done.returncode == 2
    assert message in done.stderr
    assert "userworker imported" not in done.stderr


def test_an_unreadable_token_file_is_one_line(project: Path) -> None:
    """--token-file naming no file prints one line saying why, not the usage block."""
    done = run_cli(
        "worker",
        "userworker:make",
        "--token-file",
        "/nonexistent/tok",
        env=clean_env(),
        cwd=project,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "orbit-sync: error: cannot read the token file /nonexistent/tok: No such file or directory"
    ]


def test_token_file_content_is_never_echoed(project: Path) -> None:
    """A token file holding something that is not a token is refused without showing it."""
    bad = project / "token"
    bad.write_text("secret words with spaces\n")
    done = run_cli(
        "worker", "userworker:make", "--token-file", str(bad), env=clean_env(), cwd=project
    )
    assert done.returncode == 2
    assert "does not hold one bearer token" in done.stderr
    assert "secret" not in done.stderr
