"""The transport's own frame path: buffered reads, masked batched writes, ping/close handling."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
from _scripted import SUBPROTOCOL, WAIT, Peer, ScriptedServer, raw_frame

from orbit_sync import _dial, _transport
from orbit_sync.errors import CallTimeout, WorkerDisconnected

TEXT, CONT, CLOSE, PING, PONG = 0x1, 0x0, 0x8, 0x9, 0xA
SIZES = [0, 1, 125, 126, 127, 65_535, 65_536, 70_001]  # each length encoding and its edges


@pytest.fixture
def pair() -> Iterator[tuple[_transport.Transport, Peer]]:
    """A transport dialled to a scripted server (no hello), its peer, and a bounded read."""
    with ScriptedServer() as server:
        port = int(server.url.rsplit(":", 1)[1])
        guard = _dial.DialGuard(WAIT)
        try:
            transport = _dial.connect(
                server.url,
                host="127.0.0.1",
                port=port,
                ssl_context=None,
                headers={},
                subprotocol=SUBPROTOCOL,
                guard=guard,
            )
        finally:
            guard.stop()
        # A socket timeout only so that a broken reader fails the test instead of hanging it.
        transport.set_timeout(WAIT)
        try:
            yield transport, server.accept()
        finally:
            transport.abort()
            transport.close()


def _random_text(n: int) -> str:
    """Random text of exactly *n* UTF-8 bytes, characters of 1 to 4 bytes mixed."""
    chars: list[str] = []
    while n:
        pick = chr(random.choice([random.randrange(128), 0xE9, 0x20AC, 0x1F600]))
        if len(pick.encode()) <= n:
            chars.append(pick)
            n -= len(pick.encode())
    return "".join(chars)


def test_mask_matches_the_rfc_definition(pair: tuple[_transport.Transport, Peer]) -> None:
    """The big-integer XOR masks as RFC 6455's byte-wise definition does, for every length
    remainder: what the server unmasks (websockets, by the RFC) is the text sent."""
    transport, peer = pair
    for n in [*range(10), 125, 1000, 65_537]:
        text = _random_text(n)
        transport.send_text(text)  # under a new random key each time
        assert peer.conn.recv(WAIT, decode=True) == text


def test_many_frames_in_one_write_are_parsed_in_order(
    pair: tuple[_transport.Transport, Peer],
) -> None:
    """A burst of frames of every length encoding, written at once, comes out whole and in order."""
    transport, peer = pair
    payloads = [f"{i:04d}".encode() * 40 for i in range(50)] + [b"x" * n for n in SIZES]
    peer.send_raw(b"".join(raw_frame(TEXT, p) for p in payloads))
    for expected in payloads:
        assert transport.recv_message() == expected


def test_frames_arriving_in_pieces_are_reassembled(
    pair: tuple[_transport.Transport, Peer],
) -> None:
    """Headers and payloads cut at every few bytes (64-bit length included) still parse."""
    transport, peer = pair
    payloads = [b"a" * 70_000, b"b" * 300, b"c"]
    data = b"".join(raw_frame(TEXT, p) for p in payloads)
    cuts = [*range(0, 12), *range(12, len(data), 4099)]

    def trickle() -> None:
        for start, end in zip(cuts, [*cuts[1:], len(data)], strict=True):
            peer.send_raw(data[start:end])

    thread = threading.Thread(target=trickle, name="test-trickle", daemon=True)
    thread.start()
    try:
        assert [transport.recv_message() for _ in payloads] == payloads
    finally:
        thread.join(WAIT)


def test_ping_inside_a_fragmented_message_is_answered(
    pair: tuple[_transport.Transport, Peer],
) -> None:
    """A ping between two fragments gets a pong with its payload; the message is reassembled."""
    transport, peer = pair
    peer.send_raw(raw_frame(TEXT, b'{"first":', fin=False))
    pong = peer.conn.ping(b"between-fragments")  # set only by a pong carrying this payload
    peer.send_raw(raw_frame(CONT, b"1", fin=False) + raw_frame(PONG, b"unsolicited"))
    peer.send_raw(raw_frame(CONT, b"}"))
    assert transport.recv_message() == b'{"first":1}'
    assert pong.wait(WAIT)


def test_close_frame_ends_with_its_code_and_is_answered(
    pair: tuple[_transport.Transport, Peer],
) -> None:
    """A server close frame raises WorkerDisconnected naming its code; a close frame goes back."""
    transport, peer = pair
    closer = threading.Thread(target=peer.conn.close, args=(4001, "bye"), daemon=True)
    closer.start()
    with pytest.raises(WorkerDisconnected, match=r"closed the connection \(code 4001\)"):
        transport.recv_message()
    transport.abort()  # what the connection does next: the server sees the end at once
    closer.join(WAIT)
    assert peer.conn.close_code == 1000  # what the server received from us


def test_empty_close_frame_reports_code_1005(pair: tuple[_transport.Transport, Peer]) -> None:
    """A close frame without a status code is reported as 1005 (no status received)."""
    transport, peer = pair
    peer.send_raw(raw_frame(CLOSE, b""))
    with pytest.raises(WorkerDisconnected, match=r"\(code 1005\)"):
        transport.recv_message()


def test_send_texts_writes_each_frame_in_order(pair: tuple[_transport.Transport, Peer]) -> None:
    """A batch of texts of every length encoding (non-ASCII included) arrives as separate frames."""
    transport, peer = pair
    texts = [f'"{"é" * (n // 2)}{"x" * (n % 2)}"' for n in SIZES]
    transport.send_texts(texts)
    transport.send_texts([])  # nothing is sent for an empty batch
    transport.send_text('"last"')
    for text in [*texts, '"last"']:
        assert peer.conn.recv(WAIT, decode=True) == text


def test_concurrent_writers_never_interleave(pair: tuple[_transport.Transport, Peer]) -> None:
    """Eight threads sending single frames and batches at once: every frame arrives intact."""
    transport, peer = pair
    start = threading.Barrier(8)

    def write(worker: int) -> None:
        start.wait(WAIT)
        for i in range(25):
            transport.send_text(f'"{worker}-{i}-' + "p" * 3000 + '"')
            transport.send_texts([f'"{worker}-{i}-a"', f'"{worker}-{i}-b"'])

    threads = [threading.Thread(target=write, args=(w,), daemon=True) for w in range(8)]
    for thread in threads:
        thread.start()
    received = [peer.conn.recv(WAIT, decode=True) for _ in range(8 * 25 * 3)]
    for thread in threads:
        thread.join(WAIT)
    for w in range(8):
        mine = [text for text in received if text.startswith(f'"{w}-')]
        expected = []
        for i in range(25):
            expected += [f'"{w}-{i}-' + "p" * 3000 + '"', f'"{w}-{i}-a"', f'"{w}-{i}-b"']
        assert mine == expected


def test_writes_after_close_raise_and_send_nothing(
    pair: tuple[_transport.Transport, Peer],
) -> None:
    """Once closed, sends raise WorkerDisconnected and abort is a no-op."""
    transport, peer = pair
    transport.close()
    with pytest.raises(WorkerDisconnected, match="the connection is closed"):
        transport.send_text('"late"')
    with pytest.raises(WorkerDisconnected, match="the connection is closed"):
        transport.send_texts(['"late"', '"later"'])
    transport.abort(1000)
    assert peer.wait_closed()


def test_abort_from_another_thread_wakes_the_reader(
    pair: tuple[_transport.Transport, Peer],
) -> None:
    """abort() during a blocked read sends a close frame and ends the read: WorkerDisconnected."""
    transport, peer = pair
    transport.set_timeout(None)  # after the dial: only the abort can end this read
    errors: list[BaseException] = []
    reading = threading.Event()

    def read() -> None:
        reading.set()
        try:
            transport.recv_message()
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read, name="test-reader", daemon=True)
    reader.start()
    assert reading.wait(WAIT)
    transport.abort(1002)
    reader.join(WAIT)
    assert not reader.is_alive()
    assert isinstance(errors[0], WorkerDisconnected)
    assert peer.wait_closed()
    assert peer.conn.close_code == 1002


def test_silence_during_the_dial_is_a_call_timeout(
    pair: tuple[_transport.Transport, Peer],
) -> None:
    """With the dial's socket timeout set, a silent server ends the read with CallTimeout."""
    transport, _ = pair
    transport.set_timeout(0.05)
    with pytest.raises(CallTimeout, match="dial did not complete in time"):
        transport.recv_message()
