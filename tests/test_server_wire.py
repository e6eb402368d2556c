"""The mock server's WebSocket layer over real sockets: control frames, fragments, the closing
handshake, and frames the socket takes only in part."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from _rawclient import RawClient, small_window_socket

from orbit_sync.models import CapacityReport, new_message_id
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.testing._wire import text_frame

WAIT = 5.0


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    with MockOrbitServer(clock=ManualClock(), assignment_rate=None) as srv:
        yield srv


def test_ping_is_answered_with_its_pong(server: MockOrbitServer) -> None:
    """A ping gets a pong with the same payload, and the session goes on."""
    client = RawClient(server).open()
    assert client.ws is not None
    assert client.ws.ping(b"are-you-there").wait(WAIT)
    assert client.capacity(2, 4)["type"] == "ack"
    client.close()


def test_fragmented_request_is_applied_as_one_frame(server: MockOrbitServer) -> None:
    """A request sent in three fragments (with a ping between them) is answered once."""
    client = RawClient(server).open()
    assert client.ws is not None
    mid = new_message_id()
    text = json.dumps(
        {
            "protocol_version": "1",
            "type": "worker.capacity",
            "message_id": mid,
            "session_id": client.session_id,
            "body": {"sequence": "2", "capacity": 4, "drain": False},
        }
    )
    third = len(text) // 3
    client.expect(mid, "worker.capacity")
    client.ws.send(iter([text[:third], text[third : 2 * third], text[2 * third :]]))
    assert client.answer(mid)["type"] == "ack"
    assert client.ws.ping(b"after").wait(WAIT)
    client.close()


def test_client_close_is_echoed_and_ends_the_session(server: MockOrbitServer) -> None:
    """The client's close frame is echoed with its code; the session is then disconnected."""
    client = RawClient(server).open()
    assert client.ws is not None
    client.ws.close(4000, "bye")
    received = client.ws.protocol.close_rcvd
    assert received is not None and received.code == 4000
    server.wait_until(lambda s: not any(x.connected for x in s.sessions()), timeout=WAIT)


def test_server_close_waits_for_the_clients_close_frame(server: MockOrbitServer) -> None:
    """A close the server starts completes the handshake: the client sees code 1008 with the
    reason, after the INVALID_FRAME answer that preceded it."""
    client = RawClient(server, strict=False).open()
    assert client.ws is not None
    client.send_text("not json")
    client.wait_closed(WAIT)
    assert [f["error"]["code"] for f in client.pushes] == ["INVALID_FRAME"]
    received = client.ws.protocol.close_rcvd
    assert received is not None and (received.code, received.reason) == (1008, "invalid frame")


def test_frames_the_socket_takes_in_part_arrive_whole_and_in_order(
    server: MockOrbitServer,
) -> None:
    """Assignments far larger than a small receive window are written in part and finished
    by the writer; every one arrives intact, in dispatch order, with the answers after them."""
    client = RawClient(server, capacity=16)
    client.connect(sock=small_window_socket(server, rcvbuf=8 * 1024))
    client.hello()
    # 6.4 MB: more than the server's socket buffer and the client's window take together.
    pads = [chr(ord("a") + i) * 400_000 for i in range(16)]
    ids = [server.enqueue("resize", {"pad": pad}) for pad in pads]
    mid = client.send("worker.capacity", CapacityReport(1, 16, False))
    frames = [client.recv() for _ in range(17)]
    pushes = [f for f in frames if f["type"] == "task.assign"]
    assert [p["body"]["task"]["task_id"] for p in pushes] == ids
    assert [p["body"]["task"]["payload"]["pad"] for p in pushes] == pads
    assert [f.get("reply_to") for f in frames if f["type"] != "task.assign"] == [mid]
    client.close()


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 300_000])
def test_text_frame_header_lengths(size: int) -> None:
    """Each payload length gets the shortest header RFC 6455 allows, FIN set and no mask."""
    frame = text_frame("x" * size)
    assert frame[0] == 0x81
    if size < 126:
        assert frame[1] == size and len(frame) == 2 + size
    elif size < 65536:
        assert frame[1] == 126 and int.from_bytes(frame[2:4], "big") == size
        assert len(frame) == 4 + size
    else:
        assert frame[1] == 127 and int.from_bytes(frame[2:10], "big") == size
        assert len(frame) == 10 + size
