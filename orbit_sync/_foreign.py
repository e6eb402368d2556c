"""Foreign exceptions and the error each becomes: one table for websocket-client, ``ssl``,
``socket``/``OSError`` and ``json``.

A site that catches a foreign exception raises ``mapped(exc, ...) from kept(exc)``: the table
picks our error type (the first row the exception is an instance of: most specific rows first)
and whether the foreign exception stays attached as the cause. It stays unless it carries text
we must not pass on: a server's answer or a frame's content can echo a token or a lease secret,
and an exception's message, its ``doc``/``object`` attribute or its traceback would carry it
into logs. Those rows drop it (``from None``) and the site's own message, built from safe parts
only, says what happened.

Timeouts are one more rule that is not a type: a dial whose deadline fired reports ``CallTimeout``
whatever the socket raised; the sites check their guard before asking the table.
"""

from __future__ import annotations

import json
import ssl
from typing import Any

import attrs
import websocket

from .errors import (
    CallTimeout,
    FrameError,
    HTTPError,
    OrbitError,
    WorkerDisconnected,
    WorkerProtocolError,
)


@attrs.frozen
class Row:
    """One foreign exception type, ours for it, and whether its cause may be kept (and why)."""

    foreign: type[BaseException]
    ours: type[OrbitError]
    keep_cause: bool
    why: str


TABLE: tuple[Row, ...] = (
    # websocket-client (the opening handshake only: frames are ours, see _transport).
    Row(
        websocket.WebSocketBadStatusException,
        HTTPError,
        False,
        "its message quotes the answer's status line, headers and body",
    ),
    Row(
        websocket.WebSocketTimeoutException,
        CallTimeout,
        True,
        "says only that the socket timed out",
    ),
    Row(
        websocket.WebSocketConnectionClosedException,
        WorkerDisconnected,
        True,
        "says only that the socket closed",
    ),
    Row(
        websocket.WebSocketException,
        WorkerProtocolError,
        False,
        "a malformed upgrade answer: its message may quote the answer's headers",
    ),
    # ssl: before OSError (SSLError is one).
    Row(
        ssl.SSLCertVerificationError,
        WorkerDisconnected,
        True,
        "names the verification failure and the host, both the caller's own",
    ),
    Row(ssl.SSLError, WorkerDisconnected, True, "an OpenSSL reason code, no traffic"),
    # socket: a timeout (socket.timeout is TimeoutError) before any other OSError.
    Row(TimeoutError, CallTimeout, True, "an errno and its text"),
    Row(OSError, WorkerDisconnected, True, "an errno and its text"),
    # json and text decoding of frames: the document is in the exception.
    Row(
        json.JSONDecodeError,
        FrameError,
        False,
        "its doc attribute holds the whole frame, which may carry a token or a secret",
    ),
    Row(
        UnicodeError,
        FrameError,
        False,
        "its object attribute holds the frame's bytes, which may carry a token or a secret",
    ),
    Row(RecursionError, FrameError, True, "says only that nesting went too deep"),
)


def row(exc: BaseException) -> Row:
    """The row of *exc*; LookupError for an exception the table does not map (a bug)."""
    for entry in TABLE:
        if isinstance(exc, entry.foreign):
            return entry
    raise LookupError(f"no mapping for {type(exc).__name__}")


def mapped(exc: BaseException, *args: Any) -> OrbitError:
    """Our error for foreign *exc*, built from *args*. Raise it as
    ``raise mapped(exc, ...) from kept(exc)`` inside the ``except`` clause."""
    return row(exc).ours(*args)


def kept(exc: BaseException) -> BaseException | None:
    """*exc* when the table keeps it as the cause of our error, else None (``from None``)."""
    return exc if row(exc).keep_cause else None
