"""A pyzmq SUB socket read from a worker thread, so that both anyio backends work (transports.md §4)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

__all__ = ["REPLAY_TIMEOUT", "fetch_replay", "zmq_batches"]

REPLAY_TIMEOUT = 1.0  # seconds the engine may take for each replayed batch
MAX_REPLAYED = 100_000


def fetch_replay(endpoint: str, start: int, timeout: float = REPLAY_TIMEOUT) -> tuple[list[list[bytes]], bool]:
    """Ask the engine's ROUTER at `endpoint` for every batch from `start` on (blocking: run it in a
    worker thread). The frames received, and whether the replay ended as it should."""
    import zmq

    from ..adapters.replay import END, parse_replay_frames, replay_request

    socket: Any = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    received: list[list[bytes]] = []
    try:
        socket.connect(endpoint)
        socket.send_multipart(replay_request(start))
        while len(received) < MAX_REPLAYED and socket.poll(int(timeout * 1000)):
            frames = socket.recv_multipart()
            parsed = parse_replay_frames(frames)
            if parsed is not None and parsed[0] == END:
                return received, True
            received.append(frames)
        return received, False
    finally:
        socket.close(linger=0)


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
