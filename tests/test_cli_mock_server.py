"""``orbit-sync mock-server`` and ``python -m orbit_sync.testing``, run as real subprocesses."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_process import REFUSE_WEBSOCKETS, Proc, clean_env, command

from orbit_sync import Finish, Outcome
from orbit_sync.client import Client
from orbit_sync.models import Capability, CapacityReport, Registration, new_id, new_secret
from orbit_sync.testing import AdminClient

FIXED_TOKEN = "fixed-worker-token-0123456789"
FIXED_ADMIN = "fixed-admin-token-0123456789"


def registration(queue_id: str) -> Registration:
    """A fresh worker identity for one dial."""
    return Registration(
        queue_id=queue_id,
        capabilities=[Capability("resize", "1", "1")],
        capacity=1,
        instance_id=new_id(),
        instance_secret=new_secret(),
    )


def run_one_task(url: str, token: str, queue_id: str, admin: AdminClient) -> None:
    """Enqueue through the admin API, run it with a real worker connection, check SUCCEEDED."""
    task_id = admin.enqueue("resize", {"w": 3})
    conn = Client(url, token).dial_worker(registration(queue_id))
    try:
        conn.capacity(CapacityReport(sequence=1, capacity=1))
        assignment = conn.next_assignment(timeout=10)
        assert assignment.task.task_id == task_id
        assert conn.start(assignment.attempt).lease.may_run()
        conn.finish(Finish(ref=assignment.attempt, outcome=Outcome.SUCCEEDED, result={"ok": 1}))
    finally:
        conn.close()
    assert admin.wait(task_id, ["SUCCEEDED"], timeout=10)["result"] == {"ok": 1}


def test_mock_server_serves_until_sigterm(procs: list[Proc]) -> None:
    """The console script prints its banner, serves workers and the admin API, exits 0 on
    SIGTERM, and shows its tokens nowhere but in the banner."""
    proc = Proc(command("mock-server", "--port", "0", "--assignment-rate", "0"))
    procs.append(proc)
    banner = proc.banner()
    assert set(banner) == {
        "ORBIT_URL",
        "ORBIT_TOKEN",
        "ORBIT_QUEUE_ID",
        "ORBIT_ADMIN_URL",
        "ORBIT_ADMIN_TOKEN",
    }
    url = banner["ORBIT_URL"]
    assert url.startswith("ws://127.0.0.1:") and not url.endswith(":0")
    assert banner["ORBIT_ADMIN_URL"] == "http" + url[2:] + "/admin/v1"
    assert banner["ORBIT_TOKEN"] != banner["ORBIT_ADMIN_TOKEN"]
    admin = AdminClient(banner["ORBIT_ADMIN_URL"], banner["ORBIT_ADMIN_TOKEN"])
    info = admin.get("/server")
    assert info["queue_id"] == banner["ORBIT_QUEUE_ID"] and info["manual_clock"] is False
    run_one_task(url, banner["ORBIT_TOKEN"], banner["ORBIT_QUEUE_ID"], admin)
    # The worker token is not an admin token.
    assert AdminClient(url, banner["ORBIT_TOKEN"]).request("GET", "/server")[0] == 401
    assert proc.stop(signal.SIGTERM) == 0
    assert "mock server stopped" in proc.stderr
    for secret in (banner["ORBIT_TOKEN"], banner["ORBIT_ADMIN_TOKEN"]):
        assert secret not in proc.stderr
        assert proc.stdout.count(secret) == 1  # the banner line, nothing else


def test_python_m_testing_with_fixed_tokens_and_manual_clock(procs: list[Proc]) -> None:
    """``python -m orbit_sync.testing`` takes tokens from the environment and options, runs on a
    manual clock moved through the admin API, and exits 0 on SIGINT."""
    argv = [sys.executable, "-m", "orbit_sync.testing", "--port", "0", "--manual-clock"]
    argv += ["--lease-duration", "5", "--admin-token", FIXED_ADMIN]
    argv += ["--idempotency-window", "90", "--max-receipts", "500", "--retention", "none"]
    argv += ["--event-log-size", "64", "--exact-recovery"]
    proc = Proc(argv, env=clean_env(ORBIT_MOCK_TOKEN=FIXED_TOKEN))
    procs.append(proc)
    banner = proc.banner()
    assert banner["ORBIT_TOKEN"] == FIXED_TOKEN
    assert banner["ORBIT_ADMIN_TOKEN"] == FIXED_ADMIN
    admin = AdminClient(banner["ORBIT_URL"], FIXED_ADMIN)
    info = admin.get("/server")
    assert info["manual_clock"] is True and info["lease_duration"] == 5.0
    bounds = info["bounds"]
    assert (bounds["idempotency_window"], bounds["max_receipts"]) == (90.0, 500)
    assert (bounds["retention"], bounds["event_log_size"]) == (None, 64)
    assert bounds["exact_recovery"] is True
    assert admin.get("/clock")["now"] == "2026-01-01T00:00:00Z"
    assert admin.post("/clock/advance", seconds=90)["now"] == "2026-01-01T00:01:30Z"
    run_one_task(banner["ORBIT_URL"], FIXED_TOKEN, banner["ORBIT_QUEUE_ID"], admin)
    assert proc.stop(signal.SIGINT) == 0


def test_tokens_from_files_stay_off_the_command_line(procs: list[Proc], tmp_path: Path) -> None:
    """--token-file and --admin-token-file: the tokens are used, and no process listing shows
    them (/proc/PID/cmdline names only the files)."""
    worker_file, admin_file = tmp_path / "worker", tmp_path / "admin"
    worker_file.write_text(FIXED_TOKEN + "\n")
    admin_file.write_text(FIXED_ADMIN + "\n")
    argv = command("mock-server", "--port", "0", "--token-file", str(worker_file))
    argv += ["--admin-token-file", str(admin_file)]
    proc = Proc(argv, env=clean_env())
    procs.append(proc)
    banner = proc.banner()
    assert (banner["ORBIT_TOKEN"], banner["ORBIT_ADMIN_TOKEN"]) == (FIXED_TOKEN, FIXED_ADMIN)
    cmdline = Path(f"/proc/{proc.popen.pid}/cmdline").read_bytes()
    assert FIXED_TOKEN.encode() not in cmdline and FIXED_ADMIN.encode() not in cmdline
    admin = AdminClient(banner["ORBIT_ADMIN_URL"], FIXED_ADMIN)
    run_one_task(banner["ORBIT_URL"], FIXED_TOKEN, banner["ORBIT_QUEUE_ID"], admin)
    assert proc.stop(signal.SIGTERM) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lease-duration", "500"], "lease_duration"),
        (["--port", "70000"], "port"),
        (["--assignment-rate", "-1"], "assignment-rate"),
        (["--max-receipts", "0"], "max-receipts"),
        (["--retention", "-5"], "retention"),
        (["--event-log-size", "1.5"], "event-log-size"),
        (["--token", FIXED_TOKEN, "--admin-token", FIXED_TOKEN], "must differ"),
        (["--admin-token", f"{FIXED_ADMIN} x"], "admin token"),
        (["--token", f"{FIXED_TOKEN}\tx"], "worker token"),
        (["--token", FIXED_TOKEN, "--token-file", "/dev/null"], "not both"),
        (["--admin-token-file", "/nonexistent/admin"], "cannot read the token file"),
    ],
)
def test_usage_errors_exit_2_without_echoing_tokens(args: list[str], message: str) -> None:
    """Bad options exit 2 with a message on stderr that never repeats a token."""
    port = [] if "--port" in args else ["--port", "0"]
    done = subprocess.run(
        command("mock-server", *port, *args),
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert FIXED_TOKEN not in done.stderr and FIXED_ADMIN not in done.stderr
    assert done.stdout == ""


def test_an_unreadable_token_file_is_one_line() -> None:
    """--token-file naming no file prints one line saying why, not the usage block."""
    done = subprocess.run(
        command("mock-server", "--port", "0", "--token-file", "/nonexistent/tok"),
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "orbit-sync: error: cannot read the token file /nonexistent/tok: No such file or directory"
    ]


def test_busy_port_exits_1() -> None:
    """A port already in use is reported and the command exits 1, printing no banner."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            command("mock-server", "--port", str(port)),
            capture_output=True,
            text=True,
            timeout=30,
            env=clean_env(),
        )
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "ORBIT_TOKEN" not in done.stdout


def test_help_explains_the_printed_tokens() -> None:
    """The help text says why the tokens are printed and how to choose them."""
    done = subprocess.run(
        command("mock-server", "--help"), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "printed on purpose" in text
    assert "ORBIT_MOCK_TOKEN" in text and "ORBIT_MOCK_ADMIN_TOKEN" in text


def test_banner_can_be_evaluated_by_a_shell(procs: list[Proc]) -> None:
    """The banner is shell: ``eval`` of its lines exports the variables with their values."""
    proc = Proc(command("mock-server", "--port", "0", "--token", FIXED_TOKEN))
    procs.append(proc)
    banner = proc.banner()
    script = 'eval "$BANNER"; env | grep "^ORBIT_" | sort'
    done = subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(BANNER=proc.stdout),
    )
    assert done.returncode == 0, done.stderr
    exported = dict(line.split("=", 1) for line in done.stdout.splitlines())
    assert exported == banner and exported["ORBIT_TOKEN"] == FIXED_TOKEN
    assert proc.stop() == 0


_WITHOUT_WEBSOCKETS = (
    REFUSE_WEBSOCKETS
    + """
from orbit_sync.cli import main
raise SystemExit(main(["mock-server", "--port", "0"]))
"""
)


def test_mock_server_without_the_testing_extra_says_so_in_one_line() -> None:
    """Without websockets, ``mock-server`` prints one line naming the extra (no traceback)."""
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_WEBSOCKETS],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "orbit-sync: mock-server needs the 'testing' extra (websockets): "
        "pip install 'orbit-sync[testing]'"
    ]
    assert done.stdout == ""
