"""``Client``: where the Orbit server is and how to authenticate; ``dial_worker`` opens a session.

The dial (TCP + TLS + WebSocket upgrade + ``worker.hello``/``worker.welcome``) is bounded by one
deadline (default and cap 8 s, PROTOCOL §1). The token travels only in ``Authorization: Bearer``,
never in the URL, never in a redirect (redirects are reported as ``HTTPError``, not followed), and
never in a ``repr``, log line or exception message.

Proxies: orbit-sync opens its own socket, so ``http_proxy``/``https_proxy``/``no_proxy`` are not
consulted; connections always go directly to the host of ``base_url``.

Trust: without an ``ssl_context``, ``wss://`` uses ``ssl.create_default_context()``, whose
certificate authorities come from the OpenSSL default paths, which the ``SSL_CERT_FILE`` and
``SSL_CERT_DIR`` environment variables replace. Pass an explicit context to pin the trusted CAs.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Final

from . import _codec, _dial, _transport
from ._protocol import call_timeout
from ._seconds import seconds
from .clock import Clock, now_reader
from .connection import CALL_TIMEOUT, READ_IDLE_TIMEOUT, WorkerConnection
from .errors import (
    CallTimeout,
    HTTPError,
    OrbitError,
    WorkerError,
    WorkerProtocolError,
)
from .models import ID_RE, Assignment, CancelNotice, Registration, Welcome, new_message_id

__all__ = [
    "DIAL_TIMEOUT",
    "HANDLER_PROCESS_ENV",
    "Client",
    "DialCut",
    "SettingError",
    "check_base_url",
    "check_environment",
    "queue_id_from_env",
    "read_token_file",
]

log = logging.getLogger("orbit_sync.client")

#: Default and maximum bound of one dial, hello/welcome included (PROTOCOL §1).
DIAL_TIMEOUT: Final = 8.0
CONNECT_PATH: Final = "/v1/worker/connect"

# RFC 6750 b64token, plus the characters opaque tokens commonly use; never whitespace or controls.
_TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/=:!#$%&'*^`|]+")


#: Set (to "1") in the environment of a process-executor child: see :meth:`Client.from_env`.
HANDLER_PROCESS_ENV: Final = "ORBIT_HANDLER_PROCESS"
#: The settings ``from_env`` reads, and others an ORBIT_* variable may legitimately be (so that
#: they are never taken for a misspelling).
_KNOWN_ENV: Final = frozenset(
    (
        "ORBIT_URL",
        "ORBIT_TOKEN",
        "ORBIT_TOKEN_FILE",
        "ORBIT_QUEUE_ID",
        "ORBIT_ADMIN_URL",
        "ORBIT_ADMIN_TOKEN",
        "ORBIT_MOCK_TOKEN",
        "ORBIT_MOCK_ADMIN_TOKEN",
        HANDLER_PROCESS_ENV,
    )
)


class SettingError(ValueError):
    """A missing or malformed ``ORBIT_*`` environment setting; the message names the variable,
    never a token."""


def _check_token(token: str) -> None:
    if not _TOKEN_RE.fullmatch(token):
        # Never echo it: it is a secret.
        raise ValueError("token must be a non-empty bearer token without spaces or controls")


def check_base_url(
    base_url: str, what: str = "base_url"
) -> tuple[urllib.parse.SplitResult, str, int]:
    """The parts, host and port of a server URL, ``ws://host[:port][/prefix]`` or ``wss://...``;
    ``ValueError`` saying what is wrong with *what* (never echoing user info)."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(f"{what} must start with ws:// or wss://")
    if "?" in base_url or "#" in base_url:
        raise ValueError(f"{what} must not carry a query string or fragment")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError(f"{what} must not carry credentials")
    if not parts.hostname:
        raise ValueError(f"{what} needs a host")
    try:
        port = parts.port or (443 if parts.scheme == "wss" else 80)
    except ValueError:
        raise ValueError(f"{what} has an invalid port") from None
    return parts, parts.hostname, port


def check_environment(environ: Mapping[str, str]) -> None:
    """Raise :class:`SettingError` for an ``ORBIT_*`` setting that is wrong whoever reads it: a
    malformed ``ORBIT_URL`` or ``ORBIT_QUEUE_ID``, both ``ORBIT_TOKEN`` and ``ORBIT_TOKEN_FILE``,
    or a setting that is missing while a misspelling of it (``ORBIT_URI``) is set. Settings that
    are merely absent pass: a program may configure its client without them."""
    url = environ.get("ORBIT_URL", "")
    if url:
        try:
            check_base_url(url, "ORBIT_URL")
        except ValueError as exc:
            raise SettingError(str(exc)) from None
    if environ.get("ORBIT_TOKEN") and environ.get("ORBIT_TOKEN_FILE"):
        raise SettingError("set only one of ORBIT_TOKEN and ORBIT_TOKEN_FILE")
    queue_id = environ.get("ORBIT_QUEUE_ID", "")
    if queue_id and not ID_RE.fullmatch(queue_id):
        raise SettingError(_QUEUE_ID_FORMAT)
    for name in ("ORBIT_URL", "ORBIT_QUEUE_ID"):
        if not environ.get(name) and _misspelling((name,), environ):
            raise SettingError(_not_set((name,), environ))
    tokens = ("ORBIT_TOKEN", "ORBIT_TOKEN_FILE")
    if not any(environ.get(name) for name in tokens) and _misspelling(tokens, environ):
        raise SettingError(_not_set(tokens, environ))


_QUEUE_ID_FORMAT: Final = "ORBIT_QUEUE_ID must be 32 lowercase hex characters"


def queue_id_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``$ORBIT_QUEUE_ID``: the queue of a ``Worker`` built without ``queue_id``, as
    :meth:`Client.from_env` reads the server and the token.

    *environ* defaults to ``os.environ``. A missing or malformed value raises
    :class:`SettingError` naming the variable (and its likely misspelling when one is set).
    """
    env = os.environ if environ is None else environ
    queue_id = env.get("ORBIT_QUEUE_ID", "")
    if not queue_id:
        raise SettingError(f"no queue_id given and {_not_set(('ORBIT_QUEUE_ID',), env)}")
    if not ID_RE.fullmatch(queue_id):
        raise SettingError(_QUEUE_ID_FORMAT)
    return queue_id


def _misspelling(names: tuple[str, ...], environ: Mapping[str, str]) -> str | None:
    """A set variable whose name is a typo of one of *names*: at most two letters off (so
    ``ORBIT_URI`` is one, and another program's ``ORBIT_MOCK_TOKEN`` is not)."""
    for name in names:
        for key in environ:
            if key != name and key not in _KNOWN_ENV and _edits(key.upper(), name) <= 2:
                return key
    return None


def _edits(a: str, b: str) -> int:
    """The Levenshtein distance between *a* and *b* (insertions, deletions, substitutions)."""
    if abs(len(a) - len(b)) > 2:
        return 3  # more than we ever accept: skip the table
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _not_set(names: tuple[str, ...], environ: Mapping[str, str]) -> str:
    typo = _misspelling(names, environ)
    hint = f" ({typo} is set: a misspelling?)" if typo else ""
    either = f" (or {names[1]})" if len(names) > 1 else ""
    return f"{names[0]}{either} is not set{hint}"


class DialCut:
    """Lets another thread end a :meth:`Client.dial_worker` in progress (``cut()``): the dial
    then raises ``CallTimeout`` at once instead of running to its deadline. A dial started after
    ``cut()`` ends at once too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._guard: _dial.DialGuard | None = None
        self._cut = False

    def cut(self) -> None:
        """End the dial in progress, if any, and every later one."""
        with self._lock:
            self._cut = True
            guard = self._guard
        if guard is not None:
            guard.cut()

    @property
    def is_cut(self) -> bool:
        """True once :meth:`cut` was called."""
        return self._cut

    def _attach(self, guard: _dial.DialGuard | None) -> None:
        with self._lock:
            self._guard = guard
            cut = self._cut
        if cut and guard is not None:
            guard.cut()


class Client:
    """An Orbit endpoint and its credentials.

    ``base_url`` is ``ws://host[:port][/prefix]`` (development) or ``wss://...`` (production),
    without query string, fragment or user info. For ``wss://`` the ``ssl_context`` (default:
    ``ssl.create_default_context()``, which honours ``SSL_CERT_FILE``/``SSL_CERT_DIR``) must
    verify certificates and host names; there is no switch to skip verification. The context is
    the caller's mutable object: it is checked again at every dial, and a dial with a context
    weakened since raises ``ValueError`` before connecting. Host names are matched against the
    certificate's subjectAltName only: each dial sets ``hostname_checks_common_name = False`` on
    the context, so a certificate naming the host in its common name alone is refused.
    """

    def __init__(
        self, base_url: str, token: str, *, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        if not isinstance(base_url, str):
            raise TypeError("base_url must be a str")
        if not isinstance(token, str):
            raise TypeError("token must be a str")
        _check_token(token)
        parts, host, port = check_base_url(base_url)
        if parts.scheme == "ws" and ssl_context is not None:
            raise ValueError("ssl_context is only for wss:// URLs")
        if ssl_context is not None:
            if not isinstance(ssl_context, ssl.SSLContext):
                raise TypeError("ssl_context must be an ssl.SSLContext")
            _check_verifying(ssl_context)
        elif parts.scheme == "wss":
            ssl_context = ssl.create_default_context()
        self._base_url = base_url.rstrip("/")
        self._url = urllib.parse.urlunsplit(
            (parts.scheme, parts.netloc, parts.path.rstrip("/") + CONNECT_PATH, "", "")
        )
        self._host = host
        self._port = port
        self._token = token
        #: Where the token came from, named when the server refuses it (never the token itself);
        #: set by from_env() and by the command line, which know.
        self._token_source = "the token given to Client()"
        self._ssl_context = ssl_context

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Client:
        """A client for ``$ORBIT_URL`` with the token in ``$ORBIT_TOKEN`` (or in the file named
        by ``$ORBIT_TOKEN_FILE``, e.g. a mounted secret; set only one of the two).

        *environ* defaults to ``os.environ``. A missing or bad setting raises
        :class:`SettingError` (a ``ValueError``) naming the variable, never its token, and the
        variable's likely misspelling when one is set (``ORBIT_URI``). In a process-executor
        child (which is given no token and never connects) the missing token is not an error,
        so a module-level ``Worker(Client.from_env(), ...)`` imports there.
        """
        env = os.environ if environ is None else environ
        check_environment(env)
        url = env.get("ORBIT_URL", "")
        if not url:
            raise SettingError(_not_set(("ORBIT_URL",), env))
        token = env.get("ORBIT_TOKEN", "")
        token_file = env.get("ORBIT_TOKEN_FILE", "")
        if env.get(HANDLER_PROCESS_ENV) == "1":
            # A process-executor child imports the worker's module to find its handler, but
            # never connects: it gets no token (nor reads the token file), and this one opens
            # nothing.
            token, token_file = "handler-process-has-no-token", ""
        elif token_file:
            try:
                token = read_token_file(token_file)
            except ValueError as exc:
                raise SettingError(f"ORBIT_TOKEN_FILE: {exc}") from None
        elif not token:
            raise SettingError(_not_set(("ORBIT_TOKEN", "ORBIT_TOKEN_FILE"), env))
        try:
            _check_token(token)
        except ValueError as exc:
            name = "ORBIT_TOKEN_FILE" if token_file else "ORBIT_TOKEN"
            raise SettingError(f"{name}: {exc}") from None
        client = cls(url, token, ssl_context=ssl_context)
        client._token_source = f"$ORBIT_TOKEN_FILE ({token_file})" if token_file else "$ORBIT_TOKEN"
        return client

    @property
    def base_url(self) -> str:
        """The server's base URL (no credentials in it)."""
        return self._base_url

    def __repr__(self) -> str:
        return f"Client({self._base_url!r}, token=<redacted>)"

    def dial_worker(
        self,
        registration: Registration,
        timeout: float = DIAL_TIMEOUT,
        *,
        on_cancel: Callable[[CancelNotice], None] | None = None,
        on_assignment: Callable[[Assignment], None] | None = None,
        clock: Clock | Callable[[], float] | None = None,
        max_call_timeout: float = CALL_TIMEOUT,
        read_idle_timeout: float = READ_IDLE_TIMEOUT,
        cut: DialCut | None = None,
    ) -> WorkerConnection:
        """Connect, say hello, check the welcome (PROTOCOL §5.1, §5.2); return the connection.

        ``timeout`` bounds the whole dial (capped at 8 s); past it ``CallTimeout`` is raised. A
        refused upgrade raises ``HTTPError`` (``.status_code``: 401 bad token, 403 missing scope,
        3xx redirect, never followed); an ``error`` answering the hello raises ``WorkerError``; a
        server breaking the protocol raises ``WorkerProtocolError``; a network or TLS failure
        raises ``WorkerDisconnected``.

        ``task.cancel`` pushes (only with ``registration.cancellation_notifications``) go to
        ``on_cancel``, called on the connection's reader thread: it must return quickly and must
        not call request methods of this connection (it would block the reader that delivers their
        answers); exceptions it raises are logged and ignored. Without ``on_cancel`` they are
        queued for :meth:`WorkerConnection.next_cancel`.

        ``task.assign`` pushes go to ``on_assignment`` when given, under the same rules (reader
        thread, quick, no requests of this connection); use it when the consumer may fall behind a
        burst of up to ``registration.capacity`` assignments. An exception it raises is logged and
        the assignment is dropped: unstarted, the reservation returns to the queue when its lease
        expires on the server. Without ``on_assignment`` they are queued for
        :meth:`WorkerConnection.next_assignment`, at most 8 unread (PROTOCOL §10: a 9th closes the
        connection with ``WorkerBackpressure``).

        ``clock`` (an :class:`orbit_sync.Clock`, real time when left out) anchors every lease's
        local ``deadline`` (pass the same clock to ``lease.may_run()``); a worker given the same
        clock runs its schedule on it. A plain function returning seconds still works, with a
        ``DeprecationWarning``, until the next release. ``max_call_timeout`` (≤ 10 s) and
        ``read_idle_timeout`` (≤ 60 s) may only tighten the protocol's bounds. ``cut`` (a
        :class:`DialCut`) lets another thread end the dial early (``CallTimeout``).
        """
        if not isinstance(registration, Registration):
            raise TypeError("registration must be a Registration")
        bound = seconds(timeout, "timeout", positive=True, cap=DIAL_TIMEOUT)
        max_call = call_timeout(max_call_timeout, "max_call_timeout")
        idle = seconds(read_idle_timeout, "read_idle_timeout", positive=True, cap=READ_IDLE_TIMEOUT)
        if on_cancel is not None:
            if not callable(on_cancel):
                raise TypeError("on_cancel must be callable")
            if not registration.cancellation_notifications:
                raise ValueError("on_cancel needs registration.cancellation_notifications=True")
        if on_assignment is not None and not callable(on_assignment):
            raise TypeError("on_assignment must be callable")
        lease_clock = now_reader(clock)
        if cut is not None and not isinstance(cut, DialCut):
            raise TypeError("cut must be a DialCut")
        if self._ssl_context is not None:
            # The caller may have weakened its context since it was given: verification off
            # must never reach a socket.
            _check_verifying(self._ssl_context)
        hello_id = new_message_id()
        hello = _codec.encode_request("worker.hello", hello_id, None, registration)
        log.debug("dialing %s (hello message_id=%s)", self._base_url, hello_id)
        guard = _dial.DialGuard(bound)
        if cut is not None:
            cut._attach(guard)
        transport: _transport.Transport | None = None
        try:
            transport = _dial.connect(
                self._url,
                host=self._host,
                port=self._port,
                ssl_context=self._ssl_context,
                headers={"Authorization": f"Bearer {self._token}"},
                subprotocol=_codec.SUBPROTOCOL,
                guard=guard,
            )
            welcome = _handshake(transport, hello, hello_id, guard)
        except BaseException as exc:
            guard.stop()
            if cut is not None:
                cut._attach(None)
            if transport is not None:
                transport.abort(None)
                transport.close()
            # Once the deadline has passed, a broken read or write is its consequence; a complete
            # refusal (HTTP status, error answering the hello) is still reported as itself.
            timed_out = isinstance(exc, CallTimeout) or (
                guard.fired
                and isinstance(exc, OrbitError)
                and not isinstance(exc, HTTPError | WorkerError)
            )
            if timed_out:
                raise CallTimeout(f"dial did not complete within {bound:g} s") from None
            raise
        guard.stop()
        if cut is not None:
            cut._attach(None)
        if guard.fired:
            # The deadline passed as the dial finished: its socket was shut down.
            transport.close()
            raise CallTimeout(f"dial did not complete within {bound:g} s")
        # From now on only our own deadlines: over TLS a socket timeout breaks a read beside a send.
        transport.set_timeout(None)
        log.debug("welcome session_id=%s epoch=%s", welcome.session_id, welcome.epoch)
        return WorkerConnection(
            transport,
            welcome,
            registration,
            on_cancel=on_cancel,
            on_assignment=on_assignment,
            clock=lease_clock,
            max_call_timeout=max_call,
            read_idle_timeout=idle,
        )


def _handshake(
    transport: _transport.Transport, hello: str, hello_id: str, guard: _dial.DialGuard
) -> Welcome:
    """Send ``worker.hello`` and read its answer, under the dial's deadline."""
    with _dial.dial_stage("hello"):
        transport.set_timeout(guard.remaining())
        transport.send_text(hello)  # WorkerDisconnected on a network failure; a bug stays itself
        transport.set_timeout(guard.remaining())
        raw = transport.recv_message()
    try:
        return _codec.decode_welcome(raw, hello_id)
    except WorkerProtocolError:
        raise
    except OrbitError as exc:
        exc.message_id = None  # the hello is not an operation to re-send
        raise


def _check_verifying(context: ssl.SSLContext) -> None:
    if context.verify_mode != ssl.CERT_REQUIRED or not context.check_hostname:
        raise ValueError("ssl_context must verify certificates and host names")


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token stored in *path* (surrounding whitespace, such as a final newline, removed).

    Raises ``ValueError`` naming the file when it cannot be read or holds no token; the file's
    content is never part of a message.
    """
    try:
        with open(path, encoding="utf-8") as file:
            # A token is at most a few hundred bytes: a bounded read of a wrong path (a device, a
            # huge file) fails fast instead of filling memory.
            text = file.read(8192)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise ValueError(f"cannot read the token file {os.fspath(path)}: {reason}") from None
    token = text.strip()
    if not token or not _TOKEN_RE.fullmatch(token):
        raise ValueError(f"the token file {os.fspath(path)} does not hold one bearer token")
    return token


# Where a client's token came from, and the token itself, for the command lines and the Django
# integration: functions of this module rather than methods, so that neither is part of Client's
# public API (nor of any repr).


def token_source(client: Client) -> str:
    """Where *client*'s token came from (named when the server refuses it; never the token)."""
    return client._token_source


def set_token_source(client: Client, source: str) -> None:
    """Record where *client*'s token came from (``$ORBIT_TOKEN``, ``--token-file PATH``...)."""
    client._token_source = source


def sends_token(client: Client, token: str | None) -> bool:
    """Whether *client* sends *token* (compared in constant time)."""
    return token is not None and hmac.compare_digest(client._token.encode(), token.encode())


def same_credentials(client: Client, url: str) -> Client:
    """A client for *url* with *client*'s token and its source: the same server elsewhere."""
    moved = Client(url, client._token)
    moved._token_source = client._token_source
    return moved
