"""The two halves of every transport loop around a Sans-IO object: one receive from a byte stream
(what arrived, `b""` when the peer closed its side, None when nothing came within the timeout),
and one flush of what the object has queued to send."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
import anyio.abc

__all__ = ["CHUNK", "Outgoing", "flush", "receive"]

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
