"""Mooncake traces (FAST'25 release format): one JSON object a line with `timestamp` (ms from the
start), `input_length` and `output_length` (tokens) and `hash_ids` (one id per trace block of
`--trace-block-size` tokens; requests sharing a leading run of ids share that prefix)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from ..core import jsonio

__all__ = ["TraceError", "TraceRequest", "parse_trace"]

_MAX = (1 << 63) - 1


class TraceError(ValueError):
    """A line that is not a trace request: `where` is `file:line`."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


class TraceRequest(NamedTuple):
    arrival: float  # seconds from the trace's start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _count(record: dict[str, object], name: str, low: int) -> int:
    value = record.get(name)
    if type(value) is not int or not low <= value <= _MAX:
        raise ValueError(f"`{name}` must be an integer of at least {low}")
    return value


def parse_trace(lines: Iterable[bytes], name: str, trace_block_size: int, *, skip: int = 0,
                limit: int | None = None) -> Iterator[TraceRequest]:
    """The requests of a trace's lines, streamed: `skip` requests first, then at most `limit`.
    Blank lines are passed over; any other line that does not read raises `TraceError`."""
    taken = seen = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            record = jsonio.loads(line)
            if not isinstance(record, dict):
                raise ValueError("expected a JSON object")
            stamp = record.get("timestamp")
            if type(stamp) not in (int, float) or not 0 <= stamp < 1e15:  # type: ignore[operator]
                raise ValueError("`timestamp` must be a number of milliseconds, at least 0")
            input_length = _count(record, "input_length", 1)
            output_length = _count(record, "output_length", 0)
            ids = record.get("hash_ids")
            if not isinstance(ids, list) or not all(type(i) is int and 0 <= i <= _MAX for i in ids):
                raise ValueError("`hash_ids` must be an array of non-negative integers")
            if input_length > len(ids) * trace_block_size:
                raise ValueError(f"`input_length` {input_length} exceeds its {len(ids)} blocks of "
                                 f"{trace_block_size} tokens")
        except (jsonio.JSONSyntaxError, ValueError, RecursionError) as exc:
            reason = "not JSON" if isinstance(exc, jsonio.JSONSyntaxError) else str(exc)
            raise TraceError(where, reason) from None
        seen += 1
        if seen <= skip:
            continue
        if limit is not None and taken >= limit:
            return
        taken += 1
        yield TraceRequest(float(stamp) / 1000.0, input_length, output_length, tuple(ids))  # type: ignore[arg-type]
