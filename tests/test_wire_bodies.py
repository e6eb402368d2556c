"""The hand-written body decoders against the strict converter they replace on the hot path.

Both must accept exactly the same bodies and build equal models (every field, the local ones
included); on a body the fast path rejects, the codec's error is the converter's, word for word.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import threading
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbit_sync import _bodies, _codec
from orbit_sync.errors import FrameError, WorkerProtocolError
from orbit_sync.models import (
    AttemptRef,
    AttemptState,
    Capability,
    CommandResult,
    Lease,
    Receipt,
    Task,
    Welcome,
    new_secret,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "frames.json").read_text("utf-8"))
_BODY_MODEL = {"task.assign": _codec.Assignment, "task.cancel": _codec.CancelNotice}


def _client_sent(cls: type[Any]) -> bool:
    return cls in _bodies.CLIENT_DECODERS or cls is Capability


def _reference(value: Any, cls: type[Any]) -> tuple[bool, Any]:
    conv = _codec.CLIENT_BODY if _client_sent(cls) else _codec.SERVER_BODY
    try:
        return True, _codec.structure(conv, copy.deepcopy(value), cls)
    except FrameError as exc:
        return False, str(exc)


def _fast(value: Any, cls: type[Any]) -> tuple[bool, Any]:
    if cls is Capability:
        decode = _bodies.capability
    else:
        decode = (_bodies.CLIENT_DECODERS if _client_sent(cls) else _bodies.SERVER_DECODERS)[cls]
    try:
        return True, decode(copy.deepcopy(value))
    except Exception as exc:
        return False, exc


def _fields(model: Any) -> Any:
    """Every attrs field, recursively, eq=False ones included (Lease.deadline)."""
    if attrs.has(type(model)):
        values = tuple(_fields(getattr(model, a.name)) for a in attrs.fields(type(model)))
        return (type(model), values)
    if isinstance(model, tuple):
        return tuple(_fields(v) for v in model)
    if isinstance(model, dt.datetime):
        return (model, model.utcoffset())
    return model


def assert_agree(value: Any, cls: type[Any]) -> bool:
    """Assert the fast decoder and the converter agree on *value*; return whether it is valid."""
    ok, reference = _reference(value, cls)
    fast_ok, fast = _fast(value, cls)
    assert fast_ok == ok, (cls.__name__, value, reference if not ok else fast)
    if ok:
        assert fast == reference
        assert _fields(fast) == _fields(reference)
    return ok


def _bodies_in_vectors() -> list[tuple[str, Any, type[Any]]]:
    cases: list[tuple[str, Any, type[Any]]] = []
    frames = VECTORS["server_to_client"] + VECTORS["welcome_answering_pending_hello"]
    for vector in frames:
        try:
            frame = json.loads(vector["frame"])
        except ValueError:
            continue
        if not isinstance(frame, dict) or not isinstance(frame.get("body"), dict):
            continue
        body = frame["body"]
        kind = frame.get("type")
        if kind == "worker.welcome":
            cases.append((vector["name"], body, Welcome))
        elif kind in _BODY_MODEL:
            cases.append((vector["name"], body, _BODY_MODEL[kind]))
            if isinstance(body.get("task"), dict):
                cases.append((vector["name"] + "/task", body["task"], Task))
        elif kind == "ack":
            cases.append((vector["name"], body, CommandResult))
            cases.append((vector["name"] + "/as-lease", body.get("lease"), Lease))
            cases.append((vector["name"] + "/receipt", body.get("receipt"), Receipt))
    for vector in VECTORS["client_to_server"]:
        frame = json.loads(vector["frame"])
        body = frame.get("body")
        cls = _codec.CLIENT_BODIES.get(frame.get("type"))
        if cls is None or not isinstance(body, dict):
            continue
        cases.append((vector["name"], body, cls))
        if isinstance(body.get("ref"), dict):
            cases.append((vector["name"] + "/ref", body["ref"], AttemptRef))
        for i, cap in enumerate(body.get("capabilities") or []):
            cases.append((f"{vector['name']}/capability{i}", cap, Capability))
    return cases


VECTOR_BODIES = _bodies_in_vectors()


@pytest.mark.parametrize("name,body,cls", VECTOR_BODIES, ids=[c[0] for c in VECTOR_BODIES])
def test_vector_bodies_agree(name: str, body: Any, cls: type[Any]) -> None:
    """Every body in the shared vectors is accepted or rejected by both paths alike."""
    assert_agree(body, cls)


def test_vector_bodies_cover_both_verdicts() -> None:
    """The vector bodies include accepted and rejected ones of every top-level model."""
    seen = {(cls, assert_agree(body, cls)) for _, body, cls in VECTOR_BODIES}
    for cls in (CommandResult, Welcome, _codec.Assignment, Task, *_bodies.CLIENT_DECODERS):
        assert (cls, True) in seen and (cls, False) in seen, cls.__name__


# --------------------------------------------------------------------------- mutations

_BASE_TIME = dt.datetime(2026, 9, 17, 8, 0, tzinfo=dt.timezone.utc)
_S = 1_000_000_000
# Offsets around every boundary a window or a fraction can sit on, in nanoseconds.
_OFFSETS = [0, 1, 999, 1000, 1001, 999_999, _S, 30 * _S, 120 * _S - 1, 120 * _S, 120 * _S + 1]
_OFFSETS += [300 * _S - 1, 300 * _S, 300 * _S + 1, -1, -1000, -_S]


@st.composite
def wire_times(draw: st.DrawFn) -> str:
    """An RFC 3339 time near the base time, with 0 to 9 fraction digits (trailing zeros too)."""
    ns = draw(st.sampled_from(_OFFSETS) | st.integers(-2 * _S, 301 * _S))
    whole = _BASE_TIME + dt.timedelta(seconds=ns // _S)
    text = whole.strftime("%Y-%m-%dT%H:%M:%S")
    digits = draw(st.integers(0, 9))
    if digits:
        fraction = f"{ns % _S:09d}"
        if fraction[digits:].strip("0"):
            digits = 9  # keep the exact instant: never cut digits that are not zeros
        text += "." + fraction[:digits]
    return text + "Z"


SECRET = new_secret()
ODD_VALUES = st.sampled_from(
    [
        None,
        True,
        False,
        0,
        1,
        3,
        1000,
        30000,
        120000,
        120001,
        999,
        1.5,
        30000.0,
        "",
        "0",
        "1",
        "01",
        "3",
        "+1",
        " 1",
        "\u0661",
        "9" * 30,
        "a" * 32,
        "A" * 32,
        "a" * 31,
        "3" * 32,
        SECRET,
        SECRET[:42],
        SECRET + "=",
        "resize",
        "Resize",
        "start",
        "renew",
        "finish",
        "RUNNING",
        "LEASED",
        "SUCCEEDED",
        "EXPIRED",
        "WAITING",
        "APPLIED",
        "EVIDENCE_ONLY",
        "2026-09-17T08:00:30+00:00",
        "2026-09-17T08:00:30.1234567890Z",
        "2026-02-30T08:00:30Z",
        "2026-09-17t08:00:30z",
        [],
        [1],
        {},
        {"x": 1},
    ]
)
CAPABILITY = {"handler": "resize", "handler_version": "1", "payload_version": "1"}
CLIENT_VALUES = st.sampled_from(
    [
        "FAILED",
        "UNKNOWN",
        "CANCELLED",
        "HANDLER_ERROR",
        "X" * 64,
        "X" * 65,
        "bad_code",
        256,
        257,
        -1,
        [CAPABILITY],
        [CAPABILITY, CAPABILITY],
        [CAPABILITY, {**CAPABILITY, "handler": "other"}],
        [{**CAPABILITY, "handler": f"h{i}"} for i in range(33)],
        [{**CAPABILITY, "extra": 1}],
        [{"handler": "resize", "handler_version": "1"}],
        ["resize"],
    ]
)
VALUES = ODD_VALUES | wire_times() | CLIENT_VALUES
#: Keys a body may lack (mutations add them), and one no model has.
OPTIONAL_KEYS = ["cancel_requested_at", "cancellation_notifications", "error_code", "retryable"]
OPTIONAL_KEYS += ["extra"]


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    """*body* with a few fields (nested ones too) replaced, removed or added."""
    result = copy.deepcopy(body)
    for _ in range(draw(st.integers(1, 4))):
        target = result
        nested = [v for k, v in sorted(target.items()) if isinstance(v, dict) and k != "payload"]
        listed = target.get("capabilities")
        if isinstance(listed, list):
            nested += [item for item in listed if isinstance(item, dict)]
        if nested and draw(st.booleans()):
            target = draw(st.sampled_from(nested))
        key = draw(st.sampled_from([*sorted(target), *OPTIONAL_KEYS]))
        action = draw(st.sampled_from(["set", "set", "set", "delete"]))
        if action == "delete":
            target.pop(key, None)
        else:
            target[key] = copy.deepcopy(draw(VALUES))  # never alias the shared samples
    return result


def _valid_bodies() -> list[tuple[Any, type[Any]]]:
    out = []
    for name, body, cls in VECTOR_BODIES:
        if "/" not in name and _reference(body, cls)[0]:
            out.append((body, cls))
    return out


VALID = _valid_bodies()


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.sampled_from(VALID).flatmap(lambda c: st.tuples(mutated(c[0]), st.just(c[1]))))
def test_mutated_bodies_agree(case: tuple[dict[str, Any], type[Any]]) -> None:
    """Mutated valid bodies (odd values, boundary times, missing/extra keys) get one verdict."""
    body, cls = case
    assert_agree(body, cls)
    if cls is CommandResult:
        assert_agree(body.get("lease"), Lease)


@settings(max_examples=100, deadline=None)
@given(wire_times(), wire_times(), st.booleans(), st.sampled_from(list(AttemptState)))
def test_lease_windows_agree(now: str, until: str, active: bool, state: AttemptState) -> None:
    """Leases whose windows sit on every nanosecond boundary get one verdict and equal times."""
    body = {"active": active, "state": state.value, "lease_until": until, "server_time": now}
    assert_agree(body, Lease)


@settings(max_examples=100, deadline=None)
@given(wire_times(), wire_times())
def test_welcome_windows_agree(now: str, expires: str) -> None:
    """Welcomes whose windows sit on every nanosecond boundary get one verdict and equal times."""
    body = {
        "session_id": "3" * 32,
        "epoch": "2",
        "server_time": now,
        "expires_at": expires,
        "lease_duration_ms": 30000,
        "draining": False,
    }
    assert_agree(body, Welcome)


def test_sub_microsecond_window_rounds_up() -> None:
    """A 1 ns active window is accepted and kept positive (the end moves up one microsecond)."""
    body = {
        "active": True,
        "state": "RUNNING",
        "lease_until": "2026-09-17T08:00:00.000000001Z",
        "server_time": "2026-09-17T08:00:00Z",
    }
    assert assert_agree(body, Lease)
    lease = _bodies.lease(body)
    assert lease.window == pytest.approx(1e-6)
    assert lease.deadline is None


def test_rejected_body_keeps_the_converters_message() -> None:
    """A body the fast path rejects is reported with the converter's path and wording."""
    frame = json.loads(
        next(v for v in VECTORS["server_to_client"] if v["name"] == "ack-start-ok")["frame"]
    )
    frame["body"]["receipt"]["task_revision"] = "03"
    frame["body"]["lease"]["active"] = "yes"
    ctx = _codec.SessionContext(
        "3" * 32, 2, _codec.Registration("a" * 32, [_codec.Capability("resize", 1, 1)], 4)
    )
    with pytest.raises(WorkerProtocolError) as info:
        _codec.decode_server_frame(json.dumps(frame), ctx, {"4" * 32: "task.start"}.get)
    assert str(info.value) == (
        "invalid server frame: invalid CommandResult: invalid value for type, expected int "
        "@ $.receipt.task_revision; invalid value for type, expected bool @ $.lease.active"
    )


def test_user_constructors_still_validate_while_frames_decode() -> None:
    """Trusted construction is per call: a model built by user code in another thread validates."""
    body = json.loads(
        next(v for v in VECTORS["server_to_client"] if v["name"] == "ack-start-ok")["frame"]
    )["body"]
    stop = threading.Event()

    def decode() -> None:
        while not stop.is_set():
            _bodies.command_result(body)

    thread = threading.Thread(target=decode, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            with pytest.raises(ValueError):
                Lease(True, AttemptState.EXPIRED, _BASE_TIME, _BASE_TIME)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_trusted_constructor_sets_every_field() -> None:
    """A trusted constructor stores each attrs field in order and runs no validator."""
    build = _bodies.trusted_constructor(Lease)
    odd = build("not a bool", "not a state", 1, 2, 3, 4)
    stored = [getattr(odd, a.name) for a in attrs.fields(Lease)]
    assert stored == ["not a bool", "not a state", 1, 2, 3, 4]
