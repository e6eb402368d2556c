"""Strict JSON: every input the protocol rejects raises FrameError, cheaply and without leaks."""

from __future__ import annotations

import pytest

from orbit_sync import _json
from orbit_sync.errors import FrameError

REJECTED: list[tuple[str, bytes]] = [
    ("duplicate-top", b'{"a":1,"a":2}'),
    ("duplicate-deep", b'{"a":[{"b":{"c":1,"c":1}}]}'),
    ("nan", b'{"a":NaN}'),
    ("infinity", b'{"a":Infinity}'),
    ("minus-infinity", b'{"a":-Infinity}'),
    ("huge-exponent", b'{"a":1e400}'),
    ("huge-integer", b'{"a":' + b"9" * 400 + b"}"),
    ("integer-past-doubles", b'{"a":[1,-' + b"2" + b"0" * 308 + b"]}"),
    ("lone-surrogate", b'{"a":"\\ud800"}'),
    ("lone-surrogate-key", b'{"\\udfff":1}'),
    ("lone-surrogate-upper", b'{"a":"\\uD800x"}'),
    ("invalid-utf8", b'{"a":"\xff"}'),
    ("utf8-encoded-surrogate", b'{"a":"\xed\xa0\x80"}'),
    ("deep-nesting", b"[" * 100_000 + b"]" * 100_000),
    ("truncated", b'{"a":'),
    ("trailing-garbage", b'{"a":1} x'),
    ("over-limit", b'{"a":"' + b"x" * _json.MAX_FRAME_BYTES + b'"}'),
]


@pytest.mark.parametrize("raw", [r for _, r in REJECTED], ids=[n for n, _ in REJECTED])
def test_rejected(raw: bytes) -> None:
    """Each malformed document raises FrameError (a ValueError), never something foreign."""
    with pytest.raises(FrameError):
        _json.loads(raw)


def test_rejected_as_text_too() -> None:
    """The same rules hold when the frame arrives as str."""
    with pytest.raises(FrameError):
        _json.loads('{"a":"\ud800"}')
    with pytest.raises(FrameError):
        _json.loads('{"a":1,"a":1}')


def test_valid_surrogate_pair_accepted() -> None:
    """An escaped surrogate *pair* is a real character and is accepted."""
    assert _json.loads(b'{"a":"\\ud83d\\ude00"}') == {"a": "\U0001f600"}


def test_exactly_at_limit_accepted() -> None:
    """A frame of exactly 512 KiB is accepted; one byte more is not."""
    filler = _json.MAX_FRAME_BYTES - len(b'{"a":""}')
    raw = b'{"a":"' + b"x" * filler + b'"}'
    assert len(raw) == _json.MAX_FRAME_BYTES
    assert _json.loads(raw)["a"] == "x" * filler
    with pytest.raises(FrameError):
        _json.loads(raw[:-2] + b'x"}')


def test_messages_do_not_echo_content() -> None:
    """Errors name the problem, not the payload (which may hold a secret)."""
    with pytest.raises(FrameError) as info:
        _json.loads(b'{"lease_secret":"TOPSECRETVALUE","lease_secret":"TOPSECRETVALUE"}')
    assert "TOPSECRETVALUE" not in str(info.value)


def test_dumps_is_compact_utf8_and_strict() -> None:
    """dumps writes compact UTF-8 and refuses NaN and lone surrogates."""
    assert _json.dumps({"a": [1, "é"]}) == '{"a":[1,"é"]}'
    for bad in (float("nan"), "\udc00", {"a": object()}):
        with pytest.raises(FrameError):
            _json.dumps(bad)


def test_integers_up_to_the_largest_double_are_accepted() -> None:
    """Integers of every length a double holds (up to 309 digits) are read exactly, among many
    short ones and next to long runs of digits inside strings."""
    big = 10**308
    text = f'{{"a":[{big},-{big},1,-0,42],"s":"{"7" * 400}","n":{2**53 + 1}}}'
    assert _json.loads(text) == {"a": [big, -big, 1, 0, 42], "s": "7" * 400, "n": 2**53 + 1}
    assert _json.loads('{"a":' + "9" * 308 + "}") == {"a": int("9" * 308)}
