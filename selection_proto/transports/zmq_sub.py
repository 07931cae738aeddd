"""A pyzmq SUB socket read from a worker thread, so that both anyio backends work (transports.md §4)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

__all__ = ["zmq_batches"]


async def zmq_batches(endpoint: str, topic: bytes = b"") -> AsyncIterator[list[list[bytes]]]:
    """Lists of multipart messages as they arrive (each thread hop waits at most 100 ms).
    Raises ImportError when pyzmq is not installed."""
    import zmq

    socket: Any = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, topic)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)

    def receive_some() -> list[list[bytes]]:
        messages: list[list[bytes]] = []
        if poller.poll(100):
            while len(messages) < 256:
                try:
                    messages.append(socket.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return messages

    try:
        while True:
            yield await anyio.to_thread.run_sync(receive_some, abandon_on_cancel=True)
    finally:
        socket.close(linger=0)
