"""Sources of KV events (events.md §7): an inbound push stream (a WebSocket on `/kv_events`) or
an outbound subscription to an engine's endpoint, and what each has delivered.

A source's life:

| kind | starts | connected | lost | ends |
|---|---|---|---|---|
| push | the WebSocket is bound (`open_event_stream`) | from the start | — | the socket closes, or its worker leaves |
| subscription | its rank joins with an endpoint | the transport reports it | the transport reports it; retried | its rank leaves or its endpoint changes |

A loss marks every rank the source fed as `loss_pending`: the first batch after a reconnect must
prove continuity (a seq) or the rank is stale."""

from __future__ import annotations

from . import jsonio
from .codec import ShapeContext
from .engine import EngineBatch, InvalidBatch, decode_batch
from .errors import InvalidJson, SelectionError, Unprocessable
from .events import Event, decode_json_events
from .index import Rank
from .pool import Key

__all__ = ["DecodedMessage", "EventSource", "decode_engine_batch", "decode_or_error", "decode_stream_message"]


class EventSource:
    """One source of KV events: an inbound push stream or an outbound subscription."""

    __slots__ = ("sid", "kind", "worker_id", "dp_rank", "key", "delivered", "connected", "first")

    def __init__(self, sid: int, kind: str, worker_id: int, dp_rank: int, key: Key) -> None:
        self.sid = sid
        self.kind = kind  # "push" or "subscription"
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.key = key
        self.delivered: set[Rank] = set()  # ranks this stream fed since it (re)connected
        self.connected = kind == "push"
        self.first = True  # no message seen since it (re)connected


DecodedMessage = tuple[Event, ...] | EngineBatch


def decode_engine_batch(payload: bytes) -> EngineBatch:
    try:
        return decode_batch(payload)
    except InvalidBatch as exc:
        raise Unprocessable(f"invalid engine batch: {exc.detail}") from None


def decode_stream_message(data: bytes | str, stepwise: bool = False) -> DecodedMessage:
    """The events of one stream message, checked whole; raises SelectionError. Pure (no service
    state), so a large message may be decoded in a worker thread while the loop serves others;
    `stepwise` reads its JSON one event at a time there (`jsonio.loads_array_stepwise`)."""
    if isinstance(data, bytes):
        return decode_engine_batch(data)
    try:
        value, bools = jsonio.loads_array_stepwise(data) if stepwise else jsonio.loads_with_hints(data)
    except jsonio.JSONSyntaxError as exc:
        raise InvalidJson(exc.detail) from None
    return tuple(decode_json_events(value, ShapeContext(may_contain_bools=bools)))


def decode_or_error(data: bytes | str) -> DecodedMessage | SelectionError:
    """`decode_stream_message` with its refusal returned, for a caller in another thread."""
    try:
        with jsonio.gc_paused():
            return decode_stream_message(data, stepwise=True)
    except SelectionError as exc:
        return exc
