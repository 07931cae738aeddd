"""The two halves of every transport loop around a Sans-IO object: one receive from a byte stream
(what arrived, `b""` when the peer closed its side, None when nothing came within the timeout),
and one flush of what the object has queued to send; with them a whole `GET` (`http_get`), and
the large messages of a WebSocket KV-event stream, pushed or subscribed to (`apply_large`)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Protocol
from urllib.parse import urlsplit

import anyio
import anyio.abc

from ..adapters.fetch import Fetch, FetchError
from ..adapters.ws import StreamSession
from ..core.intake.streams import decode_or_error

__all__ = ["CHUNK", "TURN_BYTES", "TURN_SECS", "Outgoing", "apply_large", "flush", "http_get", "receive"]

CHUNK = 65536
# A KV-event stream's turn of the event loop (pushed in, or subscribed to over ws:// or ZMQ): one
# read of at most TURN_BYTES, its messages handled for at most TURN_SECS (then one more: a turn
# ends between messages) before the loop's other tasks run. Bytes alone do not bound a turn:
# 8 KiB is 180 `cleared` events, ~7 ms of work (docs/INVARIANTS.md).
TURN_BYTES = 8192
TURN_SECS = 0.002


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


async def apply_large(session: StreamSession, between: Callable[[], Awaitable[None]]) -> None:
    """The large message `session` holds, if any, decoded in a worker thread (a pure function of
    its bytes) and applied a slice at a time, `between` (send what the session queued, route the
    core's outputs) and the loop's other tasks run after each: an 8 MB message of 60,000 events
    held `/health` 1.3-1.5 s applied whole (docs/INVARIANTS.md). The stream is not read meanwhile;
    the frames after the message wait in the session's backlog."""
    while (message := session.next_large()) is not None:
        decoded = await anyio.to_thread.run_sync(decode_or_error, message.data)
        start: int | None = 0
        while start is not None:
            start = session.apply_slice(message, decoded, start)
            await between()
            await anyio.sleep(0)


GATHER_SECS = 0.01  # after a short read, let the next bytes gather this long before reading again
SHORT_READ = 16384


async def http_get(url: str, limit: int) -> bytes:
    """The body of a `GET url` answered 200, at most `limit` bytes; raises FetchError or OSError
    (the caller bounds the time: a deadline for the whole answer). A peer killed mid-answer is a
    FetchError, not a crash. On the loop the answer's bytes are only gathered, each short read
    followed by a pause of `GATHER_SECS` (a peer sending a byte at a time costs a read per pause,
    not one per byte), up to what a body of `limit` bytes could take on the wire; the HTTP is read
    in a worker thread once the peer has closed (we ask it to: `connection: close`). Read on the
    loop, an answer in 1-byte chunks from 16 engines held `/health` 1.6-5.3 s."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise FetchError("expected an http://host:port URL")
    fetch = Fetch(parts.netloc, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), limit)
    wire_limit = 2 * limit + CHUNK  # the body, its chunks' framing (a 1-byte chunk is 6 bytes) or its head
    gathered = bytearray()
    try:
        async with await anyio.connect_tcp(parts.hostname, parts.port or 80) as stream:
            await flush(stream.send, fetch)
            while True:
                try:
                    data = await stream.receive(CHUNK)
                except anyio.EndOfStream:
                    break
                gathered += data
                if len(gathered) > wire_limit:
                    raise FetchError(f"the answer is larger than {limit} bytes")
                if len(data) < SHORT_READ:
                    await anyio.sleep(GATHER_SECS)
    except anyio.BrokenResourceError:  # anyio's word for a reset; it is no OSError
        raise FetchError("the connection was reset") from None
    return await anyio.to_thread.run_sync(_answer_body, fetch, gathered)


def _answer_body(fetch: Fetch, answer: bytearray) -> bytes:
    """The body of a whole answer (the peer has closed), read in a worker thread, 1 MiB at a
    time: a peer's large `/dump` is not copied whole once more."""
    with memoryview(answer) as view:
        for start in range(0, len(view), 1 << 20):
            fetch.receive_data(bytes(view[start:start + (1 << 20)]))
            if fetch.done:
                break
    if not fetch.done:
        fetch.receive_data(b"")  # raises: the answer was cut short
    return fetch.body
