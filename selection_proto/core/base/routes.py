"""Every route of api.md §1 in one table, read by `handle` (matching, 405s, which routes take a
body, which handler), by `openapi.document` (operations, parameters, statuses) and by the JSON-RPC
adapter (method names). A route's facts are written here and nowhere else."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final, NamedTuple

from .types import (
    OutputBlockRequest,
    OverlapScoresRequest,
    PotentialLoadsRequest,
    ReservationRequest,
    SelectAndReserveRequest,
    SelectPdAndReserveRequest,
    SelectPdRequest,
    SelectRequest,
    WorkerPatchRequest,
    WorkerRequest,
)

__all__ = ["EVENT_QUERY", "KEY_QUERY", "MAX_BODY", "PUSH_QUERY", "ROUTES", "STATUS_QUERY", "Route", "ParsedBody",
           "MSGPACK_TYPES", "SMALL_BODY", "allowed_methods", "body_limit", "is_json", "match", "media_type",
           "path_parameter", "route_of"]

MAX_BODY: Final = 8 * 1024 * 1024
# What a free or a prefill_complete carries is `cached_tokens` at most: a body past this is refused
# 413 before it is read or parsed (docs/DECISIONS.md, "Bounds").
SMALL_BODY: Final = 16 * 1024
KEY_QUERY: Final = ("model_name", "tenant_id", "routing_group")
EVENT_QUERY: Final = ("worker_id", "dp_rank", *KEY_QUERY)
PUSH_QUERY: Final = (*EVENT_QUERY, "framing", "ack", "resume")
STATUS_QUERY: Final = ("q", "detail")  # the status page's filter and the worker shown in detail


class Route(NamedTuple):
    method: str
    template: str
    operation: str  # the OpenAPI operationId, and the name of the service operation behind it
    body: bool  # takes a JSON body (`POST /kv_events` also takes msgpack)
    body_type: type | None  # the request type of that body, when it has one
    query: tuple[str, ...]  # the query names it reads
    statuses: tuple[int, ...]  # what it may answer
    rpc: str | None  # the JSON-RPC method name (transports.md §6.3)
    summary: str = ""  # one line for the OpenAPI document
    prompt: bool = False  # its body carries a prompt to hash (`prepare_large_body` hashes it ahead)
    max_body: int = MAX_BODY  # the largest body it takes (413 past it)


_WRITE: Final = (400, 413, 415, 422)
ROUTES: Final[tuple[Route, ...]] = (
    Route("GET", "/health", "health", False, None, (), (200,), "health", "Liveness: always ok."),
    Route("GET", "/ready", "ready", False, None, (), (200, 503), "ready", "Readiness, with every worker record."),
    Route("GET", "/readyz", "readyz", False, None, (), (200, 503), "readyz",
          "Process readiness: ok unless draining or shutting down, with or without workers."),
    Route("GET", "/workers", "list_workers", False, None, KEY_QUERY, (200, 400), "workers.list",
          "The worker catalog, filtered by key, each record with its KV routing verdict."),
    Route("POST", "/workers", "upsert_worker", True, WorkerRequest, (), (201, 400, 409, 413, 415, 422, 503),
          "workers.create", "Register or replace a worker."),
    Route("GET", "/workers/{worker_id}", "get_worker", False, None, (), (200, 400, 404), "workers.get",
          "One worker's record, with its KV routing verdict."),
    Route("PATCH", "/workers/{worker_id}", "patch_worker", True, WorkerPatchRequest, (),
          (200, 400, 404, 409, 413, 415, 422, 503), "workers.update", "Change members of a worker's record."),
    Route("DELETE", "/workers/{worker_id}", "delete_worker", False, None, (), (200, 400, 404, 503), "workers.delete",
          "Make a worker unschedulable (a tombstone); 503 while a shared ledger is unreachable."),
    Route("POST", "/select", "select", True, SelectRequest, (), (200, 400, 413, 415, 422, 429, 503), "select",
          "Choose a worker for a prompt (a pending selection with selection_id).", prompt=True),
    Route("POST", "/select_and_reserve", "select_and_reserve", True, SelectAndReserveRequest, (),
          (200, 400, 409, 413, 415, 422, 429, 500, 503), "select_and_reserve", "Choose a worker and book the prompt on it.", prompt=True),
    Route("POST", "/select_pd", "select_pd", True, SelectPdRequest, (), (200, 400, 413, 415, 422, 429, 503),
          "select_pd", "Plan a prefill/decode pair for a prompt: the decode worker, local or remote prefill, "
          "the prefill worker (docs/PD.md).", prompt=True),
    Route("POST", "/select_pd_and_reserve", "select_pd_and_reserve", True, SelectPdAndReserveRequest, (),
          (200, 400, 409, 413, 415, 422, 429, 500, 503), "select_pd_and_reserve",
          "Plan a prefill/decode pair and book both legs, or neither.", prompt=True),
    Route("POST", "/plans/{plan_id}/handoff", "plan_handoff", False, None, KEY_QUERY, (200, 400),
          "plans.handoff", "The decode worker answered: the plan's prefill booking ends (idempotent)."),
    Route("DELETE", "/plans/{plan_id}", "end_plan", False, None, KEY_QUERY, (200, 400),
          "plans.end", "The plan's request ended: both its bookings end (idempotent)."),
    Route("POST", "/reservations", "reserve", True, ReservationRequest, (),
          (201, 400, 404, 409, 413, 415, 422, 429, 503), "reservations.create", "Book on a given worker, or book a pending selection.", prompt=True),
    Route("POST", "/reservations/{reservation_id}/prefill_complete", "prefill_complete", False, None, KEY_QUERY,
          (200, 400, 404, 413), "reservations.prefill_complete", "A booking's prefill is done.", max_body=SMALL_BODY),
    Route("POST", "/reservations/{reservation_id}/output_block", "output_block", True, OutputBlockRequest, (),
          (200, 400, 404, 413, 415, 422), "reservations.output_block", "One more decode block for a booking."),
    Route("DELETE", "/reservations/{reservation_id}", "free", False, None, KEY_QUERY, (200, 400, 404, 413),
          "reservations.free", "End a booking.", max_body=SMALL_BODY),
    Route("GET", "/loads", "loads", False, None, KEY_QUERY, (200, 400), "loads", "Each key's per-rank load and queue."),
    Route("POST", "/potential_loads", "potential_loads", True, PotentialLoadsRequest, (),
          (200, 400, 413, 415, 422, 503), "potential_loads", "What each rank's load would be with a prompt.",
          prompt=True),
    Route("POST", "/overlap_scores", "overlap_scores", True, OverlapScoresRequest, (),
          (200, 400, 413, 415, 422, 503), "overlap_scores", "Cached blocks per rank and tier for a prompt.",
          prompt=True),
    Route("POST", "/kv_events", "kv_events", True, None, EVENT_QUERY, (200, 400, 404, 409, 413, 415, 422),
          "kv_events", "Apply KV events (Dynamo JSON, or an engine msgpack batch)."),
    Route("GET", "/kv_events", "kv_events_stream", False, None, PUSH_QUERY, (101, 400, 426), None, "Push KV events over a WebSocket."),
    Route("GET", "/metrics", "metrics", False, None, (), (200,), "metrics", "Prometheus metrics."),
    Route("GET", "/openapi.json", "openapi", False, None, (), (200,), "openapi", "This document."),
    Route("GET", "/dump", "dump", False, None, KEY_QUERY, (200, 400), "dump", "A replayable snapshot of catalog and index."),
    Route("GET", "/status", "status_page", False, None, (), (200,), None, "The live status page (HTML)."),
    Route("GET", "/status/snapshot", "status", False, None, STATUS_QUERY, (200, 400), "status",
          "The fleet at a glance: a summary, the workers worst first (filtered by q), one worker's ranks "
          "(detail), the latest decisions."),
    Route("GET", "/status/events", "status_events", False, None, STATUS_QUERY, (200, 400, 503), None,
          "The status snapshot as server-sent events, one a second while the client listens."),
)

_BOOKING_ACTIONS: Final = ("prefill_complete", "output_block")
_BY_KEY: Final = {(r.method, r.template): r for r in ROUTES}
_METHODS: Final[dict[str, tuple[str, ...]]] = {}
for _route in ROUTES:
    _METHODS[_route.template] = (*_METHODS.get(_route.template, ()), _route.method)


MSGPACK_TYPES: Final = ("application/msgpack", "application/x-msgpack")


def media_type(headers: Iterable[tuple[str, str]]) -> str | None:
    """The request's media type, lower case, without parameters."""
    for name, value in headers:
        if name.lower() == "content-type":
            return value.split(";", 1)[0].strip().lower()
    return None


def is_json(media: str | None) -> bool:
    return media is not None and (media == "application/json" or (media.startswith("application/")
                                                                   and media.endswith("+json")))


def route_of(method: str, template: str) -> Route | None:
    return _BY_KEY.get((method, template))


def body_limit(method: str, path: str) -> int:
    """The largest body the request's route takes, known from its head (MAX_BODY when the route
    is unknown: that answer comes later)."""
    matched = match(path)
    route = None if matched is None else route_of(method, matched[0])
    return MAX_BODY if route is None else route.max_body


def allowed_methods(template: str) -> tuple[str, ...]:
    """The methods of a template, in table order (HEAD is implied by GET)."""
    return _METHODS[template]


def path_parameter(template: str) -> str | None:
    """The name of the template's `{parameter}`, if it has one."""
    for part in template.split("/"):
        if part.startswith("{"):
            return part[1:-1]
    return None


def match(path: str) -> tuple[str, str | None] | None:
    """(route template, raw path parameter) or None."""
    if path in _METHODS and "{" not in path:
        return path, None
    parts = path.split("/")
    if len(parts) == 3 and parts[0] == "" and parts[2]:
        if parts[1] == "workers":
            return "/workers/{worker_id}", parts[2]
        if parts[1] == "reservations":
            return "/reservations/{reservation_id}", parts[2]
        if parts[1] == "plans":
            return "/plans/{plan_id}", parts[2]
    if len(parts) == 4 and parts[:2] == ["", "reservations"] and parts[2] and parts[3] in _BOOKING_ACTIONS:
        return f"/reservations/{{reservation_id}}/{parts[3]}", parts[2]
    if len(parts) == 4 and parts[:2] == ["", "plans"] and parts[2] and parts[3] == "handoff":
        return "/plans/{plan_id}/handoff", parts[2]
    return None


class ParsedBody:
    """A JSON body that its caller has already parsed, so that it is not encoded and parsed again
    (JSON lines parse each whole line once). `exact` re-reads the same value with exact integers
    (see `jsonio.loads_exact`); `size` is the length of the text it came from."""

    __slots__ = ("value", "may_contain_bools", "size", "exact", "events", "prehashed", "error")

    def __init__(self, value: Any, may_contain_bools: bool, size: int, exact: Callable[[], Any]) -> None:
        self.value = value
        self.may_contain_bools = may_contain_bools
        self.size = size
        self.exact = exact
        # For `POST /kv_events`: the events already decoded from `value` (or why they are not),
        # when the caller decoded them in another thread (`handler.prepare_large_body`).
        self.events: Any = None
        # For selections and bookings: the prompt's hashes computed ahead (`prompt.prehash`).
        self.prehashed: Any = None
        # Why the text is not JSON, found where it was parsed: `handle` answers it without
        # reading the text again on its own thread (`handler.prepare_large_body`).
        self.error: Exception | None = None

    def release(self) -> None:
        """Drop what was parsed: freeing millions of objects takes tens of milliseconds, so a
        server calls this in a worker thread once the request is answered. `exact` goes too: it
        may hold the value or the text (the picker's streams outlive their request by minutes)."""
        self.value = self.events = self.prehashed = None
        self.exact = _released


def _released() -> Any:
    raise RuntimeError("the parsed body was released")
