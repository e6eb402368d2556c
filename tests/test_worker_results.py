"""Results encoded the way users expect (cattrs converter), located errors, and snapshots."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import logging
import threading
import uuid
from typing import Any

import attrs
import pytest
from _worker_helpers import has_event, make_worker, running

from orbit_sync import _codec, _json
from orbit_sync.models import AttemptRef, Outcome, TaskState, new_secret
from orbit_sync.testing import HandlerEnvironment, MockOrbitServer
from orbit_sync.worker import Fail, TaskContext, Verdict, result_converter
from orbit_sync.worker.core._outcomes import ResultEncoder, ResultProblem

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
UTC = dt.timezone.utc


def _returning(value: Any) -> Verdict:
    """The verdict the worker reaches for a handler that returns *value*."""
    return HandlerEnvironment().run(lambda ctx, payload: value, {})


def _raising(error: BaseException) -> Verdict:
    """The verdict the worker reaches for a handler that raises *error*."""

    def handler(ctx: TaskContext, payload: Any) -> Any:
        raise error

    return HandlerEnvironment().run(handler, {})


@pytest.fixture
def server() -> Any:
    """A mock server that assigns at once; its invariants are checked at the end."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


class Status(enum.Enum):
    PAID = "paid"


class _NoneEnum(enum.Enum):
    NOTHING = None


@dataclasses.dataclass
class Line:
    sku: str
    price: decimal.Decimal


@attrs.define
class Receipt:
    id: uuid.UUID
    lines: list[Line]
    status: Status
    at: dt.datetime
    tags: frozenset[str]


class Money:
    def __init__(self, cents: int) -> None:
        self.cents = cents


RECEIPT_ID = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")


def _receipt() -> Receipt:
    return Receipt(
        id=RECEIPT_ID,
        lines=[Line("a-1", decimal.Decimal("12.50"))],
        status=Status.PAID,
        at=dt.datetime(2026, 1, 2, 3, 4, 5, 600_000, tzinfo=UTC),
        tags=frozenset({"b", "a"}),
    )


RECEIPT_JSON = {
    "id": "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
    "lines": [{"sku": "a-1", "price": "12.50"}],
    "status": "paid",
    "at": "2026-01-02T03:04:05.600000+00:00",
    "tags": ["a", "b"],
}


def test_default_converter_encodes_what_users_return() -> None:
    """datetime/date/time, Decimal, UUID, Enum, attrs classes and dataclasses become JSON."""
    value = {
        "receipt": _receipt(),
        "day": dt.date(2026, 1, 2),
        "time": dt.time(3, 4, 5),
        "naive": dt.datetime(2026, 1, 2, 3, 4),
    }
    out = ResultEncoder().encode(value)
    assert out == {
        "receipt": RECEIPT_JSON,
        "day": "2026-01-02",
        "time": "03:04:05",
        "naive": "2026-01-02T03:04:00",
    }


@pytest.mark.parametrize(
    ("value", "message", "path", "type_name"),
    [
        ({"a": [1, {"blob": b"x"}]}, "$.a[1].blob: bytes is not JSON", "$.a[1].blob", "bytes"),
        ({"ratio": float("nan")}, "$.ratio: float is not finite", "$.ratio", "float"),
        ({"p": decimal.Decimal("NaN")}, "$.p: decimal.Decimal could not", "$.p", "decimal.Decimal"),
        ({"k k": object()}, '$["k k"]: object is not JSON', '$["k k"]', "object"),
        ({uuid.UUID(int=1): 1}, "is not allowed as an object key", "$[UUID(", "uuid.UUID"),
        ({1: "a", "1": "b"}, "duplicates another key", '$["1"]', "str"),
        ([Money(1)], "$[0]: test_worker_results.Money is not JSON", "$[0]", "Money"),
    ],
    ids=["bytes", "nan", "decimal-nan", "object", "uuid-key", "dup-key", "custom"],
)
def test_unencodable_names_path_and_type(
    value: Any, message: str, path: str, type_name: str
) -> None:
    """What still cannot be encoded is named by key path and type, never by its content."""
    with pytest.raises(ResultProblem) as info:
        ResultEncoder().encode(value)
    problem = info.value
    assert problem.code == "RESULT_NOT_JSON"
    assert message in problem.message
    assert problem.path.startswith(path)
    assert problem.type_name.endswith(type_name)


def test_strict_limits_still_hold_after_conversion() -> None:
    """Over 256 KiB and null stay refused; a huge int is not a double."""
    with pytest.raises(ResultProblem) as info:
        ResultEncoder().encode(["x" * 1024] * 300)
    assert info.value.code == "RESULT_TOO_LARGE"
    with pytest.raises(ResultProblem, match="other than null"):
        ResultEncoder().encode(_NoneEnum.NOTHING)
    with pytest.raises(ResultProblem) as info:
        ResultEncoder().encode({"n": [1, 10**400]})
    # Named by key path like every other encoding error.
    assert info.value.message.startswith("$.n[1]: int is out of range")
    assert info.value.path == "$.n[1]" and info.value.type_name == "int"


BIG = 2**53  # the first integer a double cannot tell from its neighbour (2**53 + 1 rounds to it)


@pytest.mark.parametrize(
    ("mode", "sent"),
    [
        ("number", '{"ids":[9007199254740991,9007199254740992],"n":-9007199254740993}'),
        ("string", '{"ids":[9007199254740991,"9007199254740992"],"n":"-9007199254740993"}'),
    ],
)
def test_large_ints_are_numbers_unless_asked_for_text(mode: str, sent: str) -> None:
    """Integers beyond 2**53 - 1 are JSON numbers by default; large_ints="string" sends their
    exact decimal text (as for Decimal), and leaves smaller ones alone."""
    encoder = ResultEncoder(result_converter(large_ints=mode))
    value, text, _ = encoder.encode_with_text({"ids": [BIG - 1, BIG], "n": -BIG - 1})
    assert text == sent
    assert _json.loads(text) == value


def test_large_ints_string_mode_sends_what_no_double_can_hold() -> None:
    """10**400 is refused as a number but travels as text with large_ints="string"."""
    encoder = ResultEncoder(result_converter(large_ints="string"))
    assert encoder.encode({"n": 10**400}) == {"n": "1" + "0" * 400}


def test_large_ints_refuse_names_the_first_one() -> None:
    """large_ints="refuse": RESULT_NOT_JSON naming the first integer beyond 2**53 - 1."""
    encoder = ResultEncoder(result_converter(large_ints="refuse"))
    assert encoder.encode({"n": BIG - 1}) == {"n": BIG - 1}
    with pytest.raises(ResultProblem) as info:
        encoder.encode({"a": [1, BIG, BIG + 5], "b": {"c": BIG * 2}})
    assert info.value.path == "$.a[1]"
    assert "beyond 2**53 - 1" in info.value.message
    assert str(BIG) not in info.value.message  # a value, never its content
    with pytest.raises(ValueError, match="large_ints"):
        result_converter(large_ints="bigint")


def test_large_ints_refuse_names_one_an_int_subclass_or_a_hook_made() -> None:
    """large_ints="refuse" names a large IntEnum member, or a large int a hook returned, by its
    key path too."""

    class Big(enum.IntEnum):
        N = BIG

    class Ticket:
        pass

    converter = result_converter(large_ints="refuse")
    converter.register_unstructure_hook(Ticket, lambda _: BIG)
    encoder = ResultEncoder(converter)
    for value, path in (({"e": [Big.N]}, "$.e[0]"), ({"k": {"t": Ticket()}}, "$.k.t")):
        with pytest.raises(ResultProblem) as info:
            encoder.encode(value)
        assert info.value.path == path
        assert "beyond 2**53 - 1" in info.value.message


def test_worker_sends_large_ints_as_text_when_asked(server: MockOrbitServer) -> None:
    """Through the real server: the recorded result holds the exact digits as a string."""
    worker = make_worker(server, result_converter=result_converter(large_ints="string"))

    @worker.handler("count")
    def count(ctx: TaskContext, payload: Any) -> Any:
        return {"total": 2**64 + 1, "small": 7}

    task_id = server.enqueue("count", {})
    with running(worker):
        snap = server.wait_for(task_id, DONE)
    assert snap.state is TaskState.SUCCEEDED
    assert snap.result == {"total": "18446744073709551617", "small": 7}


def test_user_converter_extends_the_defaults() -> None:
    """A hook registered on result_converter() is used; the defaults still apply."""
    converter = result_converter()
    converter.register_unstructure_hook(Money, lambda m: {"cents": m.cents, "currency": "EUR"})
    verdict = HandlerEnvironment(result_converter=converter).run(
        lambda ctx, payload: {"total": Money(1250), "id": RECEIPT_ID}, {}
    )
    assert verdict.outcome is Outcome.SUCCEEDED
    assert verdict.result == {"total": {"cents": 1250, "currency": "EUR"}, "id": str(RECEIPT_ID)}


def test_converter_must_be_cattrs() -> None:
    """A converter that is not a cattrs converter is refused before anything runs."""
    with pytest.raises(TypeError, match="cattrs"):
        ResultEncoder(object())  # type: ignore[arg-type]


def test_verdict_holds_a_snapshot_not_the_live_object() -> None:
    """The verdict's result is a copy: mutating what the handler returned changes nothing."""
    returned = {"n": 1, "items": [1]}
    verdict = _returning(returned)
    returned["n"] = 2
    returned["items"].append(float("nan"))
    assert verdict.result == {"n": 1, "items": [1]}
    details = {"k": [1]}
    failed = _raising(Fail("BAD", details=details))
    details["k"].append(2)
    assert failed.result["details"] == {"k": [1]}


def test_worker_sends_encoded_result(server: MockOrbitServer) -> None:
    """Through the real server, a handler's attrs/dataclass/datetime result is recorded as JSON."""
    worker = make_worker(server)

    @worker.handler("charge")
    def charge(ctx: TaskContext, payload: Any) -> Any:
        return _receipt()

    task_id = server.enqueue("charge", {})
    with running(worker):
        snap = server.wait_for(task_id, DONE)
    assert snap.state is TaskState.SUCCEEDED
    assert snap.result == RECEIPT_JSON


def test_unencodable_result_is_logged_at_error_with_its_path(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A result that still cannot be encoded: FAILED RESULT_NOT_JSON with path and type, ERROR."""
    worker = make_worker(server)

    @worker.handler("charge")
    def charge(ctx: TaskContext, payload: Any) -> Any:
        return {"charged": True, "raw": b"\x00secret"}

    task_id = server.enqueue("charge", {})
    with caplog.at_level(logging.ERROR, logger="orbit_sync"), running(worker):
        snap = server.wait_for(task_id, DONE)
    assert snap.state is TaskState.FAILED and len(snap.attempts) == 1
    att = snap.attempts[-1]
    assert (att.outcome, att.error_code, att.retryable) == (
        Outcome.FAILED,
        "RESULT_NOT_JSON",
        False,
    )
    assert snap.result == {
        "error": "RESULT_NOT_JSON",
        "message": "$.raw: bytes is not JSON (register an unstructure hook for it)",
        "path": "$.raw",
        "type": "bytes",
    }
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("$.raw: bytes" in r.getMessage() and "charge" in r.getMessage() for r in errors)
    assert all("secret" not in r.getMessage() for r in caplog.records)


def test_resent_finish_carries_the_result_as_returned(server: MockOrbitServer) -> None:
    """A finish re-sent after a cut carries the snapshot even if the handler mutated its result."""
    worker = make_worker(server)
    mutated = threading.Event()

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        out: dict[str, Any] = {"n": 1}

        def mutate_after_send() -> None:
            # The handler keeps a reference and changes it after returning (a cache, a
            # background thread...): once the first finish was sent, before it is re-sent.
            if cut.wait(10):
                out["n"] = float("nan")
                out["extra"] = "never returned"
            mutated.set()
            refused.cancel()

        threading.Thread(target=mutate_after_send, daemon=True).start()
        return out

    with running(worker):
        # Applied then cut: the worker must re-send the finish on a new connection, which it
        # cannot get until the handler's object has been mutated.
        cut = server.faults.close_after("task.finish")
        refused = server.faults.refuse_connections(count=1_000_000)
        task_id = server.enqueue("work", {})
        server.wait_until(has_event("request.deduplicated", task_id, "task.finish"), timeout=10)
    assert mutated.is_set() and cut.fired == 1
    snap = server.task(task_id)
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"n": 1}
    assert snap.evidence == ()


FINISH_REF = AttemptRef("1" * 32, "2" * 32, 3, new_secret())


@pytest.mark.parametrize(
    "value",
    [
        {"receipt": _receipt(), "n": 1.5e16, "big": 2**53, "u": "\u00e9\u2028", "k": {1: "a"}},
        (1, 2.5, -0.0, 1e-7, True, None),
        None,
        "text",
        0,
        Status.PAID,
        {"s": frozenset({3, 1})},
    ],
    ids=["mixed", "tuple", "none", "str", "zero", "enum", "set"],
)
def test_finish_sends_the_encoders_text_as_the_generic_encoding(value: Any) -> None:
    """A verdict's finish carries the encoder's snapshot: the frame holds the very text the
    encoder checked."""
    finish = _returning(value).finish(FINISH_REF)
    _, text, _ = ResultEncoder().encode_with_text({} if value is None else value)
    frame = _codec.encode_request("task.finish", "4" * 32, "3" * 32, finish)
    assert f'"result":{text}}}' in frame
    assert _json.loads(frame)["body"]["result"] == finish.result


def test_failed_finish_with_details_sends_the_encoders_text() -> None:
    """A Fail's encoded details go out as encoded: the frame holds the text the encoder checked."""
    error = Fail("OUT_OF_STOCK", "gone", details={"at": dt.date(2026, 1, 2)}, retryable=True)
    finish = _raising(error).finish(FINISH_REF)
    frame = _codec.encode_request("task.finish", "4" * 32, "3" * 32, finish)
    details = '"details":{"at":"2026-01-02"}'
    assert f'"result":{{"error":"OUT_OF_STOCK","message":"gone",{details}}}' in frame
    assert _json.loads(frame)["body"]["result"] == finish.result
