"""Sources of KV events (events.md §7) and their lifecycle: an inbound push stream (a WebSocket on
`/kv_events`) or an outbound subscription to an engine's endpoint, what each has delivered, and the
decoding of one stream message.

A source's life is the table `STREAM`, read by `Streams.move`:

| state | event | next | what happens |
|---|---|---|---|
| waiting | `connected` | connected | the rank counts one more open stream; the next message is a first |
| connected | `lost` | waiting | every rank it fed is `loss_pending`; one open stream less |
| waiting | `lost` | waiting | nothing (a subscription that failed before it connected) |
| connected, waiting | `closed` | gone | as `lost` (the WebSocket closed) |
| any | `ended` | gone | the service ended it: a push stream gets close 1001, a subscription an unsubscribe |

A push stream is created `waiting` and moves `connected` when it is bound; a subscription is
created `waiting` when its rank joins with an endpoint and moves as the transport reports. A
`loss_pending` rank must prove continuity (a seq) with its next batch, or it is stale. `ended`
forgets without a loss: the rank it fed is being dropped or reset, or the service is stopping."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Final

from ..base import jsonio
from ..base.codec import ShapeContext
from ..base.errors import InvalidJson, SelectionError, Unprocessable
from ..base.outputs import CloseEventStream, Notice, OutputEvent, SubscribeKvEvents, UnsubscribeKvEvents
from ..cache.engine import EngineBatch, InvalidBatch, decode_batch
from ..cache.events import KvEvent, decode_json_events
from ..cache.freshness import RankFreshness
from ..cache.index import Rank
from ..fleet.pool import Key, Pool

__all__ = ["STREAM", "DecodedMessage", "EventSource", "Streams", "decode_engine_batch", "decode_or_error", "decode_stream_message",
           "slice_end"]


class EventSource:
    """One source of KV events: an inbound push stream or an outbound subscription."""

    __slots__ = ("sid", "kind", "worker_id", "dp_rank", "key", "delivered", "state", "first", "endpoint",
                 "failing")

    def __init__(self, sid: int, kind: str, worker_id: int, dp_rank: int, key: Key) -> None:
        self.sid = sid
        self.kind = kind  # "push" or "subscription"
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.key = key
        self.delivered: set[Rank] = set()  # ranks this stream fed since it (re)connected
        self.state = "waiting"
        self.first = True  # no message seen since it (re)connected
        self.endpoint = ""  # a subscription's
        self.failing = False  # a subscription that could not connect, or lost its engine, since

    @property
    def rank(self) -> Rank:
        return (self.worker_id, self.dp_rank)


# (state, event) -> next state ("gone": forgotten); a pair not listed changes nothing.
STREAM: Final[Mapping[tuple[str, str], str]] = {
    ("waiting", "connected"): "connected",
    ("connected", "lost"): "waiting",
    ("waiting", "lost"): "waiting",
    ("connected", "closed"): "gone",
    ("waiting", "closed"): "gone",
    ("waiting", "ended"): "gone",
    ("connected", "ended"): "gone",
}


class Streams:
    """Every open source by id, and the subscription of each rank that has one."""

    __slots__ = ("_sources", "_subscriptions", "_next", "_pools", "_outbox")

    def __init__(self, pools: Mapping[Key, Pool], outbox: deque[OutputEvent]) -> None:
        self._sources: dict[int, EventSource] = {}
        self._subscriptions: dict[Rank, int] = {}  # rank -> its subscription's stream
        self._next = 1
        self._pools = pools
        self._outbox = outbox

    def get(self, sid: int) -> EventSource | None:
        return self._sources.get(sid)

    def freshness(self, sid: int) -> RankFreshness | None:
        """What the index knows of the stream's rank (None once the stream or its pool is gone)."""
        source = self._sources.get(sid)
        pool = self._pools.get(source.key) if source is not None else None
        return pool.fresh.get(source.rank) if source is not None and pool is not None else None

    def failing(self) -> list[str]:
        """What `/ready` says of the subscriptions that cannot reach their engine."""
        return [f"worker {s.worker_id} dp_rank {s.dp_rank}: no KV-event subscription to {s.endpoint}"
                for s in sorted(self._sources.values(), key=lambda s: s.rank) if s.failing]

    def subscriptions_except(self, worker_id: int) -> int:
        """How many subscriptions other workers hold."""
        return sum(1 for rank in self._subscriptions if rank[0] != worker_id)

    def _open(self, kind: str, rank: Rank, key: Key) -> EventSource:
        source = EventSource(self._next, kind, rank[0], rank[1], key)
        self._sources[source.sid] = source
        self._next += 1
        return source

    def open_push(self, rank: Rank, key: Key) -> int:
        """A WebSocket bound to `rank`: connected from the start."""
        source = self._open("push", rank, key)
        self.move(source, "connected")
        return source.sid

    def subscribe(self, rank: Rank, key: Key, endpoint: str, replay_endpoint: str | None = None) -> None:
        """The rank joined with an endpoint: the transport is asked to subscribe."""
        source = self._open("subscription", rank, key)
        source.endpoint = endpoint
        self._subscriptions[rank] = source.sid
        self._outbox.append(SubscribeKvEvents(source.sid, rank[0], rank[1], endpoint, *key, replay_endpoint))

    def unsubscribe(self, rank: Rank) -> None:
        sid = self._subscriptions.pop(rank, None)
        source = self._sources.get(sid) if sid is not None else None
        if source is not None:
            self.move(source, "ended")

    def end_pushes(self, worker_id: int | None, reason: str) -> None:
        """Close the push streams of `worker_id` (of everyone when None) with 1001."""
        for source in list(self._sources.values()):
            if source.kind == "push" and (worker_id is None or source.worker_id == worker_id):
                self.move(source, "ended", reason)

    def move(self, source: EventSource, event: str, reason: str = "") -> None:
        """One transition of `STREAM`, with what it causes."""
        after = STREAM.get((source.state, event), source.state)
        pool = self._pools.get(source.key)
        fresh = pool.fresh.get(source.rank) if pool is not None else None
        if source.state == "connected" and event != "ended" and after != "connected":
            if pool is not None:
                for rank in source.delivered:
                    fed = pool.fresh.get(rank)
                    if fed is not None:
                        fed.loss_pending = True
            if fresh is not None and fresh.open_streams > 0:
                fresh.open_streams -= 1
            source.delivered.clear()
        elif after == "connected" and source.state != "connected":
            if fresh is not None:
                fresh.open_streams += 1
            source.first = True
            source.failing = False
        if after != source.state:
            self._outbox.append(Notice(f"kv_stream_{after if after != 'gone' else 'closed'}", (
                ("stream", source.sid), ("kind", source.kind), ("worker_id", source.worker_id),
                ("dp_rank", source.dp_rank), ("cause", event))))
        if after == "gone":
            del self._sources[source.sid]
            if event == "ended":
                self._outbox.append(CloseEventStream(source.sid, 1001, reason) if source.kind == "push"
                                    else UnsubscribeKvEvents(source.sid))
        source.state = after


DecodedMessage = tuple[KvEvent, ...] | EngineBatch


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


def slice_end(message: Sequence[KvEvent] | EngineBatch, start: int, max_events: int, max_blocks: int
              ) -> int:
    """Where the slice of `message` that begins at `start` ends: at most `max_events` events and,
    past the first, at most `max_blocks` blocks, since a remove of a hundred hashes costs a
    hundred lookups (a slice is the work done between two turns of the event loop)."""
    events = message.events if isinstance(message, EngineBatch) else message
    stop = min(len(events), start + max_events)
    blocks = 0
    for i in range(start, stop):
        event = events[i]
        blocks += len(event.block_hashes) + len(getattr(event, "blocks", ()))
        if blocks > max_blocks and i > start:
            return i
    return stop
