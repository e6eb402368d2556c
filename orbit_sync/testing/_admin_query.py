"""Admin API arguments: a query string and/or a JSON object body, parsed strictly.

Both forms name the same parameters. In the query string every value is text (a JSON-valued
argument such as a task ``payload`` is strict JSON text in one parameter); in a JSON body values
keep their JSON types (``"max_attempts": 5``, ``"payload": {"w": 1}``, ``"paused": true``), and
``null`` means "not given". A name given in both, or twice, is an error; so is any name the
endpoint does not know. Error messages name the parameter at fault, never a value sent to us.
"""

from __future__ import annotations

import datetime as _dt
import math
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from .. import _json
from .._codec import parse_time
from ..errors import FrameError
from ..models import ID_RE

__all__ = ["Params", "Problem", "bad", "not_found", "parse_body"]

#: Query parameters per request: enough for the widest endpoint, small enough to parse cheaply.
MAX_FIELDS = 32
#: Parameter names we may repeat in an error message (anything else could be pasted data).
_SAFE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_UINT = re.compile(r"0|[1-9][0-9]{0,8}")
_SECONDS = re.compile(r"(0|[1-9][0-9]{0,9})(\.[0-9]{1,9})?")
_JSON_TYPES = ("application/json",)
_FORM_TYPES = ("application/x-www-form-urlencoded",)


class Problem(Exception):
    """An answer other than 2xx: status, stable code, public message (never a secret)."""

    def __init__(
        self, status: int, code: str, message: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = tuple(headers)


def bad(message: str) -> Problem:
    """A 400 ``INVALID_ARGUMENT``."""
    return Problem(400, "INVALID_ARGUMENT", message)


def not_found(message: str) -> Problem:
    """A 404 ``NOT_FOUND``."""
    return Problem(404, "NOT_FOUND", message)


def shown(name: str) -> str:
    """*name* quoted when it looks like a parameter name, else a placeholder (never echo data)."""
    return f"'{name}'" if _SAFE_NAME.fullmatch(name) else "(unprintable name)"


def parse_body(content_type: str | None, body: bytes, limit: int) -> tuple[Any, str]:
    """The arguments a request body carries: ``(JSON value, "")`` for ``application/json``, or
    ``(None, query text)`` for a form body. An empty body carries none."""
    if not body:
        return None, ""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in _JSON_TYPES:
        try:
            return _json.loads(body, limit=limit), ""
        except FrameError as exc:
            # FrameError messages describe the defect, never the content.
            raise bad(f"the body is not strict JSON: {exc}") from None
    if media in _FORM_TYPES:
        try:
            return None, body.decode("ascii")
        except UnicodeDecodeError:
            raise bad("a form body must be percent-encoded ASCII") from None
    raise Problem(
        415,
        "UNSUPPORTED_MEDIA_TYPE",
        "send a body as Content-Type: application/json (or application/x-www-form-urlencoded)",
    )


class Params:
    """Strict parameters: each given once, each known, each well-formed.

    *query* is the query string (or a form body); *body* a JSON object's members. *where*
    prefixes every error message (``tasks[3]: ...`` in a bulk request)."""

    def __init__(
        self, query: str = "", body: Mapping[str, Any] | None = None, *, where: str = ""
    ) -> None:
        self._where = where
        pairs: list[tuple[str, str]] = []
        if query:
            try:
                pairs = urllib.parse.parse_qsl(
                    query,
                    keep_blank_values=True,
                    strict_parsing=True,
                    encoding="utf-8",
                    errors="strict",
                    max_num_fields=MAX_FIELDS,
                )
            except ValueError:
                # parse_qsl's own messages quote the offending field: never echo it.
                raise self.bad(
                    "malformed query string: expected name=value pairs, percent-encoded UTF-8, "
                    f"at most {MAX_FIELDS} of them"
                ) from None
        # name -> (came from JSON, value)
        self._values: dict[str, tuple[bool, Any]] = {}
        for name, text in pairs:
            self._put(name, False, text)
        for name, value in (body or {}).items():
            self._put(name, True, value)
        self._used: set[str] = set()

    def _put(self, name: str, typed: bool, value: Any) -> None:
        if name in self._values:
            raise self.bad(f"parameter {shown(name)} is given more than once")
        self._values[name] = (typed, value)

    def bad(self, message: str) -> Problem:
        return bad(self._where + message)

    def _get(self, name: str) -> tuple[bool, Any]:
        """``(typed, value)``; value ``None`` when not given (or JSON null)."""
        self._used.add(name)
        return self._values.get(name, (False, None))

    def given(self, name: str) -> bool:
        """Whether *name* was sent at all (JSON null included)."""
        self._used.add(name)
        return name in self._values

    def means_none(self, name: str) -> bool:
        """Whether *name* says "none": JSON null, or the text ``none`` in a query."""
        typed, value = self._get(name)
        return value is None or (not typed and value == "none")

    def only(self, known: Iterable[str]) -> None:
        """Refuse any parameter outside *known*."""
        unknown = sorted(set(self._values) - set(known))
        if unknown:
            raise self.bad(f"unknown parameter {shown(unknown[0])}")

    def done(self) -> None:
        """Refuse parameters no handler asked for: a typo must not be silently ignored."""
        unknown = sorted(set(self._values) - self._used)
        if unknown:
            raise self.bad(f"unknown parameter {shown(unknown[0])}")

    def text(self, name: str, *, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
        value = self.opt_text(name, pattern=pattern, what=what)
        if value is None:
            raise self.bad(f"parameter '{name}' is required")
        return value

    def opt_text(
        self, name: str, *, pattern: re.Pattern[str] | None = None, what: str = ""
    ) -> str | None:
        _, value = self._get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.bad(f"parameter '{name}' must be a string")
        if pattern is not None and not pattern.fullmatch(value):
            raise self.bad(f"parameter '{name}' must be {what}")
        return value

    def opt_id(self, name: str) -> str | None:
        return self.opt_text(name, pattern=ID_RE, what="32 lowercase hex characters")

    def opt_int(self, name: str, low: int, high: int) -> int | None:
        typed, value = self._get(name)
        if value is None:
            return None
        number: int | None = None
        if typed and type(value) is int:
            number = value
        elif not typed and _UINT.fullmatch(value):
            number = int(value)
        if number is None or not low <= number <= high:
            raise self.bad(f"parameter '{name}' must be a decimal integer from {low} to {high}")
        return number

    def opt_seconds(self, name: str, *, high: float = 1e9, positive: bool = False) -> float | None:
        typed, value = self._get(name)
        if value is None:
            return None
        seconds = math.nan
        if (typed and type(value) in (int, float)) or (not typed and _SECONDS.fullmatch(value)):
            seconds = float(value)
        if not (seconds > 0 if positive else seconds >= 0) or not seconds <= high:
            low = "> 0" if positive else ">= 0"
            raise self.bad(
                f"parameter '{name}' must be a plain decimal number of seconds, {low} and "
                f"<= {high:g}"
            )
        return seconds

    def opt_bool(self, name: str) -> bool | None:
        typed, value = self._get(name)
        if value is None:
            return None
        if typed and isinstance(value, bool):
            return value
        if not typed and value in ("true", "false"):
            return bool(value == "true")
        raise self.bad(f"parameter '{name}' must be true or false")

    def opt_json(self, name: str) -> Any:
        """A JSON value: as sent in a JSON body, or strict JSON text in the query string."""
        typed, value = self._get(name)
        if value is None or typed:
            return value
        try:
            return _json.loads(value)
        except FrameError as exc:
            raise self.bad(f"parameter '{name}' is not strict JSON: {exc}") from None

    def opt_moment(self, name: str) -> float | _dt.datetime | None:
        """Seconds from now, or an RFC 3339 UTC time."""
        typed, value = self._get(name)
        if value is None:
            return None
        if typed and type(value) in (int, float):
            if math.isfinite(value) and value >= 0:
                return float(value)
        elif isinstance(value, str):
            if _SECONDS.fullmatch(value):
                return float(value)
            try:
                return parse_time(value)
            except ValueError:
                pass
        raise self.bad(f"parameter '{name}' must be seconds from now or an RFC 3339 UTC time")

    def opt_list(self, name: str, *, pattern: re.Pattern[str], what: str) -> list[str] | None:
        """A JSON array of strings, or comma-separated text."""
        typed, value = self._get(name)
        if value is None:
            return None
        if typed and isinstance(value, list):
            items = value
        elif isinstance(value, str):
            items = [] if value == "" else value.split(",")
        else:
            items = [None]
        for item in items:
            if not isinstance(item, str) or not pattern.fullmatch(item):
                raise self.bad(f"parameter '{name}' must be a comma-separated list of {what}")
        return items
