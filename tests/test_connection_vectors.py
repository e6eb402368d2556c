"""Every server→client frame vector, sent over a real socket to a live WorkerConnection."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from _scripted import LEASE_SECRET, WAIT, ScriptedServer, iter_vectors, open_pair

from orbit_sync.errors import WorkerError, WorkerProtocolError
from orbit_sync.models import Assignment, AttemptRef, CommandResult

VECTORS = list(iter_vectors("server_to_client"))
PENDING_ID = "4" * 32  # the context's pending request, a task.start
REF = AttemptRef("1" * 32, "2" * 32, 1, LEASE_SECRET)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_server_frame_vector(vector: dict[str, Any]) -> None:
    """A valid frame is delivered as the vector's kind; an invalid one closes the connection with
    WorkerProtocolError and releases the waiting caller with it."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server, welcome={"epoch": "2"})
        out: dict[str, Any] = {}

        def start() -> None:
            try:
                out["result"] = conn.start(REF, message_id=PENDING_ID)
            except BaseException as exc:
                out["error"] = exc

        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        try:
            assert peer.recv()["message_id"] == PENDING_ID
            peer.send(vector["frame"])
            if not vector["valid"]:
                thread.join(WAIT)
                assert isinstance(out.get("error"), WorkerProtocolError)
                assert isinstance(conn.err, WorkerProtocolError)
                return
            kind = json.loads(vector["frame"])["type"]
            if kind == "task.assign":
                assert isinstance(conn.next_assignment(timeout=WAIT), Assignment)
                assert conn.err is None
                return
            thread.join(WAIT)
            if kind == "ack":
                assert isinstance(out.get("result"), CommandResult)
                assert conn.err is None
            else:
                assert isinstance(out.get("error"), WorkerError)
        finally:
            conn.close()
            thread.join(WAIT)
