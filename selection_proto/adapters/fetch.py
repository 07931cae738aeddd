"""A one-shot HTTP/1.1 `GET` as a Sans-IO client (h11), for reading a peer's `/dump`: feed it the
bytes that arrive, send what `data_to_send` returns, read `body` once `done`. The body is bounded;
anything but a complete 200 is a `FetchError`."""

from __future__ import annotations

import h11

__all__ = ["Fetch", "FetchError"]


class FetchError(Exception):
    pass


class Fetch:
    """`GET target` from `host`, keeping at most `limit` bytes of the answer's body."""

    def __init__(self, host: str, target: str, limit: int) -> None:
        self._conn = h11.Connection(h11.CLIENT)
        self._limit = limit
        self._out = self._conn.send(h11.Request(method="GET", target=target, headers=[
            ("host", host), ("accept", "application/json"), ("connection", "close")])) or b""
        self._out += self._conn.send(h11.EndOfMessage()) or b""
        self._body: list[bytes] = []
        self._size = 0
        self.status: int | None = None
        self.done = False

    def data_to_send(self) -> bytes:
        out, self._out = self._out, b""
        return out

    @property
    def body(self) -> bytes:
        return b"".join(self._body)

    def receive_data(self, data: bytes) -> None:
        """Bytes from the peer (`b""` when it closed); raises FetchError."""
        self._conn.receive_data(data)
        while not self.done:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise FetchError(f"invalid HTTP answer: {exc}") from None
            if event is h11.NEED_DATA:
                if not data:
                    raise FetchError("the peer closed before its answer was complete")
                return
            if isinstance(event, h11.Response):
                self.status = event.status_code
                if event.status_code != 200:
                    raise FetchError(f"HTTP {event.status_code}")
            elif isinstance(event, h11.Data):
                self._size += len(event.data)
                if self._size > self._limit:
                    raise FetchError(f"the answer is larger than {self._limit} bytes")
                self._body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.done = True
            elif isinstance(event, h11.ConnectionClosed):
                raise FetchError("the peer closed before its answer was complete")
