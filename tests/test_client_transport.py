"""The transport's pinned dial behaviour, and the 512 KiB limit enforced from the header."""

from __future__ import annotations

import inspect
import json
import socket
import struct
import threading
from typing import Any

import pytest
import websocket
from _scripted import (
    WAIT,
    ScriptedServer,
    command_body,
    frame,
    open_pair,
)

from orbit_sync import _dial, _transport
from orbit_sync._json import MAX_FRAME_BYTES
from orbit_sync.errors import WorkerProtocolError
from orbit_sync.models import AttemptRef

TEXT, BINARY, CONT, PING = 0x1, 0x2, 0x0, 0x9
REF = AttemptRef("1" * 32, "2" * 32, 1, "L" * 42 + "A")


def test_websocket_client_version_is_in_the_pinned_range() -> None:
    """The installed websocket-client is one whose internals _transport was written against."""
    installed = tuple(int(part) for part in websocket.__version__.split(".")[:3])
    low, high = _dial.SUPPORTED_WEBSOCKET_CLIENT
    assert low <= installed < high, f"websocket-client {websocket.__version__} is not pinned"


def test_upgrade_answer_is_read_line_by_line() -> None:
    """websocket-client reads the 101 answer a byte at a time: the first frame stays ours."""
    _dial.check_internals()
    from websocket import _handshake, _http, _socket

    assert "recv(sock, 1)" in inspect.getsource(_socket.recv_line)
    assert "recv_line(sock)" in inspect.getsource(_http.read_headers)
    assert "read_headers(" in inspect.getsource(_handshake._get_resp_headers)


def test_check_internals_fails_closed_without_the_dial_api(monkeypatch: Any) -> None:
    """A websocket-client without the API the dial uses is refused before any dial."""
    monkeypatch.delattr(websocket.WebSocket, "getheaders")
    with pytest.raises(RuntimeError, match="websocket-client API changed"):
        _dial.check_internals()


def _socket_transport(sock: socket.socket) -> _transport.Transport:
    """A Transport over one end of a socket pair, as if its upgrade had just completed."""
    return _transport.Transport(websocket.WebSocket(), sock)


def test_huge_header_is_refused_without_waiting_for_its_payload() -> None:
    """A header announcing 48 MiB is refused from the header: its payload is never waited for."""
    left, right = socket.socketpair()
    try:
        right.settimeout(WAIT)  # a reader that waited for the payload would time out instead
        transport = _socket_transport(right)
        left.sendall(struct.pack("!BBQ", 0x80 | TEXT, 127, 48 << 20) + b"0123456789")
        with pytest.raises(_transport.FrameRejected, match="over the 524288-byte limit"):
            transport.recv_message()
    finally:
        left.close()
        right.close()


def _start_pending(conn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Call conn.start on a thread so the server has a request to answer."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = conn.start(REF)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name="test-start", daemon=True)
    thread.start()
    return thread, out


def test_oversized_frame_closes_the_connection_without_buffering_it() -> None:
    """A frame announcing 600 KiB closes the connection at once, though its payload never comes."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        thread, out = _start_pending(conn)
        peer.recv()
        # Header plus a few bytes, then silence: a client that buffers first would hang here.
        peer.send_raw(struct.pack("!BBQ", 0x80 | TEXT, 127, 600 * 1024) + b'{"pro')
        assert conn.done.wait(WAIT)
        thread.join(WAIT)
        assert isinstance(conn.err, WorkerProtocolError)
        assert isinstance(out.get("error"), WorkerProtocolError)
        conn.close()


def _padded_ack(reply_to: str, size: int) -> str:
    """A valid start ack padded (with an unknown body field) to exactly *size* bytes."""
    body = command_body("start")
    body["pad"] = ""
    text = json.dumps(frame("ack", reply_to=reply_to, body=body), separators=(",", ":"))
    body["pad"] = "x" * (size - len(text.encode()))
    text = json.dumps(frame("ack", reply_to=reply_to, body=body), separators=(",", ":"))
    assert len(text.encode()) == size
    return text


@pytest.mark.parametrize(
    ("size", "accepted"), [(MAX_FRAME_BYTES, True), (MAX_FRAME_BYTES + 1, False)]
)
def test_limit_is_exactly_512_kib(size: int, accepted: bool) -> None:
    """A frame of exactly 524,288 bytes is accepted; one byte more closes the connection."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        thread, out = _start_pending(conn)
        request = peer.recv()
        peer.send(_padded_ack(request["message_id"], size))
        thread.join(WAIT)
        if accepted:
            assert out["result"].receipt.operation.value == "start"
            assert conn.err is None
        else:
            assert isinstance(out.get("error"), WorkerProtocolError)
        conn.close()


def test_fragmented_message_is_limited_across_fragments() -> None:
    """Two 300 KiB fragments exceed the limit together: refused at the second header."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        thread, out = _start_pending(conn)
        peer.recv()
        peer.send_raw(struct.pack("!BBQ", TEXT, 127, 300 * 1024) + b" " * (300 * 1024))
        peer.send_raw(struct.pack("!BBQ", 0x80 | CONT, 127, 300 * 1024) + b" ")
        assert conn.done.wait(WAIT)
        thread.join(WAIT)
        assert isinstance(out.get("error"), WorkerProtocolError)
        conn.close()


def test_fragmented_message_within_the_limit_is_reassembled() -> None:
    """A valid ack split over a text frame and a continuation frame is delivered."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        thread, out = _start_pending(conn)
        request = peer.recv()
        data = json.dumps(frame("ack", reply_to=request["message_id"], body=command_body("start")))
        raw = data.encode()
        from _scripted import raw_frame

        peer.send_raw(raw_frame(TEXT, raw[:100], fin=False) + raw_frame(CONT, raw[100:]))
        thread.join(WAIT)
        assert out["result"].receipt.operation.value == "start"
        conn.close()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(lambda: struct.pack("!BB", 0x80 | BINARY, 2) + b"{}", id="binary"),
        pytest.param(
            lambda: struct.pack("!BB", 0x80 | TEXT, 0x80 | 2) + b"\0\0\0\0{}", id="masked"
        ),
        pytest.param(lambda: struct.pack("!BB", 0xC0 | TEXT, 2) + b"{}", id="rsv1-compressed"),
        pytest.param(
            lambda: struct.pack("!BBH", 0x80 | PING, 126, 200) + b"p" * 200, id="big-ping"
        ),
        pytest.param(lambda: struct.pack("!BB", PING, 1) + b"p", id="fragmented-ping"),
        pytest.param(lambda: struct.pack("!BB", 0x80 | CONT, 2) + b"{}", id="stray-continuation"),
        pytest.param(lambda: struct.pack("!BB", 0x80 | 0x3, 2) + b"{}", id="reserved-opcode"),
        pytest.param(
            lambda: struct.pack("!BB", TEXT, 1) + b"{" + struct.pack("!BB", 0x80 | TEXT, 1) + b"}",
            id="text-inside-fragmented-text",
        ),
        pytest.param(
            lambda: struct.pack("!BB", 0x80 | TEXT, 4) + b'"\xff"\n',
            id="invalid-utf8",
        ),
    ],
)
def test_framing_violations_close_with_a_protocol_error(data: Any) -> None:
    """Binary, masked, compressed, malformed control and invalid UTF-8 frames are refused."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        thread, out = _start_pending(conn)
        peer.recv()
        peer.send_raw(data())
        assert conn.done.wait(WAIT)
        thread.join(WAIT)
        assert isinstance(conn.err, WorkerProtocolError)
        assert isinstance(out.get("error"), WorkerProtocolError)
        conn.close()
