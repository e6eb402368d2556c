"""The wire converter's structuring of each body against an independent reading of the contract.

``tests/_independent.py`` checks bodies from docs/protocol.md alone, sharing no code with the SDK.
On every body (the shared vectors', and mutated ones) both give the same verdict; an accepted body
builds the model its validating constructor builds from the same values; a refused one is named
by the field's path, without the value.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orbit_sync import _bodies, _codec
from orbit_sync.errors import FrameError, WorkerProtocolError
from orbit_sync.models import (
    Assignment,
    AttemptRef,
    AttemptState,
    CancelNotice,
    Capability,
    CapacityReport,
    CommandResult,
    Finish,
    Lease,
    Receipt,
    Registration,
    Task,
    Welcome,
    new_secret,
)
from tests import _independent as ind

VECTORS = json.loads((Path(__file__).parent / "vectors" / "frames.json").read_text("utf-8"))
_BODY_MODEL = {"task.assign": Assignment, "task.cancel": CancelNotice}
#: What the independent checker says of an assignment once the body is valid: context rules.
_CONTEXT_RULES = (
    "assignment for another queue",
    "assigned task must be LEASED",
    "assignment for a capability",
)


def _assignment(body: Any) -> None:
    task = body.get("task") if isinstance(body, dict) else None
    queue = task.get("queue_id") if isinstance(task, dict) else None
    try:
        ind.check_assignment(body, ind.ClientContext(str(queue), set()))
    except ind.Violation as exc:
        if not str(exc).startswith(_CONTEXT_RULES):
            raise


def _receipt(body: Any) -> None:
    op = body.get("operation") if isinstance(body, dict) else None
    ind.check_receipt(body, op if isinstance(op, str) else "start")


def _command_result(body: Any) -> None:
    receipt = body.get("receipt") if isinstance(body, dict) else None
    op = receipt.get("operation") if isinstance(receipt, dict) else None
    ind.check_command_result(body, op if isinstance(op, str) else "start")


def _capacity(body: Any) -> None:
    o = ind.check_object(body, "capacity")
    ind.check_closed(o, {"sequence", "capacity", "drain"}, "capacity")
    ind.check_counter(ind.member(o, "sequence", "capacity"), "capacity.sequence", 1)
    ind.check_int(ind.member(o, "capacity", "capacity"), "capacity.capacity", 0, 256)
    ind.check_bool(ind.member(o, "drain", "capacity"), "capacity.drain")


#: The independent checker of each body: returns when the body is valid, raises Violation.
INDEPENDENT: dict[type[Any], Callable[[Any], Any]] = {
    Welcome: ind.check_welcome,
    Lease: ind.check_lease,
    Receipt: _receipt,
    CommandResult: _command_result,
    Task: ind.check_task,
    Assignment: _assignment,
    CancelNotice: ind.check_cancel,
    Capability: lambda v: ind.check_capability(v, "capability", closed=True),
    AttemptRef: lambda v: ind.check_ref(v, "ref"),
    Registration: lambda v: ind.check_hello(ind.check_object(v, "hello")),
    Finish: lambda v: ind.check_finish(ind.check_object(v, "finish")),
    CapacityReport: _capacity,
}


def _copy(value: Any) -> Any:
    """A copy of a JSON value (dicts and lists copied, atoms shared): what copy.deepcopy does
    for these trees, several times faster (the odd-value test copies ~70,000 bodies)."""
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value


def _reference(value: Any, cls: type[Any]) -> tuple[bool, str]:
    try:
        INDEPENDENT[cls](_copy(value))
    except ind.Violation as exc:
        return False, str(exc)
    return True, ""


def _decode(value: Any, cls: type[Any]) -> tuple[bool, Any]:
    if cls is Capability:  # nested only: reached through a registration's list on the wire
        try:
            return True, _bodies.structure(_copy(value), Capability)
        except _bodies.Fault as exc:
            return False, f"invalid Capability: {exc.describe('Capability')}"
    try:
        decoded = _codec.decode_body(_copy(value), cls)
    except FrameError as exc:
        return False, str(exc)
    if cls is Finish:  # the result's size is the frame's rule (decode_client_frame checks it)
        try:
            _codec.check_result(decoded.result)
        except FrameError as exc:
            return False, f"invalid Finish: {exc}"
    return True, decoded


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


def _validated(model: Any) -> Any:
    """*model* rebuilt by its validating constructor, nested models first."""
    values = {}
    for a in attrs.fields(type(model)):
        if not a.init:
            continue
        value = getattr(model, a.name)
        if attrs.has(type(value)):
            value = _validated(value)
        elif isinstance(value, tuple):
            value = tuple(_validated(v) if attrs.has(type(v)) else v for v in value)
        values[a.name] = value
    return type(model)(**values)


def _secrets_in(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _secrets_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in _secrets_in(v)]
    return [value] if isinstance(value, str) and len(value) >= 40 else []


def assert_agree(value: Any, cls: type[Any]) -> bool:
    """Assert the decoder and the independent checker agree on *value*; return the verdict."""
    ok, why = _reference(value, cls)
    decoded_ok, decoded = _decode(value, cls)
    assert decoded_ok == ok, (cls.__name__, value, why if not ok else decoded)
    if ok:
        # The converter builds exactly what the validating constructor builds from the values.
        assert _fields(_validated(decoded)) == _fields(decoded)
    else:
        assert decoded.startswith(f"invalid {cls.__name__}: ")
        for secret in _secrets_in(value):
            assert secret not in decoded
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
    for cls in (CommandResult, Welcome, Assignment, Task, *_bodies.CLIENT_BODIES):
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
_MISSING = object()
ODD_SAMPLES: list[Any] = [
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
ODD_VALUES = st.sampled_from(ODD_SAMPLES)
CAPABILITY = {"handler": "resize", "handler_version": "1", "payload_version": "1"}
CLIENT_SAMPLES: list[Any] = [
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
CLIENT_VALUES = st.sampled_from(CLIENT_SAMPLES)
VALUES = ODD_VALUES | wire_times() | CLIENT_VALUES
#: Keys a body may lack (mutations add them), and one no model has.
OPTIONAL_KEYS = ["cancel_requested_at", "cancellation_notifications", "error_code", "retryable"]
OPTIONAL_KEYS += ["extra"]


@st.composite
def mutated(draw: st.DrawFn, body: dict[str, Any]) -> dict[str, Any]:
    """*body* with a few fields (nested ones too) replaced, removed or added."""
    result = _copy(body)
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
            target[key] = _copy(draw(VALUES))  # never alias the shared samples
    return result


def _valid_bodies() -> list[tuple[Any, type[Any]]]:
    """The valid top-level vector bodies, each once (several vectors share a body)."""
    out: dict[tuple[str, type[Any]], Any] = {}
    for name, body, cls in VECTOR_BODIES:
        if "/" not in name and _reference(body, cls)[0]:
            out.setdefault((json.dumps(body), cls), body)
    return [(body, cls) for (_, cls), body in out.items()]


VALID = _valid_bodies()


def _objects(body: dict[str, Any]) -> list[dict[str, Any]]:
    """*body* and every object nested in it (capabilities included), payloads and results aside."""
    found = [body]
    for key, value in body.items():
        if isinstance(value, dict) and key not in ("payload", "result"):
            found += _objects(value)
        elif key == "capabilities" and isinstance(value, list):
            found += [item for item in value if isinstance(item, dict)]
    return found


def test_each_field_with_each_odd_value_agrees() -> None:
    """Every field of every valid body, set to each odd value or removed: one verdict."""
    samples = [*ODD_SAMPLES, *CLIENT_SAMPLES, "2026-09-17T08:00:30.5Z", "2026-09-17T08:10:00Z"]
    checked = 0
    for body, cls in VALID:
        for index, target in enumerate(_objects(body)):
            for key in dict.fromkeys([*target, *OPTIONAL_KEYS]):  # an optional key once
                for value in [*samples, _MISSING]:
                    changed = _copy(body)
                    place = _objects(changed)[index]
                    if value is _MISSING:
                        place.pop(key, None)
                    else:
                        place[key] = _copy(value)
                    assert_agree(changed, cls)
                    checked += 1
    assert checked > 10_000


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
    lease = _bodies.structure(body, Lease)
    assert lease.window == pytest.approx(1e-6)
    assert lease.deadline is None


def test_rejected_body_names_the_field_and_the_rule() -> None:
    """A refused body is reported by the path of the first field that breaks a rule, and why."""
    frame = json.loads(
        next(v for v in VECTORS["server_to_client"] if v["name"] == "ack-start-ok")["frame"]
    )
    frame["body"]["receipt"]["task_revision"] = "03"
    frame["body"]["lease"]["active"] = "yes"
    ctx = _codec.SessionContext(
        "3" * 32, 2, _codec.Registration("a" * 32, [Capability("resize", 1, 1)], 4)
    )
    with pytest.raises(WorkerProtocolError) as info:
        _codec.decode_server_frame(json.dumps(frame), ctx, {"4" * 32: "task.start"}.get)
    assert str(info.value) == (
        "invalid server frame: invalid CommandResult: receipt.task_revision must be a canonical "
        "decimal string"
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "invalid AttemptRef: AttemptRef must be a JSON object"),
        ({"task_id": "1" * 32}, "invalid AttemptRef: attempt_id is missing"),
        (
            {"task_id": "1" * 32, "attempt_id": "2" * 32, "epoch": "1", "lease_secret": "x" * 43},
            "invalid AttemptRef: lease_secret must be 32 bytes in unpadded base64url",
        ),
    ],
)
def test_refusals_name_the_body_or_the_field(body: Any, message: str) -> None:
    """A body that is not an object, lacks fields or breaks a field's rule says which."""
    with pytest.raises(FrameError) as info:
        _codec.decode_body(body, AttemptRef)
    assert str(info.value).startswith(message)
    assert "x" * 43 not in str(info.value)


def test_user_constructors_still_validate_while_frames_decode() -> None:
    """Decoding frames in one thread switches nothing off: a model built by user code in another
    thread validates."""
    body = json.loads(
        next(v for v in VECTORS["server_to_client"] if v["name"] == "ack-start-ok")["frame"]
    )["body"]
    stop = threading.Event()

    def decode() -> None:
        while not stop.is_set():
            _bodies.structure(body, CommandResult)

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


def _hello(**changes: Any) -> dict[str, Any]:
    body = {
        "queue_id": "a" * 32,
        "capabilities": [dict(CAPABILITY), {**CAPABILITY, "handler": "other"}],
        "capacity": 4,
        "instance_id": "c" * 32,
        "instance_secret": SECRET,
    }
    body.update(changes)
    return body


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"capabilities": [dict(CAPABILITY), {**CAPABILITY, "handler": "Bad"}]},
            "capabilities.1.handler must be 1-64 characters",
        ),
        (
            {"capabilities": [dict(CAPABILITY), {**CAPABILITY, "secretname": SECRET}]},
            "capabilities.1 has a field the schema does not define",
        ),
        ({"capabilities": {"resize": 1}}, "capabilities must be a list"),
        ({"capabilities": [dict(CAPABILITY)] * 2}, "capabilities must be distinct"),
        ({SECRET: 1}, "Registration has a field the schema does not define"),
        ({"instance_secret": SECRET[:42]}, "instance_secret must be 32 bytes"),
        ({"cancellation_notifications": None}, "cancellation_notifications must not be null"),
    ],
)
def test_client_body_refusals_name_the_path_never_the_text(
    change: dict[str, Any], message: str
) -> None:
    """A refused client body names the path down to a list entry and the rule broken; an
    unknown field is refused without repeating its name, a secret is never repeated."""
    with pytest.raises(FrameError) as info:
        _codec.decode_body(_hello(**change), Registration)
    assert str(info.value).startswith(f"invalid Registration: {message}")
    assert SECRET not in str(info.value) and SECRET[:42] not in str(info.value)
    assert "secretname" not in str(info.value)


def test_client_bodies_need_fields_their_models_default() -> None:
    """A registration without its instance, or a capacity report without drain, is refused:
    the model's default is not what the field's absence means on the wire."""
    hello = _hello()
    del hello["instance_id"]
    with pytest.raises(FrameError, match="invalid Registration: instance_id is missing"):
        _codec.decode_body(hello, Registration)
    with pytest.raises(FrameError, match="invalid CapacityReport: drain is missing"):
        _codec.decode_body({"sequence": "1", "capacity": 4}, CapacityReport)


def test_a_local_field_never_travels() -> None:
    """Lease.deadline is neither written nor read: a server cannot set a lease's local deadline."""
    body = {
        "active": True,
        "state": "RUNNING",
        "lease_until": "2026-09-17T08:00:30Z",
        "server_time": "2026-09-17T08:00:00Z",
        "deadline": 1e18,
    }
    lease = _codec.decode_body(body, Lease)
    assert lease.deadline is None
    assert "deadline" not in _codec.unstructure(lease.with_deadline(5.0))


def test_the_converter_itself_structures_and_unstructures_every_body() -> None:
    """The hooks live on one cattrs converter: its own structure/unstructure give what the
    codec gives, for every valid body of the vectors."""
    for body, cls in VALID:
        model = _codec.decode_body(_copy(body), cls)
        assert _bodies.converter.structure(_copy(body), cls) == model
        assert _bodies.converter.unstructure(model) == _codec.unstructure(model)
