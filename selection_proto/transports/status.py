"""The live page's feed (docs/STATUS.md): a `GET /status/events` held open as server-sent events, one
status snapshot (`core.status`) a second until the viewer leaves or the server drains.

Bounded: at most `MAX_VIEWERS` feeds at once (the next is answered 503); what the snapshots are cut
from is built once per interval whatever the number of viewers (less often when building it would
take over `BUSY_SHARE` of the loop), and viewers with the same filter share the event; nothing is queued for a viewer, so one that stops reading costs its socket's buffer
until a send does not complete within the server's request timeout, and then it is cut. A viewer
that closes its side gives its place back at once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import anyio.abc

from ..adapters.http import HttpConnection
from ..core.service import SelectionService
from ..core.status import Fleet, View
from ..core.status_answers import status_event, status_fleet
from .pump import flush, receive

__all__ = ["BUSY_SHARE", "INTERVAL", "MAX_VIEWERS", "StatusFeeds"]

MAX_VIEWERS: Final = 16
INTERVAL: Final = 1.0
# At most this share of the event loop goes to building what the snapshots are cut from: a fleet
# whose build takes longer than a tenth of the interval is rebuilt less often (docs/STATUS.md).
BUSY_SHARE: Final = 0.1


class StatusFeeds:
    """Every open feed of one server, and what their snapshots are cut from."""

    def __init__(self, service: SelectionService, clock: Callable[[], float]) -> None:
        self._service = service
        self._clock = clock
        self.viewers = 0
        self._built_at = float("-inf")
        self._every = INTERVAL / 2  # viewers that joined at other instants share a build
        self._fleet: Fleet | None = None
        self._events: dict[View, bytes] = {}  # cut from the current fleet, per filter

    def _current(self, view: View) -> bytes:
        now = self._clock()
        if self._fleet is None or now - self._built_at >= self._every:
            self._fleet, self._built_at = status_fleet(self._service, now), now
            self._every = max(INTERVAL / 2, (self._clock() - now) / BUSY_SHARE)
            self._events.clear()
        event = self._events.get(view)
        if event is None:
            if len(self._events) >= MAX_VIEWERS:  # no more than one per viewer: a gone viewer's goes
                self._events.clear()
            event = self._events[view] = status_event(self._service, self._fleet, view, now)
        return event

    async def serve(self, conn: HttpConnection, stream: anyio.abc.ByteStream,
                    send: Callable[[bytes], Awaitable[None]], draining: Callable[[], bool]) -> None:
        """Answer the feed `conn` asked for, until the viewer goes (it closes its side, or a send
        fails) or `draining()`."""
        if self.viewers >= MAX_VIEWERS:
            conn.start_feed(False)
            await flush(send, conn)
            return
        self.viewers += 1
        try:
            conn.start_feed(True)
            while not draining():
                conn.feed(self._current(conn.feed_view))
                await flush(send, conn)
                # The interval is spent reading: what a viewer sends is dropped, its close ends the feed.
                until = self._clock() + INTERVAL
                while (left := until - self._clock()) > 0:
                    if await receive(stream, left) == b"":
                        return
        finally:
            self.viewers -= 1
