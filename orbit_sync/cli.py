"""The ``orbit-sync`` command: run a standalone mock Orbit server, or run a worker.

::

    orbit-sync --version
    orbit-sync mock-server --port 8765          # also: python -m orbit_sync.testing
    orbit-sync worker myapp.tasks:worker        # runs an orbit_sync.worker.Worker
    orbit-sync chaos myapp.tasks:worker --seed 7  # a seeded fault run of it, then its checks

``mock-server`` exits 0 after SIGTERM/SIGINT, 1 when it cannot start, 2 for a usage error. The
worker's exit statuses are in ``orbit-sync worker --help`` (and docs/cli.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from . import _cli_chaos, _cli_options, _cli_worker
from ._rules import MAX_LEASE_WINDOW, MAX_SESSION_WINDOW
from ._seconds import parse_seconds
from ._version import __version__
from .client import read_token_file

if TYPE_CHECKING:
    from .testing import MockOrbitServer

__all__ = ["main"]

_LOG = logging.getLogger("orbit_sync.cli")

#: Environment variables read when the token options are absent (a command line is visible to
#: every user of the machine through ``ps``; the environment is not).
TOKEN_ENV = "ORBIT_MOCK_TOKEN"
ADMIN_TOKEN_ENV = "ORBIT_MOCK_ADMIN_TOKEN"

_MOCK_HELP = f"""\
Run a mock Orbit server (pulse.worker.v1) on this machine until SIGTERM or SIGINT, for tests,
benchmarks and workers written in other languages. It speaks the worker protocol on
/v1/worker/connect and a JSON admin API on /admin/v1/ (same port).

On start it prints, on standard output, shell lines (export ORBIT_URL=..., so that the output can
be sourced or eval'd): ORBIT_URL, ORBIT_TOKEN (a worker token), ORBIT_QUEUE_ID, ORBIT_ADMIN_URL and
ORBIT_ADMIN_TOKEN, then "# ready". The tokens are printed on purpose:
this is your own throw-away test server, and the banner is how you learn its credentials. Do not
run it where untrusted users can read its output or reach its port, and never reuse the tokens.
Tokens given in files (--token-file, --admin-token-file), in the environment variables
${TOKEN_ENV} and ${ADMIN_TOKEN_ENV}, or with --token/--admin-token are used as is; otherwise
fresh random ones are made. A token on the command line is readable by every user of the
machine (ps, /proc/PID/cmdline): prefer a file or the environment.
"""


_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def _positive_float(text: str) -> float:
    return parse_seconds(text, positive=True)


def _seconds_or_none(text: str) -> float | None:
    if text.lower() == "none":
        return None
    return _positive_float(text)


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("expected a whole number >= 1")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError("expected a port number from 0 to 65535")
    return int(text)


def _parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "orbit-sync",
        description="orbit-sync: synchronous Orbit worker SDK tools.",
    )
    parser.add_argument("--version", action="version", version=f"orbit-sync {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=_LEVELS,
        help="logging level on standard error (default: WARNING)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mock = sub.add_parser(
        "mock-server",
        help="run a standalone mock Orbit server (prints its URL and tokens)",
        description=_MOCK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _mock_arguments(mock)

    worker = sub.add_parser(
        "worker",
        help="run an orbit_sync.worker.Worker until SIGTERM/SIGINT",
        description=_cli_options.DESCRIPTION,
        epilog=_cli_options.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # SUPPRESS: given after the subcommand it overrides the global option, absent it keeps it.
    worker.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        choices=_LEVELS,
        help="logging level on standard error (default: WARNING)",
    )
    _cli_options.add_arguments(worker)
    # Its own usage errors print its own usage, not the top-level one.
    worker.set_defaults(subparser=worker)

    chaos = sub.add_parser(
        "chaos",
        help="a seeded fault run of a Worker against a mock server, then its checks",
        description=_cli_chaos.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _cli_chaos.add_arguments(chaos)
    chaos.set_defaults(subparser=chaos)
    return parser


def _mock_arguments(parser: argparse.ArgumentParser) -> None:
    # The state machine's defaults; its module needs no websockets, so --help works without
    # the testing extra.
    from .testing._state import (
        DEFAULT_EVENT_LOG_SIZE,
        DEFAULT_IDEMPOTENCY_WINDOW,
        DEFAULT_MAX_RECEIPTS,
        DEFAULT_RETENTION,
    )

    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--port", type=_port, default=8765, help="port to bind; 0 picks a free one (default: 8765)"
    )
    parser.add_argument(
        "--lease-duration",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help=f"lease window in seconds, 1-{MAX_LEASE_WINDOW} (default: 30)",
    )
    parser.add_argument(
        "--session-window",
        type=_positive_float,
        default=45.0,
        metavar="S",
        help=f"session window in seconds, up to {MAX_SESSION_WINDOW} (default: 45)",
    )
    parser.add_argument(
        "--assignment-rate",
        type=float,
        default=4.0,
        metavar="N",
        help="new assignments per second; 0 for no limit (default: 4, as a real node)",
    )
    # State bounds: what a long-running shared server keeps (docs/mock-server.md).
    parser.add_argument(
        "--idempotency-window",
        type=_positive_float,
        default=DEFAULT_IDEMPOTENCY_WINDOW,
        metavar="S",
        help="seconds a request's message_id and receipt are remembered "
        f"(default: {DEFAULT_IDEMPOTENCY_WINDOW:g})",
    )
    parser.add_argument(
        "--max-receipts",
        type=_count,
        default=DEFAULT_MAX_RECEIPTS,
        metavar="N",
        help="receipts kept at most; past it the oldest are forgotten first "
        f"(default: {DEFAULT_MAX_RECEIPTS})",
    )
    parser.add_argument(
        "--retention",
        type=_seconds_or_none,
        default=DEFAULT_RETENTION,
        metavar="S",
        help="seconds an ended task, session or worker process stays inspectable; "
        f"'none' keeps them forever (default: {DEFAULT_RETENTION:g})",
    )
    parser.add_argument(
        "--event-log-size",
        type=_count,
        default=DEFAULT_EVENT_LOG_SIZE,
        metavar="N",
        help=f"events the event log keeps (default: {DEFAULT_EVENT_LOG_SIZE})",
    )
    parser.add_argument(
        "--exact-recovery",
        action="store_true",
        help="recover expired leases and overdue tasks at their own moment, not on the "
        "2 s recovery scan a real server runs",
    )
    parser.add_argument(
        "--manual-clock",
        action="store_true",
        help="server time moves only through POST /admin/v1/clock/advance",
    )
    parser.add_argument(
        "--queue-id",
        type=_cli_options.queue_id,
        metavar="ID",
        help="the queue's id, 32 lowercase hex characters (default: a random one); with the "
        "same tokens, a restarted server keeps its workers connected",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"read the worker token to accept from this file (default: ${TOKEN_ENV}, else a "
        "random one)",
    )
    parser.add_argument(
        "--admin-token-file",
        metavar="PATH",
        help=f"read the admin API token from this file (default: ${ADMIN_TOKEN_ENV}, else a "
        "random one)",
    )
    parser.add_argument(
        "--token",
        metavar="T",
        help="the worker token, on the command line: every local user can read it (ps, "
        "/proc/PID/cmdline); prefer --token-file or the environment",
    )
    parser.add_argument(
        "--admin-token",
        metavar="T",
        help="the admin API token, on the command line (readable by every local user, as --token)",
    )


def _given_token(
    parser: argparse.ArgumentParser, value: str | None, path: str | None, option: str, env: str
) -> str | None:
    """The token from *option*, its file, or *env* (in that order); None for a random one."""
    if value is not None and path is not None:
        parser.error(f"give {option} or {option}-file, not both")
    if path is not None:
        try:
            return read_token_file(path)
        except ValueError as exc:
            # The path is the whole story: one line, not the usage block.
            parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return value if value is not None else os.environ.get(env)


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Entry point of the ``orbit-sync`` console script; returns the exit status."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "mock-server":
        return _run_mock_server(args, parser)
    if args.command == "chaos":
        return _cli_chaos.run(args, args.subparser)
    return _cli_worker.run(args, args.subparser)


def mock_server_main(argv: Sequence[str] | None = None) -> int:
    """``python -m orbit_sync.testing``: the ``mock-server`` command on its own."""
    parser = argparse.ArgumentParser(
        prog="python -m orbit_sync.testing",
        description=_MOCK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", choices=_LEVELS)
    _mock_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return _run_mock_server(args, parser)


# --------------------------------------------------------------------------- mock-server


class _StopSignal:
    """SIGTERM/SIGINT set an event the main thread waits on (a signal handler must not take
    locks the interrupted code may hold, so it does nothing else)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.event.set()


def _run_mock_server(
    args: argparse.Namespace, parser: argparse.ArgumentParser, out: TextIO | None = None
) -> int:
    """Start the server, print the banner, serve until a signal, stop; returns the exit status."""
    try:
        from .testing import ManualClock, MockOrbitServer
        from .testing._admin import AdminAPI
    except ImportError:
        # One line, not a traceback: the cause is always the same missing extra.
        print(
            "orbit-sync: mock-server needs the 'testing' extra (websockets): "
            "pip install 'orbit-sync[testing]'",
            file=sys.stderr,
        )
        return 1

    out = sys.stdout if out is None else out
    args.token = _given_token(parser, args.token, args.token_file, "--token", TOKEN_ENV)
    args.admin_token = _given_token(
        parser, args.admin_token, args.admin_token_file, "--admin-token", ADMIN_TOKEN_ENV
    )
    try:
        api = AdminAPI(args.admin_token)
    except ValueError as exc:
        parser.error(str(exc))
    if args.token is not None and not _token_ok(args.token):
        parser.error("worker token must be 1-512 characters, without spaces or control characters")
    if args.token is not None and args.token == api.token:
        parser.error("the worker token and the admin token must differ")
    if args.assignment_rate < 0 or args.assignment_rate != args.assignment_rate:
        parser.error("--assignment-rate must be >= 0")
    try:
        server = MockOrbitServer(
            host=args.host,
            port=args.port,
            lease_duration=args.lease_duration,
            session_window=args.session_window,
            assignment_rate=args.assignment_rate or None,
            clock=ManualClock() if args.manual_clock else None,
            admin_handler=api,
            idempotency_window=args.idempotency_window,
            retention=args.retention,
            event_log_size=args.event_log_size,
            max_receipts=args.max_receipts,
            exact_recovery=args.exact_recovery,
            queue_id=args.queue_id,
        )
    except ValueError as exc:
        parser.error(str(exc))

    stop = _StopSignal()
    # Installed before binding, so a signal that arrives during start-up is not lost.
    stop.install()
    try:
        try:
            server.start()
        except OSError as exc:
            print(
                f"orbit-sync: cannot listen on {args.host}:{args.port}: {exc.strerror}",
                file=sys.stderr,
            )
            return 1
        try:
            token = server.token
            if args.token is not None:
                _replace_worker_token(server, args.token)
                token = args.token
            _banner(out, server, token, api.token)
            stop.event.wait()
        finally:
            server.stop()
    finally:
        stop.restore()
    print("orbit-sync: mock server stopped", file=sys.stderr)
    return 0


def _token_ok(token: str) -> bool:
    from .testing._options import TOKEN_RE

    return bool(TOKEN_RE.fullmatch(token))


def _replace_worker_token(server: MockOrbitServer, token: str) -> None:
    """Accept *token* with the default token's scopes, and retire the generated one."""
    from .testing import SCOPE_CONNECT, SCOPE_CONSUME, queue_scope

    scopes = {SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(server.queue_id)}
    server.add_token(scopes, token=token)
    # Only the printed token should open sessions on this server.
    server.revoke_token(server.token)


def _banner(out: TextIO, server: MockOrbitServer, token: str, admin_token: str) -> None:
    from .testing._admin_client import admin_url  # loaded with the mock server, as testing is

    base = server.url
    lines = [
        "# orbit-sync mock server. The tokens below are printed on purpose: this is your own",
        "# local test server. Never reuse them. SIGTERM or Ctrl-C stops it.",
        f"export ORBIT_URL={shlex.quote(base)}",
        f"export ORBIT_TOKEN={shlex.quote(token)}",
        f"export ORBIT_QUEUE_ID={server.queue_id}",
        f"export ORBIT_ADMIN_URL={shlex.quote(admin_url(base))}",
        f"export ORBIT_ADMIN_TOKEN={shlex.quote(admin_token)}",
        "# ready",
    ]
    out.write("\n".join(lines) + "\n")
    out.flush()
