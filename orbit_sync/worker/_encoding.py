"""A handler's return value as the JSON the server records: a cattrs converter plus strict JSON
(docs/results.md: what each kind of value becomes, and the rules that still hold after it).

Plain JSON values go to the encoder as they are, so the common case costs one ``json.dumps`` and
one strict parse; anything else is handed to the result converter and what it returns encoded in
turn. A value that still cannot be encoded is reported with its key path and type, never its
content (``$.items[2].blob: bytes is not JSON``). The parsed-back copy is what the worker sends.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import json
import math
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import cattrs

from .. import _json
from ..errors import FrameError

__all__ = ["ResultEncoder", "ResultProblem", "result_converter"]

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
    """A cattrs converter that also says how integers beyond 2**53 are sent."""

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
        #: Where in the result the problem is (``$`` is the result itself), when known.
        self.path = path
        #: The offending value's type (``module.Class``), when known.
        self.type_name = type_name

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


_LARGE_INT_WHY = (
    "is beyond 2**53 - 1, which JSON readers using doubles round (refused by "
    "result_converter(large_ints='refuse'))"
)


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
        """One conversion step for a value the JSON encoder does not know."""
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
        """:meth:`encode`, plus the text the copy was parsed from and its size in UTF-8 bytes:
        checked strict JSON within the limits, so the finish can send it as it is."""
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
        """*text* with its integers beyond 2**53 - 1 as decimal strings (``large_ints="string"``),
        or ``ResultProblem`` naming the first one (``"refuse"``)."""
        # Python's own parser (unbounded integers), refusing duplicate keys as the strict one does.
        doc = json.loads(text, object_pairs_hook=_json.unique_keys)
        root = [doc]
        changed = False
        stack: list[tuple[Any, Any, str]] = [(root, 0, "$")]
        while stack:
            holder, key, path = stack.pop()
            item = holder[key]
            if isinstance(item, dict):
                # Reversed onto the stack: the first offending value in document order is named.
                stack.extend((item, k, _key_path(path, k)) for k in reversed(item))
            elif isinstance(item, list):
                stack.extend((item, i, f"{path}[{i}]") for i in reversed(range(len(item))))
            elif type(item) is int and abs(item) > MAX_SAFE_INTEGER:
                if self._large_ints == "refuse":
                    self._bad(path, item, _LARGE_INT_WHY)
                holder[key] = str(item)
                changed = True
        if not changed:
            return text
        return json.dumps(root[0], ensure_ascii=False, separators=(",", ":"))

    # ------------------------------------------------------------------ the slow path

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
        if type(value) is int and abs(value) > MAX_SAFE_INTEGER:
            if self._large_ints == "refuse":
                self._bad(path, value, _LARGE_INT_WHY)
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
