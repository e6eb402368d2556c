"""Wire models: Hypothesis round trips, construction-time validation and redaction."""

from __future__ import annotations

import datetime as dt
import pickle
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_sync import _bodies, _codec, _json, errors
from orbit_sync.models import (
    Assignment,
    AttemptRef,
    AttemptState,
    CancelNotice,
    Capability,
    CapacityReport,
    CommandResult,
    Disposition,
    Finish,
    Lease,
    Operation,
    Outcome,
    Receipt,
    Registration,
    Task,
    TaskState,
    Welcome,
    new_secret,
)
from orbit_sync.testing import ManualClock
from tests.test_wire_bodies import INDEPENDENT

ids = st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
secrets_ = st.builds(lambda _: new_secret(), st.integers())
counters = st.integers(min_value=1, max_value=2**63)
handlers = st.from_regex(r"[a-z][a-z0-9._-]{0,63}", fullmatch=True)
versions = counters.map(str)
codes = st.from_regex(r"[A-Z][A-Z0-9_]{0,63}", fullmatch=True)
# Second resolution keeps arithmetic simple; microseconds are exercised by the time tests.
times = st.datetimes(
    min_value=dt.datetime(2000, 1, 1),
    max_value=dt.datetime(2200, 1, 1),
    timezones=st.just(dt.timezone.utc),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
).filter(lambda v: v is not None)

capabilities = st.builds(Capability, handlers, versions, versions)
registrations = st.builds(
    Registration,
    queue_id=ids,
    capabilities=st.lists(capabilities, min_size=1, max_size=32, unique=True),
    capacity=st.integers(1, 256),
    instance_id=ids,
    instance_secret=secrets_,
    cancellation_notifications=st.booleans(),
)
capacity_reports = st.builds(
    CapacityReport, sequence=counters, capacity=st.integers(0, 256), drain=st.booleans()
)
attempt_refs = st.builds(AttemptRef, ids, ids, counters, secrets_)


@st.composite
def finishes(draw: st.DrawFn) -> Finish:
    """A Finish obeying the outcome rules."""
    outcome = draw(st.sampled_from(Outcome))
    code = None if outcome is Outcome.SUCCEEDED else draw(codes)
    retryable = draw(st.none() | st.booleans()) if outcome is Outcome.FAILED else None
    return Finish(draw(attempt_refs), outcome, draw(json_values), code, retryable)


@st.composite
def tasks(draw: st.DrawFn) -> Task:
    """A Task whose attempt never exceeds max_attempts."""
    maximum = draw(counters)
    return Task(
        draw(ids),
        draw(ids),
        draw(ids),
        draw(handlers),
        draw(versions),
        draw(versions),
        draw(json_values),
        draw(st.sampled_from(TaskState)),
        draw(counters),
        draw(st.integers(1, maximum)),
        maximum,
    )


@st.composite
def leases(draw: st.DrawFn) -> Lease:
    """A Lease: active ones with a window in (0, 2 min] and state LEASED/RUNNING."""
    server_time = draw(times)
    active = draw(st.booleans())
    if active:
        state = draw(st.sampled_from([AttemptState.LEASED, AttemptState.RUNNING]))
        window = dt.timedelta(milliseconds=draw(st.integers(1, 120_000)))
    else:
        state = draw(st.sampled_from(AttemptState))
        window = dt.timedelta(seconds=draw(st.integers(-600, 600)))
    cancel = draw(st.none() | times)
    return Lease(active, state, server_time + window, server_time, cancel)


receipts = st.builds(
    Receipt,
    st.sampled_from(Operation),
    st.sampled_from(TaskState),
    st.sampled_from(AttemptState),
    counters,
    times,
    st.sampled_from(Disposition),
)
command_results = st.builds(CommandResult, receipts, leases(), st.booleans())


@st.composite
def welcomes(draw: st.DrawFn) -> Welcome:
    """A Welcome whose session window is in (0, 5 min]."""
    server_time = draw(times)
    window = dt.timedelta(milliseconds=draw(st.integers(1, 300_000)))
    return Welcome(
        draw(ids),
        draw(counters),
        server_time,
        server_time + window,
        draw(st.integers(1000, 120_000)),
        draw(st.booleans()),
    )


assignments = st.builds(Assignment, tasks(), ids, counters, secrets_, times, times)
cancel_notices = st.builds(CancelNotice, ids, ids, counters, times)


@settings(max_examples=60)
@given(
    st.one_of(registrations, capacity_reports, attempt_refs, finishes()).map(lambda m: (m, True))
    | st.one_of(
        tasks(), assignments, leases(), receipts, command_results, welcomes(), cancel_notices
    ).map(lambda m: (m, False))
)
def test_round_trip(case: tuple[Any, bool]) -> None:
    """Every model survives unstructure → JSON → its body decoder."""
    model, _ = case
    wire = _json.loads(_json.dumps(_codec.unstructure(model)))
    assert _codec.decode_body(wire, type(model)) == model


ALL_MODELS = st.one_of(
    registrations,
    capacity_reports,
    attempt_refs,
    finishes(),
    tasks(),
    assignments,
    leases(),
    receipts,
    command_results,
    welcomes(),
    cancel_notices,
)


@settings(max_examples=80)
@given(ALL_MODELS)
def test_wire_forms_pass_an_independent_checker(model: Any) -> None:
    """Each model's wire form is what the contract says, read by a checker sharing no code."""
    INDEPENDENT[type(model)](_codec.unstructure(model))


class _Subclass(AttemptRef):
    pass


def test_a_subclass_travels_as_its_model() -> None:
    """A subclass of a model has the model's wire form; a non-model is refused."""
    ref = AttemptRef("1" * 32, "2" * 32, 1, SECRET)
    sub = _Subclass("1" * 32, "2" * 32, 1, SECRET)
    assert _codec.unstructure(sub) == _codec.unstructure(ref)
    with pytest.raises(TypeError):
        _codec.unstructure(object())


@settings(max_examples=50)
@given(finishes(), ids, ids)
def test_finish_frame_is_the_generic_encoding(finish: Finish, mid: str, sid: str) -> None:
    """A finish frame built around its once-serialized result is the generic frame, to the byte."""
    body = _codec.unstructure(finish)
    expected = _codec.encode_frame("task.finish", mid, session_id=sid, body=body)
    assert _codec.encode_request("task.finish", mid, sid, finish) == expected


def test_finish_result_limit_counts_utf8_bytes() -> None:
    """A result of exactly 256 KiB of UTF-8 (2-byte characters) is sent; one byte more is not."""
    room = 256 * 1024 - len('{"k":""}')
    fits = {"k": "\u00e9" * (room // 2)}
    assert _json.encoded_size(fits) == 256 * 1024
    text = _codec.encode_request("task.finish", "4" * 32, "3" * 32, Finish(REF, "SUCCEEDED", fits))
    assert _codec.decode_client_frame(text).body.result == fits
    over = {"k": fits["k"] + "a"}
    with pytest.raises(errors.FrameError, match="262145 bytes"):
        _codec.encode_request("task.finish", "4" * 32, "3" * 32, Finish(REF, "SUCCEEDED", over))


@given(registrations)
def test_registration_encodes_as_the_server_expects(reg: Registration) -> None:
    """A hello built from any valid Registration passes the server's strict validator."""
    raw = _codec.encode_request("worker.hello", "4" * 32, None, reg)
    assert _codec.decode_client_frame(raw).body == reg


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (dt.datetime(2026, 9, 17, 8, 0, 30, tzinfo=dt.timezone.utc), "2026-09-17T08:00:30Z"),
        (
            dt.datetime(2026, 9, 17, 8, 0, 30, 120000, tzinfo=dt.timezone.utc),
            "2026-09-17T08:00:30.12Z",
        ),
        (
            dt.datetime(2026, 9, 17, 8, 0, 30, 1, tzinfo=dt.timezone.utc),
            "2026-09-17T08:00:30.000001Z",
        ),
        (dt.datetime(999, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc), "0999-01-02T03:04:05Z"),
        (
            dt.datetime(2026, 9, 17, 10, 0, 30, 500, tzinfo=dt.timezone(dt.timedelta(hours=2))),
            "2026-09-17T08:00:30.0005Z",
        ),
    ],
)
def test_time_format_is_utc_z_with_significant_fraction(value: dt.datetime, text: str) -> None:
    """Four year digits, UTC with Z, and a fraction only with its significant digits."""
    assert _codec.format_time(value) == text


@given(st.datetimes(timezones=st.just(dt.timezone.utc)))
def test_time_round_trip(value: dt.datetime) -> None:
    """format_time and parse_time are inverses to the microsecond."""
    assert _codec.parse_time(_codec.format_time(value)) == value


@pytest.mark.parametrize(
    "text",
    [
        "2026-09-17T08:00:30+00:00",
        "2026-09-17 08:00:30Z",
        "2026-09-17",
        "2026-09-17T08:00:30.1234567890Z",
        "2026-09-17t08:00:30z",
        "2026-02-30T08:00:30Z",
        "\uff12026-09-17T08:00:30Z",  # a full-width digit is not [0-9]
    ],
)
def test_time_rejects(text: str) -> None:
    """Times must be RFC 3339 UTC with Z and at most 9 fraction digits."""
    with pytest.raises(ValueError):
        _codec.parse_time(text)


def test_time_nanoseconds_truncate() -> None:
    """Nine fraction digits are accepted and kept to the microsecond."""
    t = _codec.parse_time("2026-09-17T08:00:30.123456789Z")
    assert t.microsecond == 123456


@given(
    st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59)),
    st.text("0123456789", min_size=0, max_size=9),
)
def test_time_reads_every_fraction_as_the_calendar_does(whole: dt.datetime, fraction: str) -> None:
    """A wire time with 0 to 9 fraction digits reads as its calendar moment in UTC, cut to the
    microsecond, with the digits below it as nanoseconds (each Python reads it its own way)."""
    text = whole.strftime("%Y-%m-%dT%H:%M:%S").rjust(19, "0") + (f".{fraction}" if fraction else "")
    text += "Z"
    if len(text) == 21:  # a "." with no digit after it
        return
    expected = whole.replace(microsecond=int(fraction[:6].ljust(6, "0")), tzinfo=dt.timezone.utc)
    value, nanoseconds = _bodies.parse_time_ns(text)
    assert (value, value.tzinfo) == (expected, dt.timezone.utc)
    assert nanoseconds == int(fraction[6:].ljust(3, "0"))
    assert _codec.parse_time(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "2026-02-29T00:00:00Z",
        "2026-13-01T00:00:00Z",
        "2026-01-01T24:00:00Z",
        "2026-01-01T00:60:00Z",
        "2026-01-01T00:00:60Z",
        "0000-01-01T00:00:00Z",
    ],
)
def test_time_that_is_no_calendar_moment_is_refused_as_such(text: str) -> None:
    """A time of the right form but no real date and time is refused with that reason."""
    with pytest.raises(ValueError, match="is not a real date and time"):
        _codec.parse_time(text)


@pytest.mark.parametrize("text", ["01", "+1", " 1", "1 ", "1.0", "\u0661", "-1", ""])
def test_counter_rejects(text: str) -> None:
    """Counters are canonical decimal strings only."""
    with pytest.raises(ValueError):
        _codec.parse_counter(text)


def test_counter_rejects_numbers() -> None:
    """A JSON number is never a counter."""
    with pytest.raises(TypeError):
        _codec.parse_counter(1)


SECRET = new_secret()
REF = AttemptRef("1" * 32, "2" * 32, 1, SECRET)

BAD_ARGUMENTS = [
    (lambda: Capability("Resize", "1", "1"), "handler"),
    (lambda: Capability("resize", "0", "1"), "handler_version"),
    (lambda: Capability("resize", "01", "1"), "handler_version"),
    (lambda: Capability("resize", True, "1"), "handler_version"),
    (lambda: Registration("A" * 32, [Capability("a", 1, 1)], 1), "queue_id"),
    (lambda: Registration("a" * 32, [], 1), "capabilities"),
    (lambda: Registration("a" * 32, [Capability("a", 1, 1)] * 2, 1), "distinct"),
    (lambda: Registration("a" * 32, [Capability("a", 1, 1)], 0), "capacity"),
    (lambda: Registration("a" * 32, [Capability("a", 1, 1)], 257), "capacity"),
    (lambda: Registration("a" * 32, [Capability("a", 1, 1)], True), "capacity"),
    (lambda: Registration("a" * 32, [Capability("a", 1, 1)], 1, instance_secret="x"), "secret"),
    (lambda: CapacityReport(0, 1), "sequence"),
    (lambda: CapacityReport(1, 257), "capacity"),
    (lambda: CapacityReport(1, 1, drain=1), "drain"),  # type: ignore[arg-type]
    (lambda: AttemptRef("1" * 32, "2" * 32, 0, SECRET), "epoch"),
    (lambda: AttemptRef("1" * 32, "2" * 32, 1, SECRET + "="), "lease_secret"),
    (lambda: AttemptRef("1" * 32, "2" * 32, 1, SECRET[:42]), "lease_secret"),
    (lambda: Finish(REF, Outcome.SUCCEEDED, {}, error_code="X"), "error_code"),
    (lambda: Finish(REF, Outcome.FAILED, {}), "error_code"),
    (lambda: Finish(REF, Outcome.FAILED, {}, error_code="bad"), "error_code"),
    (lambda: Finish(REF, Outcome.FAILED, {}, error_code="X" * 65), "error_code"),
    (lambda: Finish(REF, Outcome.UNKNOWN, {}, error_code="X", retryable=True), "retryable"),
    (lambda: Finish(REF, Outcome.SUCCEEDED, None), "result"),
    (lambda: Finish(REF, "DONE", {}), "Outcome"),
]


@pytest.mark.parametrize("build,word", BAD_ARGUMENTS)
def test_bad_arguments_raise(build: Any, word: str) -> None:
    """Invalid arguments raise ValueError/TypeError naming the field, never echoing a secret."""
    with pytest.raises((ValueError, TypeError)) as info:
        build()
    assert word in str(info.value)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    "result",
    [
        float("nan"),
        {"x": float("inf")},
        "\ud800",
        {1: "a", "1": "b"},
        10**400,
        {"big": "x" * (256 * 1024)},
        object(),
    ],
    ids=["nan", "inf", "surrogate", "dup-keys", "huge-int", "over-256KiB", "not-json"],
)
def test_bad_results_refused_before_sending(result: Any) -> None:
    """A result a strict peer would reject is refused by encode_request with FrameError."""
    finish = Finish(REF, Outcome.SUCCEEDED, result)
    with pytest.raises(errors.FrameError):
        _codec.encode_request("task.finish", "4" * 32, "3" * 32, finish)


def test_reprs_redact_secrets() -> None:
    """repr() and str() of models with secrets never show them."""
    reg = Registration("a" * 32, [Capability("a", 1, 1)], 1)
    models: list[Any] = [reg, REF, Finish(REF, Outcome.SUCCEEDED, {})]
    for model in models:
        for text in (repr(model), str(model)):
            assert SECRET not in text
            assert reg.instance_secret not in text
            assert "redacted" in text


def test_per_process_instance() -> None:
    """Registrations of one process share instance_id and instance_secret."""
    a = Registration("a" * 32, [Capability("a", 1, 1)], 1)
    b = Registration("b" * 32, [Capability("b", 1, 1)], 2)
    assert (a.instance_id, a.instance_secret) == (b.instance_id, b.instance_secret)


def test_lease_deadline_and_may_run() -> None:
    """The local deadline is t_sent + server window - 250 ms; may_run needs RUNNING, no cancel."""
    now = dt.datetime(2026, 9, 17, 8, 0, tzinfo=dt.timezone.utc)
    lease = Lease(True, AttemptState.RUNNING, now + dt.timedelta(seconds=30), now)
    anchored = lease.with_deadline(100.0)
    assert anchored.deadline == pytest.approx(129.75)
    assert anchored.may_run(ManualClock(129.7))
    assert not anchored.may_run(ManualClock(129.75))
    assert anchored.remaining(ManualClock(120.0)) == pytest.approx(9.75)
    reserved = attrs.evolve(anchored, state=AttemptState.LEASED)
    assert not reserved.may_run(ManualClock(100.0))
    cancelled = attrs.evolve(anchored, cancel_requested_at=now)
    assert not cancelled.may_run(ManualClock(100.0))
    inactive = Lease(False, AttemptState.EXPIRED, now, now).with_deadline(100.0)
    assert inactive.deadline is None
    assert not inactive.may_run(ManualClock(100.0))
    assert lease.may_run(ManualClock(0.0)) is False  # never anchored: grants nothing


def test_anchoring_builds_new_models_and_changes_none() -> None:
    """with_deadline returns new models, built by their validating constructors; the lease and
    the command result it started from keep no deadline."""
    now = dt.datetime(2026, 9, 17, 8, 0, tzinfo=dt.timezone.utc)
    lease = Lease(True, AttemptState.RUNNING, now + dt.timedelta(seconds=30), now)
    receipt = Receipt("start", "RUNNING", "RUNNING", 3, lease.lease_until, "APPLIED")
    result = CommandResult(receipt, lease, False)
    anchored = result.with_deadline(100.0)
    assert anchored is not result and anchored.lease is not lease
    assert anchored.lease.deadline == pytest.approx(129.75)
    assert (anchored.receipt, anchored.deduplicated) == (receipt, False)
    assert lease.deadline is None and result.lease.deadline is None


def test_errors_pickle_with_attributes() -> None:
    """Errors survive pickling with their code, status and message_id."""
    err = errors.WorkerError("LEASE_LOST", "gone", message_id="5" * 32)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.code, copy.message, copy.message_id) == ("LEASE_LOST", "gone", "5" * 32)
    http = pickle.loads(pickle.dumps(errors.HTTPError(401)))
    assert http.status_code == 401
    timeout = errors.CallTimeout("no answer", message_id="6" * 32)
    assert isinstance(timeout, TimeoutError)
    assert pickle.loads(pickle.dumps(timeout)).message_id == "6" * 32
    assert timeout.with_message_id("7" * 32).message_id == "7" * 32
