"""The status routes' answers over the bytes API (api.md, `/status*`): the page, one snapshot, one
server-sent event; `status.py` builds what they show, `transports/status.py` streams the events."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base.wire import Response, json_response
from .status import Fleet, View, event, fleet, snapshot, view_of

if TYPE_CHECKING:
    from .base.routes import ParsedBody
    from .service_api import Service

    Body = bytes | ParsedBody

__all__ = ["status_answer", "status_event", "status_events_answer", "status_fleet", "status_page_answer"]


def status_page_answer(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    from .status_page import PAGE, PAGE_HEADERS

    return Response(200, (("content-type", "text/html; charset=utf-8"), ("content-length", str(len(PAGE))),
                          ("cache-control", "no-store"), *PAGE_HEADERS), PAGE)


def status_fleet(service: Service, now: float) -> Fleet:
    """What every viewer's status snapshot is cut from (status.py): built once per interval by a
    server that streams them."""
    ready, _ = service.readiness(now=now)
    return fleet(service.catalog.values(), service.pools, service.settings, service.engines, ready,
                 service.serving(), now)


def status_event(service: Service, built: Fleet, view: View, now: float) -> bytes:
    """One server-sent event of one viewer's status snapshot: what `GET /status/events` streams."""
    return event(snapshot(built, view, service.settings, now))


def status_answer(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    view = view_of(query)
    return json_response(200, snapshot(status_fleet(service, now), view, service.settings, now))


def status_events_answer(service: Service, param: str | None, query: str, body: Body, now: float) -> Response:
    """One event: a server streams them (transports/status.py); without one, the page's EventSource
    asks again after `status.RETRY_MS` and the page still follows the fleet."""
    data = status_event(service, status_fleet(service, now), view_of(query), now)
    return Response(200, (("content-type", "text/event-stream"), ("content-length", str(len(data))),
                          ("cache-control", "no-store")), data)
