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

from .index import Rank
from .pool import Key

__all__ = ["EventSource"]


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
