"""JSON in and out: orjson when importable, the stdlib otherwise, with identical results.

Parsing rules (api.md §2.2): strict UTF-8, no NaN/Infinity, at most 64 levels of nesting, the
last of a repeated member wins, and no lone surrogate (`"\ud800"`) in any string: orjson refuses
those and the stdlib would accept them, and a stored one would make every later answer that
echoes it fail to encode. orjson refuses integers beyond 64 bits, which the spec wants reported as
range errors (422), so a body orjson refuses is re-parsed by the stdlib before it is called
invalid; both readers therefore refuse exactly the same texts.
"""

from __future__ import annotations

import gc
import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

_orjson: Any
try:  # pragma: no cover - exercised by whichever is installed
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

__all__ = ["gc_paused", "wide_encoding", "loads_array_stepwise", "parse_large", "LONE_SURROGATE", "MAX_DEPTH", "MAX_INT_DIGITS", "JSONSyntaxError", "dumps", "fragment", "loads", "loads_exact", "loads_own", "loads_with_hints", "FAST_PARSER"]

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


# The interpreter refuses to convert integer texts longer than this (sys.int_info); the message
# names the limit instead of leaking the interpreter's advice.
MAX_INT_DIGITS: Final = 4300


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise ValueError(f"integer with {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


_decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float,
                            parse_int=_bounded_int)
LONE_SURROGATE: Final = "lone surrogate in string"
# A `\uD800`-`\uDFFF` escape: the only way a parsed string can hold a surrogate (strict UTF-8
# decoding refuses encoded ones), so strings are walked only when the text has one.
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")


_LONG_DIGITS: Final = re.compile(r"[0-9]{20}")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


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
    if isinstance(data, (bytes, bytearray)) and (wide := wide_encoding(bytes(data[:4]))) is not None:
        raise JSONSyntaxError(f"the body is {wide}; JSON must be UTF-8")
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
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise JSONSyntaxError(LONE_SURROGATE)
    return value


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\n\r":
        i += 1
    return i


# One C-level pass keeps only the bytes that matter for the two pre-checks below.
_STRUCTURE: Final = b'[]{}"\\tf'
_DROP: Final = bytes(b for b in range(256) if b not in _STRUCTURE)
_BRACKETS_ONLY: Final = bytes(b for b in range(256) if b not in b"[]{}")


# The quick look reads at most this many strings; a body with more gets the full passes.
_QUICK_MAX_QUOTES: Final = 64
# Below this size the full passes' few C calls cost less than the quick look's many searches
# (a 120-byte stored event: 5 against 17 us; even at 6 KB of token ids), as for every event
# of a WebSocket flood.
_QUICK_FROM_BYTES: Final = 8192


def structure_hints(raw: bytes) -> tuple[bool, bool]:
    """(may be deeper than 64 levels, may hold a `true`/`false` literal) for a text that parses."""
    return _structure_hints_full(raw) if len(raw) < _QUICK_FROM_BYTES else _structure_hints_quick(raw)


def _structure_hints_quick(raw: bytes) -> tuple[bool, bool]:
    """`structure_hints` of a large body. A request body has few strings and brackets and a long
    run of numbers: finding each quote, bracket and `t`/`f` with single-byte searches (memchr)
    reads it four times faster than the filtering passes of `_structure_hints_full`, whose
    answer this is whenever the quick look cannot be sure (a backslash, many strings, many
    brackets)."""
    if b"\\" in raw:
        return _structure_hints_full(raw)
    find = raw.find
    bounds = [-1]
    at = find(b'"')
    while at != -1:
        if len(bounds) > _QUICK_MAX_QUOTES:
            return _structure_hints_full(raw)
        bounds.append(at)
        at = find(b'"', at + 1)
    if len(bounds) % 2 == 0:  # an odd number of quotes: not JSON
        return _structure_hints_full(raw)
    bounds.append(len(raw))
    bools = False
    openers = 0
    for k in range(0, len(bounds), 2):  # the stretches outside strings
        start, end = bounds[k] + 1, bounds[k + 1]
        bools = bools or find(b"t", start, end) != -1 or find(b"f", start, end) != -1
        for opener in (b"[", b"{"):
            at = find(opener, start, end)
            while at != -1:
                openers += 1
                if openers > MAX_DEPTH:  # deep nesting is possible: the full passes measure it
                    return _structure_hints_full(raw)
                at = find(opener, at + 1, end)
    return False, bools


def _structure_hints_full(raw: bytes) -> tuple[bool, bool]:
    """`structure_hints` from C-level passes over all of `raw`.

    Outside strings, a literal bool is a `t` or `f`, and the brackets nest as the values do.
    Quote parity finds "outside" unless a backslash could escape a quote; then both answers are
    "maybe" and the caller walks the parsed value. Otherwise the depth is exact: each round of
    deleting adjacent `[]` and `{}` pairs peels one level off every branch."""
    kept = raw.translate(None, _DROP)
    if b"\\" in kept:
        return kept.count(b"[") + kept.count(b"{") > MAX_DEPTH, True
    outside = b"".join(kept.split(b'"')[0::2])
    bools = b"t" in outside or b"f" in outside
    nesting = outside.translate(None, _BRACKETS_ONLY)
    for _ in range(MAX_DEPTH):
        if not nesting:
            return False, bools
        nesting = nesting.replace(b"[]", b"").replace(b"{}", b"")
    return bool(nesting), bools


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


def loads_array_stepwise(text: str) -> tuple[Any, bool]:
    """`loads_with_hints` of a text whose top level is an array, read one element at a time.

    For a worker thread: orjson holds the GIL for a whole document (~55 ms for 8 MB), the
    stdlib's scanner for one element, so the event loop's thread gets its turns in between. A
    text this reader does not take whole (not an array, not JSON, too deep) is read again by
    `loads_with_hints`, so that every answer, error texts included, is that reader's."""
    try:
        deep, bools = structure_hints(text.encode("utf-8"))
        scan = _decoder.raw_decode
        i = _skip_ws(text, 0)
        if text[i:i + 1] != "[":
            raise ValueError
        items: list[Any] = []
        i = _skip_ws(text, i + 1)
        if text[i:i + 1] == "]":
            i += 1
        else:
            while True:
                item, i = scan(text, i)
                items.append(item)
                i = _skip_ws(text, i)
                sep = text[i:i + 1]
                i = _skip_ws(text, i + 1)
                if sep == "]":
                    break
                if sep != ",":
                    raise ValueError
        if _skip_ws(text, i) != len(text):
            raise ValueError
        if _LONG_DIGITS.search(text):
            raise ValueError  # orjson reads integers beyond 64 bits as floats: let it, to agree
        if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(items):
            raise ValueError
        if deep and _too_deep(items):
            raise ValueError
        return items, bools
    except (ValueError, StopIteration, RecursionError, UnicodeError):
        return loads_with_hints(text)


def parse_large(data: bytes) -> tuple[Any, bool]:
    """`loads_with_hints` for a large body, with the cyclic GC paused; raises JSONSyntaxError as
    it does. Pure: any thread."""
    with gc_paused():
        return loads_with_hints(data)


def loads_exact(data: bytes | str) -> Any:
    """Parse with the stdlib only: integers of any size stay integers (orjson turns those beyond
    64 bits into floats). Used to re-read a body whose shape check met a float for an integer."""
    value = _stdlib_loads(bytes(data) if isinstance(data, memoryview) else data)
    if _too_deep(value):
        raise JSONSyntaxError("nesting too deep")
    return value


def loads_own(data: bytes) -> Any:
    """Parse JSON this process wrote (`dumps`, the core's answers read back in process): none of
    the checks a peer's text needs, which cost more than the parse on an answer's many strings."""
    return _orjson.loads(data) if _orjson is not None else json.loads(data)


_NO_GC_ABOVE: Final = 65536


@contextmanager
def gc_paused() -> Iterator[None]:
    """Building a large value allocates enough containers to start the cyclic collector over and
    over (2/3 of the time of an 8 MB body of events), each time walking the whole heap, index
    included; none of the new objects can be garbage yet. Another thread may pause it too: only
    the one that paused it resumes it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:  # (a deployer's own `gc.freeze()` is left alone)
            # What was built goes to the oldest generation, where only full passes look at it:
            # the first young pass after the pause walked all of it, 85 ms for 8 MB of events.
            gc.freeze()
            gc.unfreeze()
        gc.enable()


def _parse(data: bytes | str) -> Any:
    if _orjson is not None:
        try:
            if len(data) > _NO_GC_ABOVE:
                with gc_paused():
                    return _orjson.loads(data)
            return _orjson.loads(data)
        except _orjson.JSONDecodeError as exc:
            text = str(exc).lower()
            if "recursion" in text:
                raise JSONSyntaxError("nesting too deep") from None
            if "surrogate" in text and "utf-8" not in text:  # (orjson says "surrogates" of bad UTF-8 too)
                raise JSONSyntaxError(LONE_SURROGATE) from None
    return _stdlib_loads(data)


def wide_encoding(data: bytes) -> str | None:
    """The name of a UTF-16 or UTF-32 encoding `data` looks written in (a byte order mark, or the
    NULs of RFC 4627 §3 in its first four bytes), else None: the standard library would read it,
    and JSON between systems is UTF-8 (RFC 8259 §8.1)."""
    head = data[:4]
    if head in (b"\x00\x00\xfe\xff", b"\xff\xfe\x00\x00") or (len(head) == 4 and head[:3] == b"\x00\x00\x00") \
            or (len(head) == 4 and head[1:] == b"\x00\x00\x00"):
        return "UTF-32"
    if head[:2] in (b"\xfe\xff", b"\xff\xfe") or (len(head) >= 2 and b"\x00" in head[:2]):
        return "UTF-16"
    return None


if _orjson is not None:
    _dumps = _orjson.dumps

    def dumps(value: Any) -> bytes:
        """Compact UTF-8 JSON."""
        data: bytes = _dumps(value)
        return data

    def fragment(encoded: bytes) -> Any:
        """JSON encoded already, for `dumps` to copy as it is (a value written ahead elsewhere)."""
        return _orjson.Fragment(encoded)

else:  # pragma: no cover
    _encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)

    def dumps(value: Any) -> bytes:
        """Compact UTF-8 JSON."""
        return _encoder.encode(value).encode("utf-8")

    def fragment(encoded: bytes) -> Any:
        """The value of JSON encoded already (the standard library copies no raw text)."""
        return json.loads(encoded)
