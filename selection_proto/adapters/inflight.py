"""The bytes-in-flight budget: request bodies and WebSocket messages still being received, summed
over every connection of a server (`--max-buffer-bytes`). Connections take bytes as they buffer
them and give them back once the request or message is complete or the connection is gone; what
does not fit is refused (503, or WebSocket close 1013), so stalled senders cannot grow memory."""

from __future__ import annotations

__all__ = ["InFlight"]


class InFlight:
    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def fits(self, n: int) -> bool:
        return self.used + n <= self.limit

    def take(self, n: int) -> bool:
        """Hold `n` more bytes; False (nothing held) when they do not fit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
