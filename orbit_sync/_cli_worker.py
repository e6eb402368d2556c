"""``orbit-sync worker MODULE:ATTRIBUTE``: load a Worker, apply the command line, run it.

Exit statuses, for process supervisors (systemd ``RestartPreventExitStatus=``, Kubernetes, ...):

====  ======================================================================================
0     clean stop: a signal, and every handler returned within the drain
1     the worker could not be loaded or failed unexpectedly (a bug: see the log)
2     usage or configuration error: bad option, malformed target or ``--url``, unreadable token
      file, a missing, malformed or misspelled ``ORBIT_*`` setting, a value the module gives
      orbit-sync refused at import (a handler's ``time_limit=0``, a handler registered twice)
3     forced stop: handlers were cancelled or abandoned (a second signal, or the drain timed
      out), or a finish could not be delivered; the server retries or reviews those tasks
4     the server refused the credentials (HTTP 401/403, ``UNAUTHENTICATED``,
      ``PERMISSION_DENIED``): restarting will not help until the token or its scopes change
5     the server broke the protocol or refused the worker's registration (wrong URL, not an
      Orbit server, incompatible version): restarting will not help either
6     ``--first-connect-timeout S`` was given and the server was not reached once within S
      seconds of the start (a wrong host or port, a missing route, or the server is down)
====  ======================================================================================
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import platform
import sys
import sysconfig
import traceback
from typing import TYPE_CHECKING, Any

from ._seconds import parse_seconds
from .client import (
    Client,
    SettingError,
    check_base_url,
    check_environment,
    read_token_file,
    same_credentials,
    sends_token,
    set_token_source,
    token_source,
)
from .errors import HTTPError, ServerUnreachable, WorkerError, WorkerProtocolError
from .models import ID_RE, MAX_CAPACITY

if TYPE_CHECKING:
    from .worker import Worker

__all__ = [
    "EXIT_AUTH",
    "EXIT_FAILED",
    "EXIT_FORCED",
    "EXIT_OK",
    "EXIT_PROTOCOL",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "add_arguments",
    "report_error",
    "run",
    "serve",
    "speak_as",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_FORCED = 3
EXIT_AUTH = 4
EXIT_PROTOCOL = 5
EXIT_UNREACHABLE = 6

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

_LOG = logging.getLogger("orbit_sync.cli")


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
    from ._supervisor import _cli as supervisor_cli  # imports this module: not at the top

    supervisor_cli.add_arguments(parser)


#: The last line :func:`report_error` printed: a supervised child tells its supervisor.
_last_error: list[str] = []


def last_error() -> str | None:
    """The last line :func:`report_error` printed (what a supervisor repeats about a child)."""
    return _last_error[0] if _last_error else None


#: Who this process is in its lines, when it is one of several writing to one standard error.
_speaker: list[str] = []


def speak_as(who: str) -> None:
    """Name this process in each later :func:`report_error` line (``orbit-sync <who>: ...``)."""
    _speaker[:] = [who]


def report_error(message: str) -> None:
    """One ``orbit-sync: ...`` line on standard error."""
    _last_error[:] = [message]
    who = f" {_speaker[0]}" if _speaker else ""
    print(f"orbit-sync{who}: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the ``worker`` subcommand; returns the exit status."""
    from ._supervisor import ChildLink
    from ._supervisor import _cli as supervisor_cli

    target: str = args.target
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        hint = (
            f" (e.g. {target.rpartition('.')[0]}:{target.rpartition('.')[2]})"
            if "." in target
            else ""
        )
        parser.error(f"the worker target must look like module:attribute{hint}")
    token: str | None = None
    if args.token_file is not None:
        try:
            token = read_token_file(args.token_file)
        except ValueError as exc:
            # The path is the whole story: one line, not the usage block.
            report_error(f"error: {exc}")
            return EXIT_USAGE
    # Settings that are wrong whatever the module does: one line and exit 2, before it is
    # imported (a module reading them at import would fail with a traceback).
    try:
        if args.url is not None:
            check_base_url(args.url, "--url")
        _export(args)
        check_environment(os.environ)
    except ValueError as exc:
        report_error(f"error: {exc}")
        return EXIT_USAGE
    if supervisor_cli.requested(args):
        # The supervisor imports nothing of the application: each child does, afresh.
        level = getattr(args, "log_level", "WARNING")
        command = [sys.executable, "-m", "orbit_sync", "--log-level", level, "worker", target]
        return supervisor_cli.supervise(
            args, [*command, *supervisor_cli.child_arguments(args)], target
        )
    link = ChildLink.from_environ()
    status = _run(args, parser, target, token, link)
    if link is not None:
        link.exit(status, last_error())
    return status


def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    target: str,
    token: str | None,
    link: Any,
) -> int:
    from .worker import Worker

    module_name, _, attribute = target.partition(":")
    try:
        worker = load(target, module_name, attribute)
    except (SettingError, _Misuse) as exc:  # the module's configuration: not a bug to trace
        report_error(f"cannot load {target}: {exc}")
        return EXIT_USAGE
    if worker is None:
        return EXIT_FAILED
    try:
        worker = _apply_options(worker, args, token)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    assert isinstance(worker, Worker)
    return serve(worker, target, link)


def serve(worker: Worker, label: str, link: Any = None) -> int:
    """Print the banner, run *worker* until it stops, report; return the exit status.

    *link* (a supervised child's :class:`~orbit_sync._supervisor.ChildLink`) reports the
    worker's health to the supervisor and applies the recycling limits.
    """
    if link is not None:
        try:
            link.attach(worker)
        except ValueError as exc:  # a recycling limit this process cannot meet
            # The supervisor's own option: it says so once, for all its processes.
            _last_error[:] = [f"error: {exc}"]
            return EXIT_USAGE
        if link.stop_requested:
            report_error("asked to stop before the worker started: not starting")
            return EXIT_OK
    _banner(worker, label, link)
    said = _SaidAtStop(worker.client)
    worker.options.logger.addFilter(said)
    try:
        report = worker.run()
    except Exception as exc:
        # The worker's errors never carry secrets (errors.py); show the type and message.
        status = exit_status_for(exc)
        hint = refused_credentials(exc, worker.client)
        why = f"; {hint}" if hint else ""
        report_error(f"worker stopped on {type(exc).__name__}: {exc}{why} (exit {status})")
        if status == EXIT_FAILED:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        return status
    finally:
        worker.options.logger.removeFilter(said)
    forced = bool(not report.drained or report.abandoned or report.unreported)
    status = EXIT_FORCED if forced else EXIT_OK
    report_error(
        f"worker stopped (drained={report.drained}, cancelled={len(report.cancelled)},"
        f" abandoned={len(report.abandoned)}, unreported={len(report.unreported)}; exit {status})"
    )
    return status


class _SaidAtStop(logging.Filter):
    """Drops the worker's own log line about a refusal of the credentials: the line the command
    prints as the worker stops says the same, and what the refusal means (one line, not two)."""

    def __init__(self, client: object) -> None:
        super().__init__()
        self._client = client

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(
            isinstance(arg, BaseException) and refused_credentials(arg, self._client)
            for arg in args
        )


def exit_status_for(exc: BaseException) -> int:
    """The exit status for the error that stopped a worker."""
    if isinstance(exc, ServerUnreachable):
        return EXIT_UNREACHABLE
    if isinstance(exc, HTTPError) and exc.status_code in (401, 403):
        return EXIT_AUTH
    if isinstance(exc, WorkerError) and exc.code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return EXIT_AUTH
    if isinstance(exc, WorkerProtocolError | WorkerError | HTTPError):
        return EXIT_PROTOCOL
    return EXIT_FAILED


def refused_credentials(exc: BaseException, client: object) -> str | None:
    """What a refusal of the credentials means and which token was used (named by where it came
    from, never shown); None when *exc* is not such a refusal."""
    source = "the module's client"
    if isinstance(client, Client):
        source = token_source(client)
        if sends_token(client, os.environ.get("ORBIT_TOKEN")):
            source = "$ORBIT_TOKEN"  # a module that read the variable itself
    code = exc.code if isinstance(exc, WorkerError) else None
    status = exc.status_code if isinstance(exc, HTTPError) else None
    if status == 401 or code == "UNAUTHENTICATED":
        return (
            f"the server does not accept the token from {source} (401: it does not know this "
            "token: one of another server, expired, revoked, or not a worker token)"
        )
    if status == 403 or code == "PERMISSION_DENIED":
        return (
            f"the server knows the token from {source} but it lacks a permission (403: it "
            "needs the workers:connect scope and access to this queue)"
        )
    return None


def _export(args: argparse.Namespace) -> None:
    """Put the command line's connection settings where ``Client.from_env()`` looks."""
    if args.url is not None:
        os.environ["ORBIT_URL"] = args.url
    if args.queue is not None:
        os.environ["ORBIT_QUEUE_ID"] = args.queue
    if args.token_file is not None:
        # The file named on the command line wins over a token inherited in the environment.
        os.environ.pop("ORBIT_TOKEN", None)
        os.environ["ORBIT_TOKEN_FILE"] = os.path.abspath(args.token_file)


def load(target: str, module_name: str, attribute: str) -> Any:
    """The Worker *target* names (calling a factory), or None after printing why not. Raises
    :class:`SettingError` or :class:`_Misuse` for a mistake in the module's configuration."""
    from .worker import Worker

    # Like `python -m`, let the current directory's modules be found.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        _failed(target, exc, module_name, f"cannot load {target}: ")
        return None
    try:
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        report_error(f"cannot load {target}: {exc}")
        return None
    if isinstance(obj, Worker):
        return obj
    if not callable(obj):
        report_error(f"{target} is a {type(obj).__name__}, not an orbit_sync.worker.Worker")
        return None
    if _needs_arguments(obj):
        report_error(
            f"{target} is a function that takes arguments (a handler?), not a Worker or a "
            "factory: point at the Worker the handler is registered on, or at a function "
            "without arguments that returns one"
        )
        return None
    try:
        made = obj()
    except Exception as exc:
        _failed(target, exc, module_name, f"cannot load {target}: {attribute}() raised ")
        return None
    if not isinstance(made, Worker):
        report_error(
            f"{target}() returned a {type(made).__name__}, not an orbit_sync.worker.Worker"
        )
        return None
    return made


class _Misuse(ValueError):
    """orbit-sync refused what the worker module asked of it (a handler's ``time_limit=0``, a
    handler registered twice, ``capacity=0``): configuration, reported in one line, exit 2."""


#: The package's own directory: an error raised in there at import is the API refusing a value.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def misuse(exc: BaseException) -> bool:
    """Whether *exc* is orbit-sync refusing a value it was given (a ``ValueError`` or
    ``TypeError`` raised inside the package), not a bug of the code that called it."""
    if not isinstance(exc, ValueError | TypeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE)


def _failed(target: str, exc: Exception, module_name: str, prefix: str) -> None:
    """Report why importing the module (or calling its factory) failed: raise a mistake in its
    configuration, else print one line naming where (the traceback at DEBUG)."""
    if isinstance(exc, SettingError):
        raise exc
    if isinstance(exc, KeyError):
        _raise_unset_variable(exc)
    if misuse(exc):
        raise _Misuse(str(exc)) from exc
    if isinstance(exc, ModuleNotFoundError) and _names_the_target(exc, module_name):
        report_error(f"{prefix}{exc}")  # a typo in the target: nothing of the module ran
        return
    where = "" if isinstance(exc, SyntaxError) else _where(exc, module_name)
    hint = "" if _LOG.isEnabledFor(logging.DEBUG) else "; --log-level DEBUG shows the traceback"
    report_error(f"{prefix}{type(exc).__name__}: {exc}{where}{hint}")
    _LOG.debug("the traceback of %s:", target, exc_info=exc)


def _names_the_target(exc: ModuleNotFoundError, module_name: str) -> bool:
    """The module not found is the target or one of its packages."""
    return bool(exc.name) and f"{module_name}.".startswith(f"{exc.name}.")


#: Where the interpreter's and the installed packages' files are: not the application's.
_LIBRARIES = tuple(
    {
        os.path.abspath(sysconfig.get_paths()[key]) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
    }
)


def _where(exc: BaseException, module_name: str) -> str:
    """`` (FILE, line N, in FUNCTION)`` for the innermost frame of *exc* in the application's
    code (the module's package, or a file outside the interpreter's and the installed packages'),
    else for the innermost one; empty when the failure never reached a file of its own (a
    module not found)."""
    top = module_name.split(".")[0]
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not path.startswith("<") and not os.path.abspath(path).startswith(_PACKAGE):
            frames.append(tb)
        tb = tb.tb_next

    def own(tb: Any) -> bool:
        name = tb.tb_frame.f_globals.get("__name__", "")
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        return name == top or name.startswith(f"{top}.") or not path.startswith(_LIBRARIES)

    # The import machinery's own frame (importlib.import_module) is never where it failed.
    frames = [tb for tb in frames if tb.tb_frame.f_globals.get("__name__") != "importlib"]
    if not frames:
        return ""
    chosen = next((tb for tb in reversed(frames) if own(tb)), frames[-1])
    path = chosen.tb_frame.f_code.co_filename
    relative = os.path.relpath(path)
    shown = path if relative.startswith(os.pardir) else relative
    function = chosen.tb_frame.f_code.co_name
    inside = "" if function == "<module>" else f", in {function}"
    return f" ({shown}, line {chosen.tb_lineno}{inside})"


def _raise_unset_variable(exc: KeyError) -> None:
    """Raise the module's own ``os.environ["ORBIT_..."]`` of a variable that is not set as a
    setting error (one line, exit 2, like ``Client.from_env()``'s) rather than a traceback."""
    name = exc.args[0] if len(exc.args) == 1 else None
    if isinstance(name, str) and name.startswith("ORBIT_") and name not in os.environ:
        raise SettingError(f"{name} is not set (the module reads os.environ[{name!r}])") from None


def _needs_arguments(fn: Any) -> bool:
    """True when *fn* cannot be called without arguments (e.g. a ``(ctx, payload)`` handler)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return False
    required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(
        p.default is p.empty and (p.kind in required or p.kind is p.KEYWORD_ONLY)
        for p in signature.parameters.values()
    )


def _apply_options(worker: Worker, args: argparse.Namespace, token: str | None) -> Worker:
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


#: The listeners orbit-sync ships, in a user's words (the banner names others by class).
_LISTENER_WORDS = {
    "orbit_sync.contrib.health.HealthProbe": "health probe",
    "orbit_sync.contrib.prometheus.PrometheusListener": "Prometheus metrics",
    "orbit_sync.contrib.otel.OpenTelemetryListener": "OpenTelemetry traces",
    "orbit_sync.contrib.django._db.CloseOldConnections": "Django database connections closed"
    " around each task",
}


def _listener_words(listener: object) -> str:
    kind = type(listener)
    return _LISTENER_WORDS.get(f"{kind.__module__}.{kind.__qualname__}", kind.__name__)


def _supervised(link: Any) -> str:
    """What a supervised process does for its supervisor, in a user's words."""
    s = link.settings
    parts = [f"pid {s.supervisor_pid}, which gets this process's health and drains it"]
    limits = []
    if s.max_tasks is not None:
        limits.append(f"{s.max_tasks} tasks")
    if s.max_memory_mb is not None:
        limits.append(f"{s.max_memory_mb} MB RSS")
    if limits:
        parts.append(f"recycled after {' or '.join(limits)}")
    if s.metrics:
        parts.append("metrics in its Prometheus target")
    return "; ".join(parts)


def _banner(worker: Worker, target: str, link: Any = None) -> None:
    """What is about to run, on stderr (stdout stays the application's). Never the token.
    A process replacing another in its supervisor's slot says so in one line: the banner of
    the first one is above it, and is the same."""
    replaces = link.settings.replaces if link is not None else None
    if replaces is not None:
        who = f" {_speaker[0]}" if _speaker else ""
        print(
            f"orbit-sync{who}: worker {target} started again, replacing worker process"
            f" {replaces} (with the settings of the first one's banner)",
            file=sys.stderr,
            flush=True,
        )
        return
    options = worker.options
    registration = worker.registration
    client = worker.client
    server = getattr(client, "base_url", None) or type(client).__name__
    in_process = {key for key, executor in worker.executors.items() if executor == "process"}
    limits = worker.time_limits

    def described(c: Any) -> str:
        key = (c.handler, c.handler_version, c.payload_version)
        limit = limits.get(key)
        return (
            f"{c.handler} ({c.handler_version}/{c.payload_version}"
            f"{', process' if key in in_process else ''}"
            f"{'' if limit is None else f', time limit {limit:g} s'})"
        )

    handlers = ", ".join(described(c) for c in registration.capabilities)
    outbox = options.outbox
    # The supervisor's own listeners are described on their own line, not by class name.
    own = link.attached if link is not None else ()
    listeners = ", ".join(
        _listener_words(x) for x in worker.listeners if not any(x is y for y in own)
    )
    lines = [
        f"orbit-sync {_version()} worker {target} (pid {os.getpid()},"
        f" Python {platform.python_version()})",
        f"  server:    {server}",
        f"  queue:     {registration.queue_id}",
        f"  capacity:  {registration.capacity}, drain timeout {options.drain_timeout:g} s",
        f"  handlers:  {handlers}",
        f"  outbox:    {os.fspath(outbox) if outbox is not None else 'none'}",
        f"  listeners: {listeners or 'none'}",
    ]
    if link is not None:
        lines.append(f"  supervisor: {_supervised(link)}")
    lines.append("SIGTERM or Ctrl-C drains; a second signal stops at once.")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _version() -> str:
    from ._version import __version__

    return __version__
