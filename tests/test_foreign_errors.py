"""The table of foreign exceptions: each one websocket-client, ssl, socket and json can raise at us
becomes one of our errors, keeping its cause unless that cause can carry a secret."""

from __future__ import annotations

import json
import socket
import ssl
import traceback
from typing import Any

import pytest
import websocket
from _scripted import TOKEN, ScriptedServer, registration

from orbit_sync import _foreign, _json
from orbit_sync.client import Client
from orbit_sync.errors import (
    CallTimeout,
    FrameError,
    HTTPError,
    OrbitError,
    WorkerDisconnected,
    WorkerProtocolError,
)
from orbit_sync.models import new_secret

SECRET = new_secret()


def _websocket_exceptions() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    todo: list[type[BaseException]] = [websocket.WebSocketException]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return found


def _instance(cls: type[BaseException]) -> BaseException:
    if issubclass(cls, websocket.WebSocketBadStatusException):
        return cls(f"Handshake status 401 Unauthorized -+-+- {{}} -+-+- {SECRET}", 401)
    return cls(f"answer was {SECRET}")


#: Every foreign exception we catch, with the error it must become and whether its cause stays.
CASES: list[tuple[BaseException, type[OrbitError], bool]] = [
    (_instance(websocket.WebSocketBadStatusException), HTTPError, False),
    (websocket.WebSocketTimeoutException("timed out"), CallTimeout, True),
    (websocket.WebSocketConnectionClosedException("closed"), WorkerDisconnected, True),
    (websocket.WebSocketProtocolException(SECRET), WorkerProtocolError, False),
    (websocket.WebSocketAddressException(SECRET), WorkerProtocolError, False),
    (websocket.WebSocketException(SECRET), WorkerProtocolError, False),
    (ssl.SSLCertVerificationError(1, "certificate verify failed"), WorkerDisconnected, True),
    (ssl.SSLError(1, "wrong version number"), WorkerDisconnected, True),
    (ssl.SSLEOFError(8, "EOF occurred"), WorkerDisconnected, True),
    (TimeoutError("timed out"), CallTimeout, True),
    (socket.gaierror(-2, "Name or service not known"), WorkerDisconnected, True),
    (ConnectionRefusedError(111, "Connection refused"), WorkerDisconnected, True),
    (ConnectionResetError(104, "Connection reset by peer"), WorkerDisconnected, True),
    (BrokenPipeError(32, "Broken pipe"), WorkerDisconnected, True),
    (OSError(9, "Bad file descriptor"), WorkerDisconnected, True),
    (json.JSONDecodeError("Expecting value", f'{{"token": "{SECRET}", x}}', 30), FrameError, False),
    (UnicodeDecodeError("utf-8", SECRET.encode() + b"\xff", 43, 44, "bad"), FrameError, False),
    (UnicodeEncodeError("utf-8", SECRET + "\ud800", 43, 44, "surrogate"), FrameError, False),
    (RecursionError("maximum recursion depth exceeded"), FrameError, True),
]


@pytest.mark.parametrize(
    ("exc", "ours", "keeps"), CASES, ids=[f"{type(c[0]).__name__}-{i}" for i, c in enumerate(CASES)]
)
def test_each_foreign_exception_is_mapped(
    exc: BaseException, ours: type[OrbitError], keeps: bool
) -> None:
    """Each foreign exception becomes its error type; the cause is kept only where safe."""
    args: tuple[Any, ...] = (401,) if ours is HTTPError else ("what happened",)
    with pytest.raises(ours) as info:
        try:
            raise exc
        except BaseException as caught:
            raise _foreign.mapped(caught, *args) from _foreign.kept(caught)
    error = info.value
    assert type(error) is ours
    assert (error.__cause__ is exc) is keeps
    if not keeps:
        assert error.__cause__ is None and error.__suppress_context__
        assert SECRET not in "".join(traceback.format_exception(error))


@pytest.mark.parametrize("cls", _websocket_exceptions(), ids=lambda c: c.__name__)
def test_every_websocket_client_exception_has_a_row(cls: type[BaseException]) -> None:
    """No exception class of websocket-client (subclasses included) is left unmapped."""
    assert _foreign.row(_instance(cls)).ours is not None


def test_rows_come_most_specific_first() -> None:
    """No row is shadowed by an earlier, more general one."""
    for i, later in enumerate(_foreign.TABLE):
        for earlier in _foreign.TABLE[:i]:
            assert not issubclass(later.foreign, earlier.foreign), (later, earlier)


def test_an_unmapped_exception_is_a_bug_not_a_guess() -> None:
    """An exception the table does not know is refused, never mapped to a default."""
    with pytest.raises(LookupError):
        _foreign.row(KeyError("x"))


def test_bad_json_keeps_the_frame_out_of_the_error() -> None:
    """A frame that is not JSON raises FrameError without the frame (its doc) in the chain."""
    with pytest.raises(FrameError) as info:
        _json.loads(f'{{"token": "{SECRET}", oops}}')
    assert info.value.__cause__ is None
    assert SECRET not in "".join(traceback.format_exception(info.value))


def test_a_refused_dial_keeps_the_socket_error_as_its_cause() -> None:
    """Nothing listening: WorkerDisconnected, caused by the OSError that said so."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: the dial is refused
        with pytest.raises(WorkerDisconnected) as info:
            Client(f"ws://127.0.0.1:{port}", TOKEN).dial_worker(registration())
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


def test_a_refused_upgrade_drops_the_answer() -> None:
    """A 401 whose body echoes the token: HTTPError(401), with no cause quoting the answer."""
    with ScriptedServer(status=401) as server, pytest.raises(HTTPError) as info:
        Client(server.url, TOKEN).dial_worker(registration())
    assert info.value.status_code == 401
    assert info.value.__cause__ is None
    assert TOKEN not in "".join(traceback.format_exception(info.value))
