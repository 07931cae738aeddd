"""JSON in and out: orjson when importable, the stdlib otherwise, with identical results.

Parsing rules (api.md §2.2): strict UTF-8, no NaN/Infinity, at most 64 levels of nesting, the
last of a repeated member wins. orjson refuses integers beyond 64 bits, which the spec wants
reported as range errors (422), so a body orjson refuses is re-parsed by the stdlib before it is
called invalid.
"""

from __future__ import annotations

import json
import math
from typing import Any, Final

_orjson: Any
try:  # pragma: no cover - exercised by whichever is installed
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

__all__ = ["MAX_DEPTH", "JSONSyntaxError", "dumps", "loads", "loads_exact", "loads_with_hints", "FAST_PARSER"]

FAST_PARSER = _orjson is not None

MAX_DEPTH = 64


class JSONSyntaxError(ValueError):
    """The text is not valid JSON; `detail` describes why."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"invalid number `{name}`")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("number out of range")
    return value


_decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _too_deep(value: Any) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return False


def _stdlib_loads(data: bytes | str) -> Any:
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
    except UnicodeDecodeError as exc:
        raise JSONSyntaxError(f"invalid UTF-8 at byte {exc.start}") from None
    if text.startswith("\ufeff"):
        raise JSONSyntaxError("unexpected byte order mark")
    try:
        value, end = _decoder.raw_decode(text, _skip_ws(text, 0))
    except RecursionError:
        raise JSONSyntaxError("nesting too deep") from None
    except ValueError as exc:
        raise JSONSyntaxError(str(exc) or "invalid JSON") from None
    end = _skip_ws(text, end)
    if end != len(text):
        raise JSONSyntaxError(f"trailing characters at position {end}")
    return value


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\n\r":
        i += 1
    return i


# One C-level pass keeps only the bytes that matter for the two pre-checks below.
_STRUCTURE: Final = b'[{"\\tf'
_DROP: Final = bytes(b for b in range(256) if b not in _STRUCTURE)


def structure_hints(raw: bytes) -> tuple[bool, bool]:
    """(may be deeper than 64 levels, may hold a `true`/`false` literal) from one pass over `raw`.

    Brackets bound the depth. A literal bool is a `t` or `f` outside strings; quote parity finds
    "outside" unless a backslash could escape a quote, in which case bools are assumed."""
    kept = raw.translate(None, _DROP)
    deep = kept.count(b"[") + kept.count(b"{") > MAX_DEPTH
    if b"\\" in kept:
        return deep, True
    outside = kept.split(b'"')[0::2]
    return deep, any(b"t" in seg or b"f" in seg for seg in outside)


def loads(data: bytes | str) -> Any:
    """Parse one JSON document; raises JSONSyntaxError with a detail text."""
    return loads_with_hints(data)[0]


def loads_with_hints(data: bytes | str) -> tuple[Any, bool]:
    """The value and whether it may contain a bool (see `structure_hints`)."""
    if isinstance(data, memoryview):
        data = bytes(data)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    deep, bools = structure_hints(raw)
    value = _parse(data)
    if deep and _too_deep(value):
        raise JSONSyntaxError("nesting too deep")
    return value, bools


def loads_exact(data: bytes | str) -> Any:
    """Parse with the stdlib only: integers of any size stay integers (orjson turns those beyond
    64 bits into floats). Used to re-read a body whose shape check met a float for an integer."""
    value = _stdlib_loads(bytes(data) if isinstance(data, memoryview) else data)
    if _too_deep(value):
        raise JSONSyntaxError("nesting too deep")
    return value


def _parse(data: bytes | str) -> Any:
    if _orjson is not None:
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError as exc:
            if "recursion" in str(exc).lower():
                raise JSONSyntaxError("nesting too deep") from None
    return _stdlib_loads(data)


if _orjson is not None:
    _dumps = _orjson.dumps

    def dumps(value: Any) -> bytes:
        """Compact UTF-8 JSON."""
        data: bytes = _dumps(value)
        return data

else:  # pragma: no cover
    _encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    def dumps(value: Any) -> bytes:
        """Compact UTF-8 JSON."""
        return _encoder.encode(value).encode("utf-8")
