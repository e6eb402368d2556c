"""What ``orbit-sync worker`` tells whoever runs it: its exit statuses, and its one-line reports
on standard error (``orbit-sync: ...``).

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

import os
import sys

from .client import Client, sends_token, token_source
from .errors import HTTPError, ServerUnreachable, WorkerError, WorkerProtocolError

__all__ = [
    "EXIT_AUTH",
    "EXIT_FAILED",
    "EXIT_FORCED",
    "EXIT_OK",
    "EXIT_PROTOCOL",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "exit_status_for",
    "last_error",
    "record_error",
    "refused_credentials",
    "report_error",
    "say",
    "speak_as",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_FORCED = 3
EXIT_AUTH = 4
EXIT_PROTOCOL = 5
EXIT_UNREACHABLE = 6

#: The last line :func:`report_error` printed: a supervised child tells its supervisor.
_last_error: list[str] = []


def last_error() -> str | None:
    """The last line :func:`report_error` printed (what a supervisor repeats about a child)."""
    return _last_error[0] if _last_error else None


def record_error(message: str) -> None:
    """Make *message* the :func:`last_error` without printing it (the supervisor says it)."""
    _last_error[:] = [message]


#: Who this process is in its lines, when it is one of several writing to one standard error.
_speaker: list[str] = []


def speak_as(who: str) -> None:
    """Name this process in each later :func:`report_error` line (``orbit-sync <who>: ...``)."""
    _speaker[:] = [who]


def say(message: str) -> None:
    """One ``orbit-sync: ...`` line on standard error that is not an error."""
    who = f" {_speaker[0]}" if _speaker else ""
    print(f"orbit-sync{who}: {message}", file=sys.stderr, flush=True)


def report_error(message: str) -> None:
    """One ``orbit-sync: ...`` line on standard error."""
    record_error(message)
    say(message)


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
