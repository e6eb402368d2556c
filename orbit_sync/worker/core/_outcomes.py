"""What a handler's ending becomes on the wire, pure functions, no I/O.

- The outcome rules (the README's "Outcome rules"): :func:`outcome_of` maps a finished call to a
  :class:`Verdict`, which holds a plain-JSON snapshot of the result, never the live object.
- The result as the JSON the server records (docs/results.md): plain JSON costs one
  ``json.dumps`` and one strict parse; anything else goes through the cattrs converter. A value
  that cannot be encoded is reported by key path and type, never content
  (``$.items[2].blob: bytes is not JSON``). The parsed-back copy is what the worker sends.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import json
import math
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import attrs
import cattrs

from ... import _json
from ...errors import FrameError, OrbitError
from ...models import CODE_RE, AttemptRef, Finish, Outcome

__all__ = [
    "CANCEL_REASONS",
    "HANDLER_TIMEOUT",
    "WORKER_LOST",
    "Fail",
    "ResultEncoder",
    "ResultProblem",
    "TaskCancelled",
    "TimeLimitExceeded",
    "UnknownEffect",
    "Verdict",
    "abandoned",
    "not_run",
    "outbox_unavailable",
    "outcome_of",
    "result_converter",
    "stored",
    "unknown",
]

RESULT_NOT_JSON = "RESULT_NOT_JSON"
RESULT_TOO_LARGE = "RESULT_TOO_LARGE"

_PLAIN = (str, int, float, bool, type(None))


def _decimal(value: decimal.Decimal) -> str:
    if not value.is_finite():
        raise ValueError("a non-finite Decimal is not JSON")
    return str(value)


#: The largest integer every JSON reader keeps exactly: readers that hold numbers as doubles
#: (JavaScript, many JSON libraries) round integers beyond it.
MAX_SAFE_INTEGER = 2**53 - 1
LARGE_INTS = ("number", "string", "refuse")


class _ResultConverter(cattrs.Converter):
    """A cattrs converter that says how integers beyond 2**53 are sent."""

    def __init__(self, large_ints: str) -> None:
        super().__init__()
        self.large_ints = large_ints


def result_converter(*, large_ints: str = "number") -> cattrs.Converter:
    """A new converter with the worker's default hooks (see docs/results.md).

    *large_ints* says what happens to an integer beyond 2**53 - 1 in a result: ``"number"``
    (default) sends it as a JSON number, which readers that use doubles round; ``"string"``
    sends its exact decimal text, as for ``Decimal``; ``"refuse"`` makes the result
    ``RESULT_NOT_JSON`` with its key path.

    Extend it with ``register_unstructure_hook`` and pass it as ``Worker(result_converter=...)``::

        converter = result_converter()
        converter.register_unstructure_hook(Money, lambda m: {"amount": str(m.amount), ...})
    """
    if large_ints not in LARGE_INTS:
        raise ValueError(f"large_ints must be one of {', '.join(map(repr, LARGE_INTS))}")
    converter = _ResultConverter(large_ints)
    # cattrs dispatches on the most specific class, so datetime (a date subclass) keeps its own.
    converter.register_unstructure_hook(_dt.datetime, _dt.datetime.isoformat)
    converter.register_unstructure_hook(_dt.date, _dt.date.isoformat)
    converter.register_unstructure_hook(_dt.time, _dt.time.isoformat)
    converter.register_unstructure_hook(decimal.Decimal, _decimal)
    converter.register_unstructure_hook(uuid.UUID, str)
    return converter


class ResultProblem(Exception):
    """A result that cannot be sent: *code* is ``RESULT_NOT_JSON`` or ``RESULT_TOO_LARGE``."""

    def __init__(self, code: str, message: str, *, path: str = "", type_name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.path = path  # where in the result (``$``: the result itself), when known
        self.type_name = type_name  # the offending value's ``module.Class``, when known

    def as_result(self) -> dict[str, Any]:
        """The JSON the server records in place of the result."""
        out: dict[str, Any] = {"error": self.code, "message": self.message}
        if self.path:
            out["path"] = self.path
        if self.type_name:
            out["type"] = self.type_name
        return out


class _Unencodable(TypeError):
    pass


def type_name(value: object) -> str:
    """``value``'s type as ``module.Qualname`` (just ``Qualname`` for builtins)."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _key_path(path: str, key: object) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key) if isinstance(key, str) else repr(key)}]"


class ResultEncoder:
    """Encodes results with one converter; thread-safe (it keeps no per-call state)."""

    def __init__(self, converter: cattrs.BaseConverter | None = None) -> None:
        if converter is not None and not isinstance(converter, cattrs.BaseConverter):
            raise TypeError("result_converter must be a cattrs converter (cattrs.Converter)")
        self.converter = converter if converter is not None else result_converter()
        self._unstructure: Callable[[Any], Any] = self.converter.unstructure
        self._dumps = _json.compact_encoder(self._convert)
        self._large_ints: str = getattr(self.converter, "large_ints", "number")

    def _convert(self, value: Any) -> Any:
        out = self._unstructure(value)
        if isinstance(out, set | frozenset):
            try:
                return sorted(out)
            except TypeError:
                return list(out)
        if out is value:
            raise _Unencodable(value)
        return out

    def encode(self, value: Any) -> Any:
        """A fresh plain-JSON copy of *value*; raise :class:`ResultProblem` if it cannot be sent."""
        return self.encode_with_text(value)[0]

    def encode_with_text(self, value: Any) -> tuple[Any, str, int]:
        """:meth:`encode`, plus the checked text it was parsed from and its UTF-8 size."""
        try:
            text = self._dumps(value)
            if self._large_ints != "number":
                text = self._large(text)
            size = len(text.encode("utf-8"))
        except (TypeError, ValueError, RecursionError, UnicodeEncodeError, FrameError):
            raise self._locate(value) from None
        if size > _json.MAX_RESULT_BYTES:
            raise ResultProblem(
                RESULT_TOO_LARGE,
                f"result is {size} bytes, over the {_json.MAX_RESULT_BYTES}-byte limit",
            )
        try:
            # Strict parse of what will be sent: duplicate keys (1 and "1"), huge integers.
            snapshot = _json.loads(text, limit=_json.MAX_FRAME_BYTES)
        except FrameError as exc:
            located = self._locate(value)
            if located.path:
                raise located from None
            raise ResultProblem(RESULT_NOT_JSON, f"result is not strict JSON: {exc}") from None
        if snapshot is None:
            raise ResultProblem(RESULT_NOT_JSON, "result must be JSON other than null", path="$")
        return snapshot, text, size

    def _large(self, text: str) -> str:
        """*text* with integers beyond 2**53 - 1 as strings (``"refuse"``: raise at the first)."""
        found = False

        def integer(literal: str) -> int | str:
            nonlocal found
            number = int(literal)
            if abs(number) <= MAX_SAFE_INTEGER:
                return number
            if self._large_ints == "refuse":
                raise _Unencodable(literal)
            found = True
            return literal  # a JSON integer's text is already its exact decimal form

        # Python's own parser (unbounded integers), refusing duplicate keys as the strict one does.
        doc = json.loads(text, object_pairs_hook=_json.unique_keys, parse_int=integer)
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")) if found else text

    def _locate(self, value: Any) -> ResultProblem:
        """Walk *value* as the encoder did to name the first thing that cannot be encoded."""
        try:
            self._walk(value, "$", 0)
        except ResultProblem as problem:
            return problem
        except RecursionError:
            pass
        return ResultProblem(RESULT_NOT_JSON, "result is not JSON (nested too deeply)")

    def _walk(self, value: Any, path: str, depth: int) -> None:
        if depth > 200:
            raise ResultProblem(RESULT_NOT_JSON, f"{path}: nested too deeply", path=path)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                self._bad(path, value, "contains a lone surrogate")
            return
        if isinstance(value, float):
            if not math.isfinite(value):
                self._bad(path, value, "is not finite (JSON has no NaN or infinity)")
            return
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SAFE_INTEGER:
            if self._large_ints == "refuse":
                self._bad(
                    path,
                    value,
                    "is beyond 2**53 - 1, which JSON readers using doubles round (refused by "
                    "result_converter(large_ints='refuse'))",
                )
            try:
                float(value)
            except OverflowError:
                self._bad(
                    path,
                    value,
                    "is out of range (a JSON number must be a finite double; "
                    "result_converter(large_ints='string') sends it as text)",
                )
            return
        if isinstance(value, _PLAIN):
            return
        if isinstance(value, dict):
            seen: set[str] = set()
            for key, item in value.items():
                sub = _key_path(path, key)
                if not isinstance(key, _PLAIN):
                    self._bad(sub, key, "is not allowed as an object key (use str keys)")
                name = json.dumps(key) if not isinstance(key, str) else key
                if name in seen:
                    self._bad(sub, key, "duplicates another key once encoded")
                seen.add(name)
                self._walk(item, sub, depth + 1)
            return
        if isinstance(value, list | tuple):
            for index, item in enumerate(value):
                self._walk(item, f"{path}[{index}]", depth + 1)
            return
        try:
            converted = self._convert(value)
        except _Unencodable:
            self._bad(path, value, "is not JSON (register an unstructure hook for it)")
        except Exception as exc:  # a hook that refuses the value (e.g. Decimal('NaN'))
            self._bad(path, value, f"could not be converted ({type(exc).__name__})")
        self._walk(converted, path, depth + 1)

    @staticmethod
    def _bad(path: str, value: object, why: str) -> NoReturn:
        name = type_name(value)
        raise ResultProblem(RESULT_NOT_JSON, f"{path}: {name} {why}", path=path, type_name=name)


#: The encoder used when a worker is given no converter.
DEFAULT_ENCODER = ResultEncoder()


#: Codes of a handler that stopped cooperatively, not for a cancel request: it chose the
#: checkpoint, so stopping there is clean (FAILED, retryable).
STOP_CODES = {
    "shutdown": "WORKER_SHUTDOWN",
    "lease_expired": "LEASE_EXPIRED",
    "lease_lost": "LEASE_LOST",
    "session_replaced": "SESSION_REPLACED",
}
#: Why a TaskContext was cancelled (the first reason wins).
CANCEL_REASONS = frozenset({*STOP_CODES, "cancel_requested", "time_limit"})

HANDLER_ERROR = "HANDLER_ERROR"
CANCELLED = "CANCELLED"
#: A handler still running after shutdown's grace: its effect is uncertain.
SHUTDOWN_TIMEOUT = "SHUTDOWN_TIMEOUT"
#: Past its time limit: FAILED once stopped (or killed); UNKNOWN if its thread runs on.
HANDLER_TIMEOUT = "HANDLER_TIMEOUT"
#: The durable outbox could not record the launch, so the handler was not run.
OUTBOX_UNAVAILABLE = "OUTBOX_UNAVAILABLE"
#: A step of the worker itself failed (a bug) while the attempt was in its hands.
WORKER_ERROR = "WORKER_ERROR"
#: The outcome code of an attempt whose process stopped while its handler ran.
WORKER_LOST = "WORKER_LOST"

_MAX_MESSAGE = 1024


def _check_code(code: object) -> str:
    if type(code) is not str or not CODE_RE.fullmatch(code):
        raise ValueError("code must be 1-64 characters of [A-Z][A-Z0-9_]*, e.g. 'QUOTA_EXCEEDED'")
    return code


def _short(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."


class Fail(OrbitError):
    """Raise from a handler to finish the attempt ``FAILED`` with a stable *code*.

    ``retryable=True`` asks the server to retry the task while attempts and time remain.
    *message* and *details* (any JSON) travel in the result, so keep secrets out of them.
    """

    __module__ = "orbit_sync.worker"  # where users import it from: tracebacks say so

    def __init__(
        self, code: str, message: str = "", *, retryable: bool = False, details: Any = None
    ) -> None:
        _check_code(code)
        super().__init__(f"{code}: {message}" if message else code)
        if type(retryable) is not bool:
            raise TypeError("retryable must be a bool")
        self.code = code
        self.message = message
        self.retryable = retryable
        self.details = details


class UnknownEffect(OrbitError):
    """Raise from a handler when its effect is uncertain: the attempt finishes ``UNKNOWN``.

    The server retries the task only if its retry policy is ``IDEMPOTENT`` (and it was not
    cancelled and budget remains); otherwise the task goes to ``NEEDS_REVIEW``.
    """

    __module__ = "orbit_sync.worker"  # where users import it from: tracebacks say so

    def __init__(self, code: str, message: str = "", *, details: Any = None) -> None:
        _check_code(code)
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.details = details


class TaskCancelled(BaseException):
    """Raised by ``ctx.raise_if_cancelled()`` once the context is cancelled.

    A ``BaseException`` (like ``asyncio.CancelledError``) so that a handler's broad
    ``except Exception:`` does not swallow the stop by accident.
    """

    __module__ = "orbit_sync.worker"  # where users import it from: tracebacks say so

    def __init__(self, reason: str) -> None:
        super().__init__(f"task cancelled: {reason}")
        self.reason = reason


class TimeLimitExceeded(TaskCancelled):
    """Raised in a handler's thread when it runs past its ``time_limit`` (the worker raises it
    asynchronously, see ``docs/process-executor.md`` and the README for what that can and cannot
    interrupt). Its ``reason`` is ``time_limit``. Catch it only to clean up, then re-raise:
    the attempt finishes ``FAILED`` with ``HANDLER_TIMEOUT``.
    """

    __module__ = "orbit_sync.worker"  # where users import it from: tracebacks say so

    def __init__(self) -> None:
        super().__init__("time_limit")


@attrs.frozen
class Verdict:
    """The finish content decided for one attempt (everything but the AttemptRef)."""

    outcome: Outcome
    result: Any
    error_code: str | None = None
    retryable: bool | None = None
    ran: bool = True  # False: started on the server, the handler never ran
    duration: float | None = attrs.field(default=None, eq=False)  # seconds, if timed
    #: Why the result or details could not be sent (logged at ERROR), if so.
    problem: str | None = attrs.field(default=None, eq=False)

    def finish(self, ref: AttemptRef) -> Finish:
        """The ``task.finish`` body for *ref*."""
        return Finish(
            ref=ref,
            outcome=self.outcome,
            result=self.result,
            error_code=self.error_code,
            retryable=self.retryable,
        )


def _failed(result: dict[str, Any], retryable: bool | None, **more: Any) -> Verdict:
    """A ``FAILED`` verdict whose error code is *result*'s ``error``."""
    return Verdict(Outcome.FAILED, result, result["error"], retryable, **more)


def _cancelled(**more: Any) -> Verdict:
    """The verdict of a cancel request honoured."""
    result = {"cancelled": True, "reason": "cancel_requested"}
    if more.get("ran") is False:
        result["ran"] = False
    return Verdict(Outcome.CANCELLED, result, CANCELLED, **more)


def outcome_of(
    *,
    value: Any = None,
    error: BaseException | None = None,
    cancel_requested: bool = False,
    cancel_reason: str | None = None,
    encoder: ResultEncoder = DEFAULT_ENCODER,
    duration: float | None = None,
    timeout_retryable: bool = False,
) -> Verdict:
    """Map how a handler ended (its return *value* or raised *error*) to a :class:`Verdict`.

    *cancel_requested*: the server asked to cancel (push or lease); *cancel_reason*: the
    context's, if cancelled; *timeout_retryable*: whether a handler stopped at its time limit
    is retried. The result is encoded with *encoder* now.
    """
    if error is None:
        try:
            result = encoder.encode({} if value is None else value)
        except ResultProblem as problem:
            return _failed(problem.as_result(), False, duration=duration, problem=problem.message)
        return Verdict(Outcome.SUCCEEDED, result, duration=duration)
    if isinstance(error, Fail | UnknownEffect):
        code = error.code
        outcome, retryable = Outcome.UNKNOWN, None
        if isinstance(error, Fail):
            outcome, retryable = Outcome.FAILED, error.retryable
        raw: dict[str, Any] = {"error": code}
        if error.message:
            raw["message"] = _short(error.message)
        if error.details is not None:
            raw["details"] = error.details
        try:
            return Verdict(outcome, encoder.encode(raw), code, retryable, duration=duration)
        except ResultProblem as problem:
            # The handler chose the outcome; only its details cannot travel: they are dropped.
            result = {"error": code, "result_dropped": problem.code, "message": problem.message}
            return Verdict(
                outcome, result, code, retryable, duration=duration, problem=problem.message
            )
    if isinstance(error, TaskCancelled) and cancel_reason is not None:
        if cancel_requested:
            return _cancelled(duration=duration)
        if isinstance(error, TimeLimitExceeded) or cancel_reason == "time_limit":
            timeout = {"error": HANDLER_TIMEOUT, "stopped": "time_limit"}
            return _failed(timeout, timeout_retryable, duration=duration)
        code = STOP_CODES.get(cancel_reason, HANDLER_ERROR)
        return _failed({"error": code, "stopped": cancel_reason}, True, duration=duration)
    # Only the exception's type travels: its message may quote data or credentials.
    raised = {"error": HANDLER_ERROR, "exception": type_name(error)}
    return _failed(raised, False, duration=duration)


def outbox_unavailable() -> Verdict:
    """Not run, the launch could not be recorded: nothing happened, a retryable ``FAILED``."""
    return _failed({"error": OUTBOX_UNAVAILABLE, "ran": False}, True, ran=False)


def not_run(*, cancel_requested: bool, reason: str | None) -> Verdict:
    """Started on the server, handler never run: nothing happened, so a cancel is
    ``CANCELLED`` and anything else a retryable ``FAILED``."""
    if cancel_requested:
        return _cancelled(ran=False)
    code = STOP_CODES.get(reason or "lease_expired", "LEASE_EXPIRED")
    return _failed({"error": code, "ran": False}, True, ran=False)


#: The message of each ``UNKNOWN`` finish the worker decides itself, by its error code.
_UNKNOWN_WHY = {
    SHUTDOWN_TIMEOUT: "handler still running at shutdown",
    HANDLER_TIMEOUT: "handler still running past its time limit",
    WORKER_ERROR: "the worker failed while processing the attempt",
    WORKER_LOST: "the worker process stopped while the handler ran",
}


def unknown(code: str) -> Verdict:
    """The worker's own ``UNKNOWN`` finish (*code*: of :data:`_UNKNOWN_WHY`): the effect is
    uncertain, so the attempt is finished so (for review or retry), never dropped."""
    return Verdict(Outcome.UNKNOWN, {"error": code, "message": _UNKNOWN_WHY[code]}, code)


def abandoned() -> Verdict:
    """A handler that did not return by the end of shutdown's grace."""
    return unknown(SHUTDOWN_TIMEOUT)


def stored(finish: Finish) -> Verdict:
    """The verdict a finish stored in the outbox carries (its result as it was sent)."""
    return Verdict(finish.outcome, finish.result, finish.error_code, finish.retryable)
