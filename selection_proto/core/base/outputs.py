"""Output events the core appends for its caller to drain with `next_output()` (core.md §4.4)."""

from __future__ import annotations

import attrs

from .errors import SelectionError
from .responses import ApplyReport, SelectResponse
from .wire import Response

__all__ = ["CloseEventStream", "InternalError", "Notice", "OutputEvent", "SelectionReady", "SubscribeKvEvents",
           "UnsubscribeKvEvents"]


@attrs.frozen
class SelectionReady:
    """A pending request has its final answer: a queued selection, or a `POST /kv_events`
    applied in steps."""

    ticket: int
    result: SelectResponse | ApplyReport | SelectionError | None  # None: an answer held for the ledger
    response: Response


@attrs.frozen
class SubscribeKvEvents:
    """Connect to a rank's event endpoint and feed it to `stream_message(stream, ...)`."""

    stream: int
    worker_id: int
    dp_rank: int
    endpoint: str
    model_name: str
    tenant_id: str
    replay_endpoint: str | None = None  # the engine's replay socket, when it has one (docs/DECISIONS.md)


@attrs.frozen
class UnsubscribeKvEvents:
    stream: int


@attrs.frozen
class CloseEventStream:
    """Close an inbound push stream with this WebSocket code and reason."""

    stream: int
    code: int
    reason: str


@attrs.frozen
class InternalError:
    """An unexpected exception was confined to one call (answered 500): log `detail`, its traceback.
    The core cannot log; the transport that drains this does."""

    where: str
    detail: str


@attrs.frozen
class Notice:
    """Something an operator wants in the log (a worker registered or removed, a lifecycle change,
    a KV-event stream opened or closed, a gap in a stream): the transport logs it at info level."""

    event: str
    fields: tuple[tuple[str, object], ...]
    level: str = "info"  # "debug" for the per-request decisions (`log_decisions`)


OutputEvent = SelectionReady | SubscribeKvEvents | UnsubscribeKvEvents | CloseEventStream | InternalError | Notice
