"""Errors of the core, each carrying the HTTP status that `handle` answers with (core.md §4.3)."""

from __future__ import annotations

import math
from typing import Final

__all__ = [
    "BadRequest",
    "Conflict",
    "Internal",
    "MethodNotAllowed",
    "NotFound",
    "NotReady",
    "PayloadTooLarge",
    "SelectionError",
    "StreamError",
    "TooManyRequests",
    "Unprocessable",
    "UnsupportedMediaType",
]


class SelectionError(Exception):
    """Base of every error the service answers; rendered as `{"error": message}` with `status`."""

    status: int = 500

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class BadRequest(SelectionError):
    status = 400


class NotFound(SelectionError):
    status = 404


class MethodNotAllowed(SelectionError):
    status = 405

    def __init__(self, allow: tuple[str, ...]) -> None:
        super().__init__("method not allowed")
        self.allow = allow


class Conflict(SelectionError):
    status = 409


class PayloadTooLarge(SelectionError):
    status = 413


class UnsupportedMediaType(SelectionError):
    status = 415


class Unprocessable(SelectionError):
    status = 422


SHAPE_PREFIX: Final = "Failed to deserialize the JSON body into the target type: "


class InvalidJson(BadRequest):
    """The body is not JSON (api.md §2.2); `detail` says why, without the prefix."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"Failed to parse the request body as JSON: {detail}")
        self.detail = detail


class InvalidMsgpack(BadRequest):
    """A `Content-Type: application/msgpack` body that is not one msgpack value of JSON's kinds
    (docs/DECISIONS.md, "msgpack bodies"); `detail` says why."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"Failed to parse the request body as msgpack: {detail}")
        self.detail = detail


class ShapeError(Unprocessable):
    """JSON of the wrong shape for its type (api.md §2.3); `detail` is `<path>: <reason>`, or the
    reason alone at the root."""

    def __init__(self, detail: str) -> None:
        super().__init__(SHAPE_PREFIX + detail)
        self.detail = detail


class TooManyRequests(SelectionError):
    """Not now: `retry_after` (seconds) is when trying again may succeed, when it is known; the
    status may be 529 (`overload_status_code`)."""

    status = 429

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after

    def headers(self) -> tuple[tuple[str, str], ...]:
        """`Retry-After` in whole seconds (at least 1), when known."""
        if self.retry_after is None:
            return ()
        return (("retry-after", str(max(1, math.ceil(min(self.retry_after, 86400.0))))),)


class Internal(SelectionError):
    status = 500


class NotReady(SelectionError):
    status = 503


class StreamError(Exception):
    """An event stream must be closed with this WebSocket close code and reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code} {reason}")
        self.code = code
        self.reason = reason
