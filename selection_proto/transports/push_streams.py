"""The server's inbound KV-event push streams (transports.md §3): the rest of an upgraded
connection, one `adapters.ws.PushSession` fed as the socket is read, a slice at a time and its
messages for a bounded time per turn of the event loop, its large messages decoded in a worker
thread and applied in slices, so that a flood or an 8 MB message leaves the server's other
clients their turn."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Final

import anyio
import anyio.abc

from ..adapters.http import HttpConnection
from ..adapters.inflight import InFlight
from ..adapters.ws import PushSession
from ..core.base.metrics import CONNECTIONS
from ..core.service import SelectionService
from .config import ServerConfig
from .pump import TURN_BYTES, TURN_SECS, apply_large, flush, receive

__all__ = ["GONE", "PushStreams"]

GONE: Final = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class PushStreams:
    """The part of the server (`server._Server`, a mixin) that runs push streams; each counts
    against `max_connections` like the HTTP connection it was."""

    if TYPE_CHECKING:
        service: SelectionService
        clock: Callable[[], float]
        config: ServerConfig
        in_flight: InFlight
        connections: set[HttpConnection]
        ws_sessions: dict[int, tuple[PushSession, anyio.abc.ByteStream, anyio.Lock]]
        ws_count: int

        def _report_connections(self) -> None: ...
        async def send(self, stream: anyio.abc.ByteStream, data: bytes) -> None: ...
        async def pump(self, wake_timer: bool = True) -> None: ...

    async def push_stream(self, stream: anyio.abc.ByteStream, conn: HttpConnection,
                         lock: anyio.Lock) -> None:
        """The rest of an upgraded connection: one inbound KV-event push stream. It counts
        against `max_connections` like the HTTP connection it was."""
        assert conn.upgrade is not None
        ws, target, trailing = conn.upgrade
        self.ws_count += 1
        self.connections.discard(conn)
        self._report_connections()
        self.service.observe(CONNECTIONS, ("websocket_in",), float(self.ws_count))
        session: PushSession | None = None
        try:
            session = PushSession(self.service, self.clock, ws, target, trailing, self.in_flight)
            if session.stream is not None:
                self.ws_sessions[session.stream] = (session, stream, lock)
            between_slices = partial(self._between_slices, session, stream, lock)
            await flush(partial(self.send, stream), session, lock)
            interval = self.config.ws_ping_interval_secs
            while not session.closed:
                if session.backlog:  # the last turn ran out: others first, then the rest
                    await anyio.sleep(0)
                    session.resume(self.clock() + TURN_SECS)
                    await apply_large(session, between_slices)
                elif (data := await receive(stream, interval, TURN_BYTES)) is None:
                    if session.ping_outstanding:
                        session.close(1011, "keepalive ping timeout")
                    else:
                        session.ping()
                else:
                    session.receive_data(data, self.clock() + TURN_SECS)
                    await apply_large(session, between_slices)
                await flush(partial(self.send, stream), session, lock)
                await self.pump()
        except GONE:
            pass
        except Exception:  # noqa: BLE001 - one stream's failure is confined to it
            self.service.internal_error("websocket")
            if session is not None:
                try:
                    session.close(1011, "internal error")
                    with anyio.move_on_after(1.0):
                        await flush(partial(self.send, stream), session, lock)
                except Exception:  # noqa: BLE001, S110 - nothing more can be said on it
                    pass
        finally:
            if session is not None:
                try:
                    session.connection_lost()
                except Exception:  # noqa: BLE001
                    self.service.internal_error("websocket")
                if session.stream is not None:
                    self.ws_sessions.pop(session.stream, None)
                for sid, (other, _, _) in list(self.ws_sessions.items()):
                    if other is session:
                        del self.ws_sessions[sid]
            self.ws_count -= 1
            self.service.observe(CONNECTIONS, ("websocket_in",), float(self.ws_count))

    async def _between_slices(self, session: PushSession, stream: anyio.abc.ByteStream,
                              lock: anyio.Lock) -> None:
        """What a stream's turn ends with, also after each slice of a large message."""
        await flush(partial(self.send, stream), session, lock)
        await self.pump()
