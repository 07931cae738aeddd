"""One receive on a byte stream, the way every transport loop reads: what arrived, `b""` when the
peer closed its side, None when nothing came within the timeout."""

from __future__ import annotations

import math

import anyio
import anyio.abc

__all__ = ["CHUNK", "receive"]

CHUNK = 65536


async def receive(stream: anyio.abc.ByteReceiveStream, timeout: float = math.inf) -> bytes | None:
    with anyio.move_on_after(timeout):
        try:
            return await stream.receive(CHUNK)
        except anyio.EndOfStream:
            return b""
    return None
