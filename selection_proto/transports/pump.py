"""The two halves of every transport loop around a Sans-IO object: one receive from a byte stream
(what arrived, `b""` when the peer closed its side, None when nothing came within the timeout),
and one flush of what the object has queued to send; and with them a whole `GET` (`http_get`)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Protocol
from urllib.parse import urlsplit

import anyio
import anyio.abc

from ..adapters.fetch import Fetch, FetchError

__all__ = ["CHUNK", "Outgoing", "flush", "http_get", "receive"]

CHUNK = 65536


class Outgoing(Protocol):
    def data_to_send(self) -> bytes: ...


async def receive(stream: anyio.abc.ByteReceiveStream, timeout: float = math.inf,
                  size: int = CHUNK) -> bytes | None:
    with anyio.move_on_after(timeout):
        try:
            return await stream.receive(size)
        except anyio.EndOfStream:
            return b""
    return None


async def flush(send: Callable[[bytes], Awaitable[None]], conn: Outgoing,
                lock: anyio.Lock | None = None) -> None:
    """Send everything `conn` has queued, under `lock` when other tasks write to the same stream.
    An h11 connection hands out one answer per call, so this loops until it has none."""
    if lock is None:
        while out := conn.data_to_send():
            await send(out)
        return
    async with lock:
        while out := conn.data_to_send():
            await send(out)


async def http_get(url: str, limit: int) -> bytes:
    """The body of a `GET url` answered 200, at most `limit` bytes; raises FetchError or OSError
    (the caller bounds the time). A peer killed mid-answer is a FetchError, not a crash."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise FetchError("expected an http://host:port URL")
    fetch = Fetch(parts.netloc, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), limit)
    try:
        async with await anyio.connect_tcp(parts.hostname, parts.port or 80) as stream:
            await flush(stream.send, fetch)
            while not fetch.done:
                data = await receive(stream)
                fetch.receive_data(data or b"")
    except anyio.BrokenResourceError:  # anyio's word for a reset; it is no OSError
        raise FetchError("the connection was reset") from None
    return fetch.body
