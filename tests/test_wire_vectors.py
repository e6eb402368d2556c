"""The shared frame vectors: our client decoder and our server validator agree with each one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orbit_sync import _codec
from orbit_sync.errors import WorkerError, WorkerProtocolError
from orbit_sync.models import Capability, Registration

VECTORS = json.loads((Path(__file__).parent / "vectors" / "frames.json").read_text("utf-8"))
CONTEXT = VECTORS["context"]
PENDING = dict.fromkeys(CONTEXT["pending_message_ids"], "task.start")
HELLO_ID = CONTEXT["pending_message_ids"][0]


def _context() -> _codec.SessionContext:
    registration = Registration(
        queue_id=CONTEXT["queue_id"],
        capabilities=[Capability(**c) for c in CONTEXT["capabilities"]],
        capacity=4,
        cancellation_notifications=CONTEXT["cancellation_notifications"],
    )
    return _codec.SessionContext(CONTEXT["session_id"], 2, registration)


def _ids(vectors: list[dict[str, Any]]) -> list[str]:
    return [v["name"] for v in vectors]


@pytest.mark.parametrize(
    "vector", VECTORS["server_to_client"], ids=_ids(VECTORS["server_to_client"])
)
def test_server_to_client(vector: dict[str, Any]) -> None:
    """Each server frame is accepted or rejected by the client decoder as the vector says."""
    if vector["valid"]:
        event = _codec.decode_server_frame(vector["frame"], _context(), PENDING.get)
        assert isinstance(
            event, _codec.Reply | _codec.AssignPush | _codec.CancelPush | _codec.ServerAbort
        )
    else:
        with pytest.raises(WorkerProtocolError):
            _codec.decode_server_frame(vector["frame"], _context(), PENDING.get)


WELCOMES = VECTORS["welcome_answering_pending_hello"]


@pytest.mark.parametrize("vector", WELCOMES, ids=_ids(WELCOMES))
def test_welcome(vector: dict[str, Any]) -> None:
    """Each answer to a pending hello is accepted or rejected as the vector says."""
    if vector["valid"]:
        welcome = _codec.decode_welcome(vector["frame"], HELLO_ID)
        assert welcome.session_id == json.loads(vector["frame"])["session_id"]
    else:
        with pytest.raises(WorkerProtocolError):
            _codec.decode_welcome(vector["frame"], HELLO_ID)


CLIENT = VECTORS["client_to_server"]


@pytest.mark.parametrize("vector", CLIENT, ids=_ids(CLIENT))
def test_client_to_server(vector: dict[str, Any]) -> None:
    """Each client frame is accepted by the server validator or gets INVALID_FRAME."""
    if vector["valid"]:
        frame = _codec.decode_client_frame(vector["frame"])
        assert frame.type == json.loads(vector["frame"])["type"]
    else:
        with pytest.raises(_codec.InvalidClientFrame) as info:
            _codec.decode_client_frame(vector["frame"])
        # The answer can name the request it rejects whenever the id was readable.
        assert info.value.message_id == json.loads(vector["frame"]).get("message_id")


def test_valid_client_frames_reencode_identically() -> None:
    """Our encoder reproduces every valid client body the validator accepted."""
    for vector in CLIENT:
        if not vector["valid"]:
            continue
        frame = _codec.decode_client_frame(vector["frame"])
        assert _codec.unstructure(frame.body) == json.loads(vector["frame"])["body"], vector["name"]


def test_error_answering_hello_is_a_worker_error() -> None:
    """An error answering hello is delivered as WorkerError, with or without a session id."""
    for session in ({}, {"session_id": "3" * 32}):
        raw = json.dumps(
            {
                "protocol_version": "1",
                "type": "error",
                "message_id": "6" * 32,
                "reply_to": HELLO_ID,
                "error": {"code": "UNAUTHENTICATED", "message": "bad token"},
                **session,
            }
        )
        with pytest.raises(WorkerError) as info:
            _codec.decode_welcome(raw, HELLO_ID)
        assert info.value.code == "UNAUTHENTICATED"
        assert info.value.fatal
