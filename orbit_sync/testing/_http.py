"""The first bytes of a connection: a strict HTTP/1.1 request head, an optional body, answers.

The mock server reads every request head itself, before websockets sees the connection: an
upgrade request is then handed to websockets' sans-I/O handshake, while an admin request (which
may carry a JSON body, something websockets' handshake parser refuses) is answered here. Every
read is bounded in size and by a deadline, so a silent or slow peer costs one thread and one
descriptor for a short, known time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import http
import re
import socket
import ssl
from collections.abc import Iterable, Mapping
from typing import Any

from websockets.datastructures import Headers
from websockets.http11 import Response

from .. import _json
from .._realtime import monotonic

__all__ = [
    "MAX_HEAD_BYTES",
    "AdminExchange",
    "HttpError",
    "HttpRequest",
    "answer_and_close",
    "body_length",
    "json_response",
    "linger_close",
    "parse_head",
    "read_body",
    "read_head",
    "send_all",
    "serialize",
    "text_response",
]

#: Request line plus headers. An upgrade needs well under 2 KiB; curl's admin requests too.
MAX_HEAD_BYTES = 16 * 1024
_MAX_HEADERS = 64
_METHOD = re.compile(rb"[A-Z]{1,16}")
_TARGET = re.compile(rb"/[\x21-\x7e]*")
_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,64}")
_LENGTH = re.compile(r"[0-9]{1,12}")


class HttpError(Exception):
    """A request that cannot be served: the status to answer and a message with no request data."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclasses.dataclass(frozen=True)
class HttpRequest:
    """One admin request: websockets' ``Request`` attributes (``path`` with its query,
    ``headers``, ``method``, ``protocol``) plus the ``body`` bytes (empty when none was sent)."""

    method: str
    path: str
    headers: Headers
    body: bytes = b""
    protocol: str = "HTTP/1.1"


class AdminExchange:
    """What an admin handler gets as its *connection*: :meth:`respond` builds a plain-text answer,
    as websockets' ``ServerConnection.respond`` does; ``remote_address`` is the peer's."""

    def __init__(self, remote_address: Any) -> None:
        self.remote_address = remote_address

    def respond(self, status: int, text: str) -> Response:
        """A plain-text answer with *status* (``Connection: close``)."""
        return text_response(status, text)


def read_head(sock: socket.socket, deadline: float) -> tuple[bytes, bytes]:
    """Read up to the blank line ending a request head; returns ``(head, bytes after it)``.

    Raises ``TimeoutError`` past *deadline* (monotonic), ``EOFError`` when the peer closes first,
    :class:`HttpError` (431) when the head grows past :data:`MAX_HEAD_BYTES`."""
    buf = bytearray()
    searched = 0
    while True:
        end = buf.find(b"\r\n\r\n", max(0, searched - 3))
        if end >= 0:
            return bytes(buf[: end + 4]), bytes(buf[end + 4 :])
        if len(buf) > MAX_HEAD_BYTES:
            raise HttpError(431, "the request head is too large")
        searched = len(buf)
        chunk = _recv(sock, deadline, 4096)
        if not chunk:
            raise EOFError("the peer closed before sending a request head")
        buf += chunk


def parse_head(head: bytes) -> tuple[str, str, str, Headers]:
    """``(method, target, protocol, headers)`` of a request head (as :func:`read_head` returns)."""
    lines = head[:-4].split(b"\r\n")
    parts = lines[0].split(b" ")
    if (
        len(parts) != 3
        or not _METHOD.fullmatch(parts[0])
        or not _TARGET.fullmatch(parts[1])
        or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0")
    ):
        raise HttpError(400, "malformed request line")
    if len(lines) - 1 > _MAX_HEADERS:
        raise HttpError(431, f"more than {_MAX_HEADERS} header fields")
    headers = Headers()
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        # No obsolete line folding, no space before the colon (RFC 9112, sections 5.1 and 5.2).
        if not colon or not _NAME.fullmatch(name) or b"\r" in value or b"\n" in value:
            raise HttpError(400, "malformed header field")
        headers[name.decode("ascii")] = value.strip(b" \t").decode("latin-1")
    return parts[0].decode("ascii"), parts[1].decode("ascii"), parts[2].decode("ascii"), headers


def body_length(headers: Headers, limit: int) -> int:
    """The body size ``Content-Length`` declares (0 without one), checked before any body byte
    is read: transfer codings are refused (411), and bodies over *limit* (413)."""
    if "Transfer-Encoding" in headers:
        raise HttpError(411, "transfer codings are not supported: send Content-Length")
    values = set(headers.get_all("Content-Length"))
    if not values:
        return 0
    if len(values) != 1:
        raise HttpError(400, "conflicting Content-Length values")
    (value,) = values
    if not _LENGTH.fullmatch(value):
        raise HttpError(400, "Content-Length must be a decimal number")
    length = int(value)
    if length > limit:
        raise HttpError(413, f"the request body is over {limit} bytes")
    return length


def read_body(
    sock: socket.socket, headers: Headers, length: int, surplus: bytes, deadline: float
) -> bytes:
    """Read the *length* bytes of body (from :func:`body_length`; *surplus* already read).

    Answers ``Expect: 100-continue`` (curl sends it for bodies over 1 KiB and would otherwise
    wait a second)."""
    body = bytearray(surplus[:length])
    if len(body) < length and any(v.lower() == "100-continue" for v in headers.get_all("Expect")):
        _send(sock, b"HTTP/1.1 100 Continue\r\n\r\n", deadline)
    while len(body) < length:
        chunk = _recv(sock, deadline, min(length - len(body), 256 * 1024))
        if not chunk:
            raise HttpError(400, "the peer closed before sending the whole body")
        body += chunk
    return bytes(body)


def serialize(response: Response) -> bytes:
    """The bytes of *response* (status line, headers, body)."""
    lines = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}"]
    lines.extend(f"{name}: {value}" for name, value in response.headers.raw_items())
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + (response.body or b"")


def text_response(status: int, text: str) -> Response:
    """A plain-text answer, shaped as websockets' own rejections."""
    return _build(status, text.encode("utf-8"), "text/plain; charset=utf-8", ())


def json_response(
    status: int, body: Mapping[str, Any], headers: Iterable[tuple[str, str]] = ()
) -> Response:
    """A JSON answer (strict JSON text and a newline); ``Cache-Control: no-store`` because
    answers may carry tokens and always describe live state."""
    data = (_json.dumps(body) + "\n").encode("utf-8")
    return _build(
        status, data, "application/json", (("Cache-Control", "no-store"), *tuple(headers))
    )


def _build(
    status: int, data: bytes, content_type: str, extra: Iterable[tuple[str, str]]
) -> Response:
    headers = Headers(
        [
            ("Date", email.utils.formatdate(usegmt=True)),
            # One request per connection: say so, so no client waits to reuse it.
            ("Connection", "close"),
            ("Content-Length", str(len(data))),
            ("Content-Type", content_type),
            *extra,
        ]
    )
    return Response(status, http.HTTPStatus(status).phrase, headers, data)


def linger_close(sock: socket.socket, *, drain_bytes: int = 1 << 20, timeout: float = 0.5) -> None:
    """Half-close, read what the peer still sends (briefly), then close.

    Closing a socket with unread input makes the kernel send a reset, which can destroy an
    answer the peer has not read yet (e.g. a 413 sent before its body)."""
    try:
        if not isinstance(sock, ssl.SSLSocket):
            sock.shutdown(socket.SHUT_WR)
        deadline = monotonic() + timeout
        drained = 0
        while drained < drain_bytes:
            chunk = _recv(sock, deadline, 65536)
            if not chunk:
                break
            drained += len(chunk)
    except (OSError, ValueError):
        pass
    finally:
        sock.close()


def answer_and_close(sock: socket.socket, response: Response, timeout: float) -> None:
    """Send a final answer within *timeout* seconds, then close (:func:`linger_close`): a peer
    that takes nothing is cut."""
    with contextlib.suppress(OSError, TimeoutError):
        send_all(sock, serialize(response), monotonic() + timeout)
    linger_close(sock)


def send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    """``sendall`` bounded by *deadline* (monotonic)."""
    _send(sock, data, deadline)


def _recv(sock: socket.socket, deadline: float, size: int) -> bytes:
    remaining = deadline - monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)
    return sock.recv(size)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    remaining = deadline - monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(remaining)
    sock.sendall(data)
