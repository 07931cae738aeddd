"""Mooncake traces (FAST'25 release format): one JSON object a line with `timestamp` (ms from the
start), `input_length` and `output_length` (tokens) and `hash_ids` (one id per trace block of
`--trace-block-size` tokens; requests sharing a leading run of ids share that prefix). Our
extension (docs/FLOW_CONTROL.md): a line may say who sent it (`tenant`, a string of at most 256
characters), how important it is (`priority`, an integer; negative is sheddable), its class
(`policy_class`, a string of at most 256 characters) and until when its first token is useful
(`deadline_ms`, a number > 0)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import IO, NamedTuple

from ..core.base import jsonio

__all__ = ["MAX_LINE_BYTES", "MAX_TOKENS", "TraceError", "TraceRequest", "parse_trace", "read_lines"]

_MAX = (1 << 63) - 1
MAX_TOKENS = 1 << 20  # a request's input or output tokens at most (the service's max_prompt_tokens)
MAX_LINE_BYTES = 16 << 20  # a line at most (a million hash ids take ~8 MB)


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
    tenant: str | None = None
    priority: int | None = None
    deadline_ms: float | None = None
    policy_class: str | None = None


def _flow(record: dict[str, object]) -> tuple[str | None, int | None, float | None, str | None]:
    tenant, priority, deadline = record.get("tenant"), record.get("priority"), record.get("deadline_ms")
    policy_class = record.get("policy_class")
    for name, value in (("tenant", tenant), ("policy_class", policy_class)):
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= 256):
            raise ValueError(f"`{name}` must be a string of 1 to 256 characters")
    if priority is not None and not (type(priority) is int and -_MAX - 1 <= priority <= _MAX):
        raise ValueError("`priority` must be a 64-bit integer")
    if deadline is not None and not (type(deadline) in (int, float) and 0 < deadline < 1e15):  # type: ignore[operator]
        raise ValueError("`deadline_ms` must be a number of milliseconds greater than 0")
    return (tenant, priority, None if deadline is None else float(deadline),  # type: ignore[arg-type,return-value]
            policy_class)


def _count(record: dict[str, object], name: str, low: int) -> int:
    value = record.get(name)
    if type(value) is not int or not low <= value <= MAX_TOKENS:
        raise ValueError(f"`{name}` must be an integer from {low} to {MAX_TOKENS}")
    return value


def read_lines(stream: IO[bytes]) -> Iterator[bytes]:
    """A file's lines, each read at most `MAX_LINE_BYTES` at a time: a longer one is yielded cut,
    and fails to parse, instead of filling memory."""
    while line := stream.readline(MAX_LINE_BYTES + 1):
        yield line


def parse_trace(lines: Iterable[bytes], name: str, trace_block_size: int, *, skip: int = 0,
                limit: int | None = None, kv_blocks: int | None = None) -> Iterator[TraceRequest]:
    """The requests of a trace's lines, streamed: `skip` requests first, then at most `limit`.
    Blank lines are passed over; any other line that does not read raises `TraceError`, and so
    does a request with more blocks than `kv_blocks` (no engine could ever hold it) or one that
    arrives before the one above it."""
    taken = seen = 0
    previous = 0.0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"the line is longer than {MAX_LINE_BYTES} bytes")
            record = jsonio.loads(line)
            if not isinstance(record, dict):
                raise ValueError("expected a JSON object")
            stamp = record.get("timestamp")
            if type(stamp) not in (int, float) or not 0 <= stamp < 1e15:  # type: ignore[operator]
                raise ValueError("`timestamp` must be a number of milliseconds, at least 0")
            if stamp < previous:  # type: ignore[operator]
                raise ValueError(f"`timestamp` {stamp} is before the line above's ({previous:g}): "
                                 "a trace's requests come in order")
            input_length = _count(record, "input_length", 1)
            output_length = _count(record, "output_length", 0)
            ids = record.get("hash_ids")
            if not isinstance(ids, list) or not all(type(i) is int and 0 <= i <= _MAX for i in ids):
                raise ValueError("`hash_ids` must be an array of non-negative integers")
            if input_length > len(ids) * trace_block_size:
                raise ValueError(f"`input_length` {input_length} exceeds its {len(ids)} blocks of "
                                 f"{trace_block_size} tokens")
            flow = _flow(record)
            if kv_blocks is not None and len(ids) > kv_blocks:
                raise ValueError(f"the request needs {len(ids)} KV blocks and an engine has {kv_blocks} "
                                 "(--kv-blocks): no engine could ever hold it")
        except (jsonio.JSONSyntaxError, ValueError, RecursionError) as exc:
            reason = "not JSON" if isinstance(exc, jsonio.JSONSyntaxError) else str(exc)
            raise TraceError(where, reason) from None
        previous = float(stamp)  # type: ignore[arg-type]
        seen += 1
        if seen <= skip:
            continue
        if limit is not None and taken >= limit:
            return
        taken += 1
        yield TraceRequest(float(stamp) / 1000.0, input_length, output_length, tuple(ids), *flow)  # type: ignore[arg-type]
