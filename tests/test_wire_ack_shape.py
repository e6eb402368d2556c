"""The codec's fast path for the usual start/renew/finish ack, against its general path.

A frame the fast path takes must decode exactly as the general path decodes it, and a frame the
general path refuses must never be taken; the mock server's own acks must take it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbit_sync import _codec
from orbit_sync.errors import WorkerProtocolError
from orbit_sync.models import CommandResult, Finish
from orbit_sync.testing import MockOrbitServer
from tests._rawclient import RawClient
from tests.test_wire_bodies import VALID, VECTORS, mutated

SESSION = "3" * 32
REPLY_TO = "4" * 32
CTX = _codec.SessionContext(
    SESSION, 2, _codec.Registration("a" * 32, [_codec.Capability("resize", 1, 1)], 4)
)
PENDING = {REPLY_TO: "task.start"}.get

_ORDER = {
    "": ["protocol_version", "type", "message_id", "reply_to", "session_id", "body", "error"],
    "body": ["receipt", "lease", "deduplicated"],
    "receipt": [
        "operation",
        "task_state",
        "attempt_state",
        "task_revision",
        "lease_until",
        "disposition",
    ],
    "lease": ["active", "state", "lease_until", "server_time", "cancel_requested_at"],
}


def canonical(value: Any, name: str = "") -> Any:
    """*value* with its objects' keys in the usual order (unknown keys last, as they were)."""
    if not isinstance(value, dict):
        return value
    order = _ORDER.get(name, [])
    keys = [k for k in order if k in value] + [k for k in value if k not in order]
    return {k: canonical(value[k], k) for k in keys}


def compact(frame: dict[str, Any]) -> str:
    return json.dumps(canonical(frame), separators=(",", ":"), ensure_ascii=False)


def general(raw: str | bytes) -> tuple[bool, Any]:
    try:
        return True, _codec._decode_frame(raw, CTX, PENDING)
    except WorkerProtocolError as exc:
        return False, str(exc)


def assert_agree(raw: str | bytes) -> bool:
    """The fast path takes *raw* only if the general path decodes it to the same Reply."""
    fast = _codec._command_ack(raw, CTX, PENDING)
    ok, reference = general(raw)
    if fast is not None:
        assert ok, f"fast path took a frame the general path refuses: {reference}"
        assert fast == reference
        assert fast.value.lease.window == reference.value.lease.window
    return fast is not None


def _ack_vectors() -> list[tuple[str, bool, dict[str, Any]]]:
    out = []
    for v in VECTORS["server_to_client"]:
        try:
            frame = json.loads(v["frame"]) if isinstance(v["frame"], str) else v["frame"]
        except ValueError:
            continue
        if isinstance(frame, dict) and frame.get("type") == "ack":
            out.append((v["name"], v["valid"], frame))
    return out


ACK_VECTORS = _ack_vectors()
OK_FRAME = next(f for n, _, f in ACK_VECTORS if n == "ack-start-ok")


@pytest.mark.parametrize(("name", "valid", "frame"), ACK_VECTORS, ids=[v[0] for v in ACK_VECTORS])
def test_ack_vectors_in_the_usual_shape_agree(name: str, valid: bool, frame: Any) -> None:
    """Every ack vector, re-serialized in the usual shape, decodes alike on both paths."""
    raw = compact(frame)
    taken = assert_agree(raw)
    assert assert_agree(raw.encode("utf-8", "surrogatepass")) == taken
    if not valid:
        assert not taken or name.startswith("duplicate-")  # json.loads kept one of the two


def test_a_duplicate_key_is_never_taken() -> None:
    """A key repeated in the usual shape (top level or nested) goes to the general path."""
    raw = compact(OK_FRAME)
    for twice in [
        raw.replace('"type":"ack",', '"type":"ack","type":"ack",'),
        raw.replace('"deduplicated":false', '"deduplicated":false,"deduplicated":false'),
        raw.replace('"active":true,', '"active":true,"active":true,'),
    ]:
        assert twice != raw
        assert not assert_agree(twice)
        assert "duplicate key" in general(twice)[1]


def test_the_usual_shape_is_taken() -> None:
    """A valid ack in the usual shape (with and without a cancel request) takes the fast path."""
    names = {"ack-start-ok", "ack-start-cancel-requested", "ack-evidence-only"}
    frames = [f for n, _, f in ACK_VECTORS if n in names]
    assert len(frames) == len(names)
    for frame in frames:
        assert assert_agree(compact(frame))


COMMAND_BODIES = [body for body, cls in VALID if cls is CommandResult]


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from(COMMAND_BODIES).flatmap(mutated))
def test_mutated_bodies_agree(body: dict[str, Any]) -> None:
    """Bodies with fields replaced, removed or added decode alike on both paths."""
    frame = copy.deepcopy(OK_FRAME)
    frame["body"] = body
    assert_agree(compact(frame))


TRICKY = [*'"\\{}:, 09aAZé\x00\x7f', "\u2028"]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_mutated_text_agrees(data: st.DataObject) -> None:
    """A character replaced, inserted or removed anywhere in an ack: the paths still agree."""
    text = compact(data.draw(st.sampled_from([f for _, v, f in ACK_VECTORS if v])))
    at = data.draw(st.integers(0, len(text) - 1))
    action = data.draw(st.sampled_from(["replace", "insert", "delete"]))
    char = data.draw(st.sampled_from(TRICKY))
    if action == "replace":
        text = text[:at] + char + text[at + 1 :]
    elif action == "insert":
        text = text[:at] + char + text[at:]
    else:
        text = text[:at] + text[at + 1 :]
    assert_agree(text)
    assert_agree(text.encode("utf-8", "surrogatepass"))


def test_context_decides_on_both_paths() -> None:
    """Another session, an unknown reply_to or a pending request of another type is refused."""
    raw = compact(OK_FRAME)
    assert _codec._command_ack(raw, CTX, PENDING) is not None
    other = _codec.SessionContext("5" * 32, 2, CTX.registration)
    for ctx, pending in [
        (other, PENDING),
        (CTX, {}.get),
        (CTX, {REPLY_TO: "task.renew"}.get),
        (CTX, {REPLY_TO: "worker.resume"}.get),
    ]:
        assert _codec._command_ack(raw, ctx, pending) is None
        with pytest.raises(WorkerProtocolError):
            _codec.decode_server_frame(raw, ctx, pending)


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server that assigns at once."""
    with MockOrbitServer(lease_duration=30.0, assignment_rate=None) as srv:
        yield srv


def test_mock_server_acks_take_the_fast_path(server: MockOrbitServer) -> None:
    """The mock server's start, renew and finish acks are in the usual shape."""
    client = RawClient(server, capacity=1).open()
    server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    assert client.ws is not None and client.session_id is not None and client.epoch is not None
    ctx = _codec.SessionContext(client.session_id, client.epoch, client.registration)
    finish = Finish(ref, "SUCCEEDED", {"ok": True})
    for kind, body in [("task.start", ref), ("task.renew", ref), ("task.finish", finish)]:
        mid = client.send(kind, body)
        raw = client.ws.recv(timeout=5)
        pending = {mid: kind}.get
        reply = _codec._command_ack(raw, ctx, pending)
        assert reply is not None, kind
        assert reply == _codec._decode_frame(raw, ctx, pending)
    client.close()
