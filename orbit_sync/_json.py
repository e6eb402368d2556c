"""Strict JSON for ``pulse.worker.v1`` (PROTOCOL §2).

The stdlib parser accepts duplicate keys (last wins), ``NaN``/``Infinity``, ``1e400`` (as inf) and
lone surrogates; every one of them is rejected here. Encoding is compact, UTF-8 and refuses NaN
and lone surrogates, so what we send is what a strict peer accepts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from ._foreign import kept, mapped
from .errors import FrameError

#: One frame is at most 512 KiB of UTF-8 (PROTOCOL §2).
MAX_FRAME_BYTES = 512 * 1024
#: A business ``result`` is at most 256 KiB serialized (PROTOCOL §2).
MAX_RESULT_BYTES = 256 * 1024


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An ``object_pairs_hook`` that refuses a duplicate key (the stdlib keeps the last)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise FrameError("duplicate key in JSON object")
    return obj


def _constant(name: str) -> Any:
    raise FrameError(f"non-finite number {name} in JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise FrameError("number out of range in JSON")
    return value


def _int(text: str) -> int:
    # Every number must be a finite double (PROTOCOL §12): 400 digits are not.
    if len(text) > 310:
        raise FrameError("number out of range in JSON")
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise FrameError("number out of range in JSON") from None
    return value


_DECODER = json.JSONDecoder(
    object_pairs_hook=unique_keys, parse_constant=_constant, parse_float=_float, parse_int=_int
)


_scan: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
_OPENERS = frozenset("{[")


def _decode(text: str) -> Any:
    """``_DECODER.decode(text)``; a document that starts with its object or array and ends with
    it (a frame as peers write it) is scanned directly, without the decoder's two passes over
    surrounding whitespace. Anything else, errors included, takes ``decode`` for its message."""
    if text and text[0] in _OPENERS:
        try:
            value, end = _scan(text, 0)
        except StopIteration:
            pass
        else:
            if end == len(text):
                return value
    return _DECODER.decode(text)


def _check_surrogates(value: Any) -> None:
    # Iterative, so a deeply nested (but parseable) document cannot exhaust the stack here.
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate
        elif isinstance(item, dict):
            for key, sub in item.items():
                key.encode("utf-8")
                stack.append(sub)
        elif isinstance(item, list):
            stack.extend(item)


def loads(data: bytes | str, *, limit: int = MAX_FRAME_BYTES) -> Any:
    """Parse one strict JSON document of at most *limit* UTF-8 bytes."""
    if isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
        if len(raw) > limit:
            raise FrameError(f"frame is {len(raw)} bytes, over the {limit}-byte limit")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise mapped(exc, "frame is not valid UTF-8") from kept(exc)
    else:
        text = data
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise mapped(exc, "frame contains a lone surrogate") from kept(exc)
        if size > limit:
            raise FrameError(f"frame is {size} bytes, over the {limit}-byte limit")
    try:
        value = _decode(text)
    except FrameError:
        raise
    except RecursionError as exc:
        raise mapped(exc, "JSON nested too deeply") from kept(exc)
    except json.JSONDecodeError as exc:
        # Its message names a position, never content (the content is in its doc attribute).
        raise mapped(exc, f"invalid JSON: {exc.msg}") from kept(exc)
    # Escaped surrogates (\\ud800) only exist if the text spells an escape; skip the walk otherwise.
    if "\\u" in text and ("\\ud" in text.lower()):
        try:
            _check_surrogates(value)
        except UnicodeEncodeError as exc:
            raise mapped(exc, "JSON string contains a lone surrogate") from kept(exc)
    return value


def _not_json(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# json.dumps builds a new encoder per call, which is most of what a small document costs: an
# encoder made once serves every call. The C one keeps no table of the containers being written,
# so a cycle recurses until RecursionError, which callers refuse as too deep.
_c_encoder = getattr(json.encoder, "c_make_encoder", None)


def compact_encoder(default: Callable[[Any], Any] = _not_json) -> Callable[[Any], str]:
    """A function serializing compactly as ``json.dumps(value, ensure_ascii=False,
    allow_nan=False, separators=(",", ":"), default=default)`` does, built once."""
    if _c_encoder is None:  # pragma: no cover - CPython has the C encoder
        encoder = json.JSONEncoder(
            ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=default
        )
        return encoder.encode
    chunks = _c_encoder(
        None, default, json.encoder.encode_basestring, None, ":", ",", False, False, False
    )

    def serialize(value: Any) -> str:
        return "".join(chunks(value, 0))

    return serialize


_serialize = compact_encoder()


def dumps(value: Any) -> str:
    """Serialize compactly; refuses NaN, infinities and lone surrogates with FrameError."""
    try:
        text = _serialize(value)
        if not text.isascii():
            text.encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate
    except UnicodeEncodeError:
        raise FrameError("value contains a lone surrogate") from None
    except RecursionError:
        raise FrameError("value nested too deeply") from None
    except (TypeError, ValueError) as exc:
        raise FrameError(f"value is not JSON: {type(exc).__name__}") from None
    return text


def encoded_size(value: Any) -> int:
    """Size in UTF-8 bytes of *value* serialized as :func:`dumps` does."""
    return len(dumps(value).encode("utf-8"))
