"""`handle`: one HTTP-shaped request in, one `Response` out, for every route of api.md §1.

Order of checks: route (404/405), body size (413), query (400), content type (415), JSON syntax
(400), shape (422), then the typed method. Unexpected exceptions become 500 `internal error`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, Final, TypeVar

import msgpack

from .base import jsonio
from .base.codec import FloatForInteger, ShapeContext, from_json
from .base.errors import (
    BadRequest,
    Internal,
    InvalidJson,
    InvalidMsgpack,
    MethodNotAllowed,
    NotFound,
    SelectionError,
    ShapeError,
    TooManyRequests,
    UnsupportedMediaType,
)
from .base.metrics import IGNORED_VALUES
from .base.responses import Pending, SelectResponse
from .base.routes import (
    EVENT_QUERY,
    KEY_QUERY,
    MAX_BODY,
    MSGPACK_TYPES,
    ParsedBody,
    allowed_methods,
    is_json,
    match,
    media_type,
    route_of,
)
from .base.types import (
    ObservedCache,
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
from .base.wire import (
    Response,
    error_response,
    json_response,
    parse_query,
    parse_uint,
    percent_decode,
    query_int,
    raw_json_response,
)
from .bookings.prompt import prehash
from .cache.events import decode_json_events
from .fleet.catalog import frame
from .readouts import with_verdict
from .routing.selection import SHUTTING_DOWN
from .status_answers import status_answer, status_events_answer, status_page_answer

if TYPE_CHECKING:
    from .routing.pd import PlanResponse
    from .service_api import Service

__all__ = ["DECISION_HEADER", "handle", "prepare_large_body", "select_and_reserve_parsed", "select_pd_and_reserve_parsed"]

DECISION_HEADER: Final = "x-selection-decision"  # `explain_header`: why a selection chose its worker


T = TypeVar("T")

def _allow(methods: tuple[str, ...]) -> str:
    return ", ".join((*methods, "HEAD") if "GET" in methods else methods)


def _parse_json(body: bytes) -> tuple[Any, bool]:
    try:
        return jsonio.loads_with_hints(body)
    except jsonio.JSONSyntaxError as exc:
        raise InvalidJson(exc.detail) from None


def _string_keys(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    if not all(type(k) is str for k, _ in pairs):
        raise ValueError("map keys must be strings")
    return dict(pairs)


def _no_extensions(code: int, data: bytes) -> Any:
    raise ValueError(f"extension type {code} is not accepted")


def parse_msgpack(raw: bytes) -> ParsedBody:
    """A msgpack request body, read as its JSON twin would be: maps with string keys, arrays,
    strings, numbers, booleans, nil; and `bin` where a u32 array is expected (`token_ids` as
    little-endian u32: no per-token objects). Its integers are exact, so `exact` is the value."""
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True, object_pairs_hook=_string_keys,
                                ext_hook=_no_extensions, timestamp=0)
    except msgpack.StackError:
        raise InvalidMsgpack("nested too deeply") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise InvalidMsgpack(str(exc) or type(exc).__name__) from None
    return ParsedBody(value, True, len(raw), lambda: value)


Body = bytes | ParsedBody


def _decode(body: Body, build: Callable[[Any, ShapeContext], T]) -> T:
    if isinstance(body, ParsedBody):
        if body.error is not None:
            raise body.error
        value, bools = body.value, body.may_contain_bools
    else:
        value, bools = _parse_json(body)
    ctx = ShapeContext(may_contain_bools=bools)
    try:
        return build(value, ctx)
    except FloatForInteger:
        if not jsonio.FAST_PARSER:
            raise
        # orjson reads integers beyond 64 bits as floats; the exact parse names them correctly.
        return build(body.exact() if isinstance(body, ParsedBody) else jsonio.loads_exact(body), ctx)


def _worker_id(raw: str) -> int:
    try:
        segment = percent_decode(raw)
    except (ValueError, UnicodeDecodeError):
        segment = raw
    value = parse_uint(segment, 64)
    if isinstance(value, str) or segment.startswith("+"):
        raise BadRequest(f"Invalid URL: Cannot parse `{segment}` to a `u64`")
    return value


def _reservation_id(raw: str) -> str:
    try:
        return percent_decode(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("Invalid URL: invalid percent-encoding") from None


def handle(service: Service, method: str, path: str, query: str,
           headers: Iterable[tuple[str, str]], body: Body, now: float) -> Response | Pending:
    matched = match(path)
    route = matched[0] if matched else "unmatched"
    if isinstance(body, ParsedBody):
        service.limits.prehashed = body.prehashed
    try:
        result = _dispatch(service, method, matched, query, headers, body, now)
    except SelectionError as exc:
        extra: tuple[tuple[str, str], ...] = ()
        if isinstance(exc, MethodNotAllowed):
            extra = (("allow", _allow(exc.allow)),)
        elif isinstance(exc, TooManyRequests):
            extra = exc.headers()
        result = error_response(exc.status, exc.message, extra)
    except Exception:  # noqa: BLE001 - the bytes API never raises (core.md §4.2)
        service.internal_error("handle")
        result = error_response(500, "internal error")
    finally:
        service.limits.prehashed = None
    status = "pending" if isinstance(result, Pending) else str(result.status)
    service.metrics.request(method, route, status)
    return result


def _dispatch(service: Service, method: str, matched: tuple[str, str | None] | None,
              query: str, headers: Iterable[tuple[str, str]], body: Body,
              now: float) -> Response | Pending:
    if matched is None:
        raise NotFound("route not found")
    template, param = matched
    methods = allowed_methods(template)
    head = method == "HEAD" and "GET" in methods
    verb = "GET" if head else method
    if verb not in methods:
        raise MethodNotAllowed(methods)
    route = route_of(verb, template)
    assert route is not None
    service.limits.body_size(body.size if isinstance(body, ParsedBody) else len(body), route.max_body)
    if route.body:
        media = media_type(headers)
        if media in MSGPACK_TYPES and isinstance(body, bytes):
            if route.operation == "kv_events":
                return _h_engine_batch(service, query, body, now)
            body = parse_msgpack(body)
        elif not is_json(media) and not isinstance(body, ParsedBody):
            raise UnsupportedMediaType("Expected request with `Content-Type: application/json`")
    response = _HANDLERS[route.operation](service, param, query, body, now)
    if head and isinstance(response, Response):
        return Response(response.status, response.headers, b"")
    return response


def _ok(value: Any, status: int = 200) -> Response:
    return json_response(status, value.to_json())


def _h_health(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    return _ok(service.health())


def _h_readyz(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    if not service.serving():
        return error_response(503, SHUTTING_DOWN)
    return _ok(service.health())


def _h_ready(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    ready, count = service.readiness(now=now)
    # The bytes of `ReadyResponse.to_json()`, spliced from each record's cached JSON in one copy.
    head = b'{"ready":%s,"schedulable_workers":%d,' % (b"true" if ready else b"false", count)
    if service.recovered_from is not None:
        head += b'"recovered_from":' + jsonio.dumps(service.recovered_from) + b","
    details = service.ready_details()
    if details:
        head += b'"details":' + jsonio.dumps(details) + b","
    head += b'"workers":['
    return raw_json_response(200 if ready else 503, service.catalog.spliced(head, b"]}"))


def _h_workers_get(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    params = parse_query(query, KEY_QUERY)
    records = [with_verdict(service.catalog.records_json_of(r.worker_id), service.kv_routing(r.worker_id, now=now))
               for r in service.list_workers(params.get("model_name"), params.get("tenant_id"))]
    return raw_json_response(200, b",".join(frame(b"[", records, b"]")))


def _h_worker_get(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    worker_id = _worker_id(param or "")
    verdict = service.kv_routing(worker_id, now=now)
    return raw_json_response(200, with_verdict(service.catalog.records_json_of(worker_id), verdict))


def _h_workers_post(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    req = _decode(body, lambda v, ctx: from_json(WorkerRequest, v, "", ctx))
    return _ok(service.upsert_worker(req, now=now), 201)


def _h_worker_patch(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    worker_id = _worker_id(param or "")
    patch = _decode(body, lambda v, ctx: from_json(WorkerPatchRequest, v, "", ctx))
    return _ok(service.patch_worker(worker_id, patch, now=now))


def _h_worker_delete(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    return _ok(service.delete_worker(_worker_id(param or ""), now=now))


def _select_answer(result: Any) -> Response | Pending:
    if isinstance(result, Pending):
        return result
    extra = () if result.decision is None else ((DECISION_HEADER, result.decision),)
    return json_response(200, result.to_json(), extra)


def _h_select(service: Service, param: str | None, query: str, body: Body, now: float) -> Response | Pending:
    req = _decode(body, lambda v, ctx: from_json(SelectRequest, v, "", ctx))
    return _select_answer(service.select(req, now=now))


def _h_select_and_reserve(service: Service, param: str | None, query: str, body: Body,
                          now: float) -> Response | Pending:
    return _select_answer(service.select_and_reserve(_select_and_reserve_request(body), now=now))


def _select_and_reserve_request(body: Body) -> SelectAndReserveRequest:
    return _decode(body, lambda v, ctx: from_json(SelectAndReserveRequest, v, "", ctx))


def select_and_reserve_parsed(service: Service, body: ParsedBody, now: float) -> SelectResponse | Pending:
    """`POST /select_and_reserve` of a body parsed elsewhere, answered typed: the endpoint picker's
    call when no ledger holds answers (an answer not encoded to JSON to be read back is a tenth of
    its CPU). Raises SelectionError: a fault of ours as `handle` answers it, 500."""
    return _parsed(service, body, lambda: service.select_and_reserve(_select_and_reserve_request(body), now=now))


def select_pd_and_reserve_parsed(service: Service, body: ParsedBody, now: float) -> PlanResponse:
    """`POST /select_pd_and_reserve` of a body parsed elsewhere, answered typed: the endpoint
    picker's plan for a key with prefill workers (docs/PD.md), as `select_and_reserve_parsed`."""
    return _parsed(service, body, lambda: service.plan(
        _decode(body, lambda v, ctx: from_json(SelectPdAndReserveRequest, v, "", ctx)), now=now))


def _parsed(service: Service, body: ParsedBody, call: Callable[[], T]) -> T:
    """`call` on a body parsed (and perhaps hashed ahead) elsewhere, its size checked first."""
    service.limits.prehashed = body.prehashed
    try:
        service.limits.body_size(body.size, MAX_BODY)
        return call()
    except SelectionError:
        raise
    except Exception:  # noqa: BLE001 - as `handle`: counted and logged, the caller answers 500
        service.internal_error("handle")
        raise Internal("internal error") from None
    finally:
        service.limits.prehashed = None


def _plan_answer(plan: Any) -> Response:
    extra = () if plan.decision_header is None else ((DECISION_HEADER, plan.decision_header),)
    return json_response(200, plan.to_json(), extra)


def _h_select_pd(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    req = _decode(body, lambda v, ctx: from_json(SelectPdRequest, v, "", ctx))
    return _plan_answer(service.plan(req, now=now))


def _h_select_pd_and_reserve(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    req = _decode(body, lambda v, ctx: from_json(SelectPdAndReserveRequest, v, "", ctx))
    return _plan_answer(service.plan(req, now=now))


def _plan_released(plan_id: str, released: list[str]) -> Response:
    return json_response(200, {"status": "ok", "plan_id": plan_id, "released": released})


def _h_plan_handoff(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    plan_id = _reservation_id(param or "")
    params = parse_query(query, KEY_QUERY)
    return _plan_released(plan_id, service.release_plan(plan_id, end=False, model_name=params.get("model_name"),
                                                        tenant_id=params.get("tenant_id"), now=now))


def _h_end_plan(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    plan_id = _reservation_id(param or "")
    params = parse_query(query, KEY_QUERY)
    return _plan_released(plan_id, service.release_plan(plan_id, end=True, model_name=params.get("model_name"),
                                                        tenant_id=params.get("tenant_id"), now=now))


def _h_reserve(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    req = _decode(body, lambda v, ctx: from_json(ReservationRequest, v, "", ctx))
    return _ok(service.reserve(req, now=now), 201)


def _observed_cached_tokens(body: Body, warnings: list[str]) -> int | None:
    """`cached_tokens` an engine reported, carried by a prefill_complete or a free. These routes
    ignore their body as 1.6.1 does, unless it is a JSON object with that member. A member that is
    not a u64 (-1, 5.0, true, "5") is ignored too, with a line in `warnings`: a free must free, and
    a prefill mark must land, whatever a client adds (docs/DECISIONS.md, "Bounds")."""
    if isinstance(body, ParsedBody):
        value = body.value
    elif not body.strip():
        return None
    else:
        try:
            value, _ = _parse_json(body)
        except InvalidJson:
            return None
    if not isinstance(value, dict) or "cached_tokens" not in value:
        return None
    try:
        return _decode(body, lambda v, ctx: from_json(ObservedCache, v, "", ctx)).cached_tokens
    except ShapeError as exc:
        warnings.append(f"cached_tokens ignored: {exc.detail}")
        return None


def _booking_done(service: Service, warnings: list[str]) -> Response:
    """`{"status": "ok"}`, with `warnings` when part of the body was ignored (counted)."""
    if not warnings:
        return _ok(service.health())
    service.metrics.inc(IGNORED_VALUES, ("cached_tokens",))
    return json_response(200, {**service.health().to_json(), "warnings": warnings})


def _h_prefill(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    rid = _reservation_id(param or "")
    params = parse_query(query, KEY_QUERY)
    warnings: list[str] = []
    service.prefill_complete(rid, model_name=params.get("model_name"), tenant_id=params.get("tenant_id"),
                             cached_tokens=_observed_cached_tokens(body, warnings), now=now)
    return _booking_done(service, warnings)


def _h_free(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    rid = _reservation_id(param or "")
    params = parse_query(query, KEY_QUERY)
    warnings: list[str] = []
    service.free(rid, model_name=params.get("model_name"), tenant_id=params.get("tenant_id"),
                 cached_tokens=_observed_cached_tokens(body, warnings), now=now)
    return _booking_done(service, warnings)


def _h_output_block(service: Service, param: str | None, query: str, body: Body,
                    now: float) -> Response:
    rid = _reservation_id(param or "")
    req = _decode(body, lambda v, ctx: from_json(OutputBlockRequest, v, "", ctx))
    service.output_block(rid, req.decay_fraction, now=now)
    return _ok(service.health())


def _h_loads(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    params = parse_query(query, KEY_QUERY)
    return json_response(200, [m.to_json() for m in service.loads(params.get("model_name"),
                                                             params.get("tenant_id"))])


def _h_potential(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    req = _decode(body, lambda v, ctx: from_json(PotentialLoadsRequest, v, "", ctx))
    return json_response(200, [x.to_json() for x in service.potential_loads(req, now=now)])


def _h_overlap(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    req = _decode(body, lambda v, ctx: from_json(OverlapScoresRequest, v, "", ctx))
    return _ok(service.overlap_scores(req, now=now))


def _h_events_post(service: Service, param: str | None, query: str, body: Body, now: float) -> Response | Pending:
    params = parse_query(query, EVENT_QUERY)
    worker_id = query_int(params, "worker_id", 64)
    dp_rank = query_int(params, "dp_rank", 32)
    decoded = body.events if isinstance(body, ParsedBody) else None
    if isinstance(decoded, SelectionError):
        raise decoded
    events = decoded if decoded is not None else _decode(body, decode_json_events)
    report = service.begin_kv_events(events, now=now, worker_id=worker_id, dp_rank=dp_rank,
                               model_name=params.get("model_name"), tenant_id=params.get("tenant_id"))
    return report if isinstance(report, Pending) else _ok(report)


def _parse_events_large(raw: bytes) -> tuple[Any, bool]:
    # An array of events, read one at a time so that the event loop's thread gets the GIL.
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return jsonio.parse_large(raw)  # refused at once, with the byte's position
    with jsonio.gc_paused():
        return jsonio.loads_array_stepwise(text)


def prepare_large_body(path: str, raw: bytes, media: str | None = None,
                       block_sizes: Collection[int] = ()) -> ParsedBody | None:
    """A large JSON (or, `media` says, msgpack) body parsed, and for `POST /kv_events` its events
    decoded, as `handle` would; None when msgpack does not parse (then `handle` reports it). A
    JSON text that does not parse carries its error, which `handle` answers without reading the
    text again. A prompt is hashed ahead in `block_sizes` (`ahead.prepare_ahead`). Pure: for a
    worker thread."""
    if media in MSGPACK_TYPES:
        try:
            with jsonio.gc_paused():
                return parse_msgpack(raw)
        except InvalidMsgpack:
            return None
    try:
        parsed = _parse_events_large(raw) if path == "/kv_events" else jsonio.parse_large(raw)
    except jsonio.JSONSyntaxError as exc:
        refused = ParsedBody(None, False, len(raw), lambda: jsonio.loads_exact(raw))
        refused.error = InvalidJson(exc.detail)
        return refused
    body = ParsedBody(parsed[0], parsed[1], len(raw), lambda: jsonio.loads_exact(raw))
    route = route_of("POST", path)
    if route is not None and route.prompt and block_sizes:
        with jsonio.gc_paused():
            body.prehashed = prehash(body.value, block_sizes)
    if path == "/kv_events":
        try:
            with jsonio.gc_paused():
                body.events = _decode(body, decode_json_events)
                # The JSON tree is freed here, in the worker thread: on the event loop's thread,
                # freeing 8 MB of it took tens of milliseconds.
                body.value = None
        except SelectionError as exc:
            body.events = exc
    return body


def _h_engine_batch(service: Service, query: str, body: bytes, now: float) -> Response:
    params = parse_query(query, EVENT_QUERY)
    worker_id = query_int(params, "worker_id", 64)
    dp_rank = query_int(params, "dp_rank", 32)
    report = service.apply_engine_batch(body, worker_id=worker_id, dp_rank=dp_rank, now=now,
                                  model_name=params.get("model_name"), tenant_id=params.get("tenant_id"))
    return _ok(report)


def _h_events_get(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    return error_response(426, "this endpoint requires a WebSocket upgrade", (("upgrade", "websocket"),))


def _h_metrics(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    text = service.metrics_text(now=now).encode("utf-8")
    return Response(200, (("content-type", "text/plain; version=0.0.4; charset=utf-8"),
                          ("content-length", str(len(text)))), text)


def _h_openapi(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    from .openapi import document

    return json_response(200, document())


def _h_dump(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    params = parse_query(query, KEY_QUERY)
    # Hundreds of thousands of small containers, none of them garbage: the cyclic collector's
    # passes over the index while they are built took 3/4 of the time (1.5 s -> 0.4 s at 200k blocks).
    with jsonio.gc_paused():
        return json_response(200, service.dump(params.get("model_name"), params.get("tenant_id")))


# route operation (routes.ROUTES) -> its handler
_HANDLERS: Final[dict[str, Callable[..., Response | Pending]]] = {
    "health": _h_health,
    "ready": _h_ready,
    "readyz": _h_readyz,
    "list_workers": _h_workers_get,
    "get_worker": _h_worker_get,
    "upsert_worker": _h_workers_post,
    "patch_worker": _h_worker_patch,
    "delete_worker": _h_worker_delete,
    "select": _h_select,
    "select_and_reserve": _h_select_and_reserve,
    "reserve": _h_reserve,
    "select_pd": _h_select_pd,
    "select_pd_and_reserve": _h_select_pd_and_reserve,
    "plan_handoff": _h_plan_handoff,
    "end_plan": _h_end_plan,
    "prefill_complete": _h_prefill,
    "free": _h_free,
    "output_block": _h_output_block,
    "loads": _h_loads,
    "potential_loads": _h_potential,
    "overlap_scores": _h_overlap,
    "kv_events": _h_events_post,
    "kv_events_stream": _h_events_get,
    "metrics": _h_metrics,
    "openapi": _h_openapi,
    "dump": _h_dump,
    "status_page": status_page_answer,
    "status": status_answer,
    "status_events": status_events_answer,
}
