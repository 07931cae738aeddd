"""The live page's feed (issue 33): a `GET /status/events` held open as server-sent events, one status
snapshot (`core.status`) a second until the viewer leaves or the server drains.

Bounded: at most `MAX_VIEWERS` feeds at once (the next is answered 503); one snapshot is built per
interval whatever the number of viewers; nothing is queued for a viewer, so one that stops reading
costs its socket's buffer until a send does not complete within the server's request timeout, and
then it is cut."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import anyio

from ..adapters.http import HttpConnection
from ..core.handler import status_event
from ..core.service import SelectionService
from .pump import flush

__all__ = ["INTERVAL", "MAX_VIEWERS", "StatusFeeds"]

MAX_VIEWERS: Final = 16
INTERVAL: Final = 1.0


class StatusFeeds:
    """Every open feed of one server, and the snapshot they share."""

    def __init__(self, service: SelectionService, clock: Callable[[], float]) -> None:
        self._service = service
        self._clock = clock
        self.viewers = 0
        self._built_at = float("-inf")
        self._event = b""

    def _current(self) -> bytes:
        now = self._clock()
        if now - self._built_at >= INTERVAL / 2:  # viewers that joined at other instants share it
            self._event, self._built_at = status_event(self._service, now), now
        return self._event

    async def serve(self, conn: HttpConnection, send: Callable[[bytes], Awaitable[None]],
                    draining: Callable[[], bool]) -> None:
        """Answer the feed `conn` asked for, until the viewer goes (a send fails) or `draining()`."""
        if self.viewers >= MAX_VIEWERS:
            conn.start_feed(False)
            await flush(send, conn)
            return
        self.viewers += 1
        try:
            conn.start_feed(True)
            while not draining():
                conn.feed(self._current())
                await flush(send, conn)
                await anyio.sleep(INTERVAL)
        finally:
            self.viewers -= 1
