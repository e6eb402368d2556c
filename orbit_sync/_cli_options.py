"""The options of ``orbit-sync worker`` (and ``manage.py orbit_worker``): their help, their
parsing, and what they change: the environment the module is imported in, and the Worker it
defines."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from ._seconds import parse_seconds
from .client import Client, same_credentials, set_token_source
from .models import ID_RE, MAX_CAPACITY

if TYPE_CHECKING:
    from .worker import Worker

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "EXIT_SUMMARY",
    "add_arguments",
    "apply_options",
    "export",
    "queue_id",
]

DESCRIPTION = """\
Import MODULE:ATTRIBUTE and run the orbit_sync.worker.Worker it names until SIGTERM/SIGINT.
ATTRIBUTE (dotted paths allowed) is a Worker, or a function without arguments returning one
(a factory). The current directory is importable.

The options override what the module configured: --url, --queue and --token-file replace its
client and queue; --capacity and --drain-timeout its limits. Before the module is imported,
--url and --queue are also put in $ORBIT_URL and $ORBIT_QUEUE_ID, and --token-file in
$ORBIT_TOKEN_FILE, so a module that builds its client with Client.from_env() sees them. The token
is read from $ORBIT_TOKEN or from --token-file, never from the command line (ps shows it to every
user), and is never printed.

The first SIGTERM/SIGINT drains: no new work, running handlers get --drain-timeout seconds to
return. A second signal cancels them at once.
"""

EPILOG = """\
exit status:
  0  clean stop: every handler returned within the drain
  1  the worker could not be loaded, or failed unexpectedly
  2  usage or configuration error (bad option, malformed target or URL, unreadable token
     file, ORBIT_* setting missing, malformed or misspelled, a handler's time_limit or
     another value of the module refused at import)
  3  forced stop: handlers cancelled or abandoned, or a result not delivered
  4  the server refused the credentials (401/403, UNAUTHENTICATED, PERMISSION_DENIED)
  5  the server broke the protocol or refused the registration
  6  the server was not reached once within --first-connect-timeout seconds of the start
"""

EXIT_SUMMARY = (
    "Exit status: 0 clean stop, 1 failure, 2 usage or configuration error, 3 forced stop "
    "(handlers cancelled or abandoned), 4 credentials refused, 5 protocol error, 6 server not "
    "reached within --first-connect-timeout."
)


def _capacity(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_CAPACITY:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_CAPACITY}")
    return int(text)


def _seconds(text: str) -> float:
    return parse_seconds(text)


def _positive_seconds(text: str) -> float:
    return parse_seconds(text, positive=True)


def queue_id(text: str) -> str:
    """An argparse type: a queue id (also ``mock-server --queue-id``'s)."""
    if not ID_RE.fullmatch(text):
        raise argparse.ArgumentTypeError("expected a queue id: 32 lowercase hex characters")
    return text


def add_arguments(parser: argparse.ArgumentParser, *, target: bool = True) -> None:
    """The ``worker`` subcommand's arguments (also ``manage.py orbit_worker``'s, without
    *target*)."""
    if target:
        parser.add_argument("target", metavar="MODULE:ATTRIBUTE", help="where the Worker is")
    parser.add_argument(
        "--url", metavar="URL", help="the Orbit server, ws:// or wss:// (default: $ORBIT_URL)"
    )
    parser.add_argument(
        "--queue", type=queue_id, metavar="ID", help="the queue id (default: $ORBIT_QUEUE_ID)"
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="read the token from this file (default: $ORBIT_TOKEN, or $ORBIT_TOKEN_FILE)",
    )
    parser.add_argument(
        "--capacity", type=_capacity, metavar="N", help="handler threads, 1-256 (default: module's)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=_seconds,
        metavar="S",
        help="seconds running handlers get after the first signal (default: module's, 30)",
    )
    parser.add_argument(
        "--time-limit",
        type=_positive_seconds,
        metavar="S",
        help="seconds a handler may run, for handlers registered without a time_limit of their"
        " own (default: module's, none)",
    )
    parser.add_argument(
        "--first-connect-timeout",
        type=_positive_seconds,
        metavar="S",
        help="exit 6 when the server was not reached once within S seconds of the start"
        " (default: retry for ever; a server once reached is always retried)",
    )
    # The supervisor's package imports the command's modules: not at the top.
    from ._supervisor import _cli as supervisor_cli

    supervisor_cli.add_arguments(parser)


def export(args: argparse.Namespace) -> None:
    """Put the command line's connection settings where ``Client.from_env()`` looks."""
    if args.url is not None:
        os.environ["ORBIT_URL"] = args.url
    if args.queue is not None:
        os.environ["ORBIT_QUEUE_ID"] = args.queue
    if args.token_file is not None:
        # The file named on the command line wins over a token inherited in the environment.
        os.environ.pop("ORBIT_TOKEN", None)
        os.environ["ORBIT_TOKEN_FILE"] = os.path.abspath(args.token_file)


def apply_options(worker: Worker, args: argparse.Namespace, token: str | None) -> Worker:
    """The worker with the command line's options applied (a new Worker when any is given)."""
    changes: dict[str, Any] = {}
    if args.capacity is not None:
        changes["capacity"] = args.capacity
    if args.drain_timeout is not None:
        changes["drain_timeout"] = args.drain_timeout
    if args.first_connect_timeout is not None:
        changes["first_connect_timeout"] = args.first_connect_timeout
    if args.time_limit is not None:
        changes["time_limit"] = args.time_limit
    if args.queue is not None:
        changes["queue_id"] = args.queue
    if args.url is not None or token is not None:
        source = None if args.token_file is None else f"--token-file {args.token_file}"
        changes["client"] = _client(worker.client, args.url, token, source)
    if not worker.options.handle_signals:
        changes["handle_signals"] = True  # a supervised process must drain on SIGTERM
    return worker.with_options(**changes) if changes else worker


def _client(current: object, url: str | None, token: str | None, source: str | None) -> Client:
    """A Client for *url* (default: the current client's) with *token* (default: $ORBIT_TOKEN,
    then the current client's); *source* says where *token* came from."""
    if url is None:
        url = getattr(current, "base_url", None)
        if not isinstance(url, str):
            raise ValueError("--token-file needs --url: the module's client has no base_url")
    if token is None and os.environ.get("ORBIT_TOKEN"):
        token, source = os.environ["ORBIT_TOKEN"], "$ORBIT_TOKEN"
    if token is None and isinstance(current, Client):
        # Same server, new address: keep the module's credentials.
        return same_credentials(current, url)
    if token is None:
        raise ValueError("no token: set $ORBIT_TOKEN or use --token-file")
    client = Client(url, token)
    if source is not None:
        set_token_source(client, source)
    return client
