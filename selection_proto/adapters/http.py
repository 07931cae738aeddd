"""Sans-IO HTTP/1.1 server connection on h11: bytes in, bytes out, answers from the core's `handle`.

One `HttpConnection` per client. Requests are answered strictly in order (pipelining), bodies
may be chunked, `Expect: 100-continue` gets its interim answer, and limits are enforced while
reading: a body over 8 MiB is refused as soon as that is known, without reading the rest.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Callable
from http import HTTPStatus
from typing import Final, NamedTuple

import h11
from wsproto import WSConnection

from ..core.base.errors import SelectionError
from ..core.base.metrics import LIMIT_REJECTIONS, REQUEST_DURATION
from ..core.base.responses import Pending
from ..core.base.routes import (
    MAX_BODY,
    MSGPACK_TYPES,
    ParsedBody,
    body_limit,
    is_json,
    match,
    media_type,
    route_of,
)
from ..core.base.wire import Response, error_response
from ..core.service import SelectionService
from ..core.status import View, view_of
from .inflight import InFlight
from .ws import check_handshake, server_handshake

__all__ = ["LARGE_BODY", "MAX_HEADER_BYTES", "HttpConnection", "LargeRequest", "Upgrade"]

MAX_HEADER_BYTES: Final = 16384
_SERVER_HEADER: Final = (b"server", b"selection-proto")
_LARGE_PIECE: Final = 1 << 20


LARGE_BODY: Final = 256 * 1024


class LargeRequest(NamedTuple):
    """A request whose JSON body is large enough to be parsed away from the event loop (`parse`),
    a `GET /dump`, whose answer the caller produces away from it (`answer_with`), or one that
    reads the service's state while deferred work is pending, which the caller runs a piece at a
    time first, its other clients served between pieces (core/base/deferred.py)."""

    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    parse: bool = False


# Answers that read none of the service's state: they need not wait for its deferred work.
STATELESS_PATHS: Final = frozenset({"/health", "/readyz"})


def _takes_json(method: str, path: str, headers: list[tuple[str, str]]) -> bool:
    """A body `handler.prepare_large_body` can read: JSON, or msgpack but an engine batch."""
    matched = match(path)
    route = route_of(method, matched[0]) if matched is not None else None
    if route is None or not route.body:
        return False
    media = media_type(headers)
    return is_json(media) or (media in MSGPACK_TYPES and route.operation != "kv_events")


class Upgrade(NamedTuple):
    """A request that became a WebSocket: its handshake taken, the bytes that followed it."""

    ws: WSConnection
    target: str
    trailing: bytes


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


# Routes anyone may read, with or without `--auth-token-file`: probes, scrapes, the API's shape.
OPEN_PATHS: Final = (b"/health", b"/ready", b"/readyz", b"/metrics", b"/openapi.json")


class HttpConnection:
    """Feed received bytes with `receive_data`, send what `data_to_send` returns, close when
    `closed` is true. `busy` tells whether a request is partly received or being answered."""

    def __init__(self, service: SelectionService, clock: Callable[[], float], *,
                 defer_large: bool = False, auth_token: bytes | None = None,
                 access: Callable[[str, str, int, float], None] | None = None,
                 in_flight: InFlight | None = None, feeds: bool = False) -> None:
        """With `defer_large`, a JSON body over 256 KiB is not parsed here: it waits in
        `large_request` until the caller parses it (`handler.prepare_large_body`, pure, in any thread)
        and hands the result to `complete_large`, so that parsing megabytes does not hold up
        the caller's other connections. With `auth_token`, every route but the open ones
        (`OPEN_PATHS`) needs `Authorization: Bearer <token>` (or Basic with the token as password, as a
        browser sends it for the status page); others get 401 before their body is read.
        With `in_flight`, a body being received holds its bytes there until it is complete: one
        that does not fit (declared or as it comes) is refused with 503 and the connection closed.
        With `feeds`, a `GET /status/events` waits in `feed_requested` for the caller to stream
        (`start_feed`, `feed`); without, the core answers it with one event."""
        self._service = service
        self._token = auth_token
        self._auth = None if auth_token is None else b"Bearer " + auth_token
        # Told (method, path, status, seconds) of every answer: the transport's access log.
        self._access = access
        self._started = 0.0
        self._clock = clock
        self._defer_large = defer_large
        self.large_request: LargeRequest | None = None
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        self._out: list[bytes] = []
        self._request: h11.Request | None = None
        self._body: list[bytes] = []
        self._body_len = 0
        self._max_body = MAX_BODY  # the request's route's (`body_limit`), once its head has come
        self._in_flight = in_flight
        self._held = 0  # body bytes held in `in_flight`
        self.pending_ticket: int | None = None
        self._paused = False  # an answer was produced; the next request waits until it is taken
        # Set when the request was a valid WebSocket upgrade.
        self.upgrade: Upgrade | None = None
        self._feeds = feeds
        self.feed_requested = False
        self.feed_view = View()  # the requested feed's filter
        self.closed = False
        self.close_after_response = False

    @property
    def busy(self) -> bool:
        """A request is partly received (bytes buffered count too) or being answered."""
        return (self._request is not None or self._h11.their_state not in (h11.IDLE, h11.DONE)
                or bool(self._h11.trailing_data[0]))

    @property
    def buffered_bytes(self) -> int:
        """Received bytes not parsed yet (pipelined requests behind a queued one)."""
        return len(self._h11.trailing_data[0])

    @property
    def linger(self) -> bool:
        """Closed by us while the client may still be sending (a refused body, a malformed
        request): the transport should read and drop for a moment before closing."""
        return self.closed and self.upgrade is None and self._h11.their_state in (h11.SEND_BODY, h11.ERROR)

    def internal_error(self) -> None:
        """Something failed while serving this connection: 500 when an answer can still start,
        and close either way."""
        if not self.closed and self._h11.our_state is h11.SEND_RESPONSE:
            self._respond(error_response(500, "internal error"), close=True)
        self.closed = True

    def data_to_send(self) -> bytes:
        """What to send now. Pipelined requests are parsed only after the previous answer has been
        taken here, so call it until it returns b"" (memory stays bounded by one answer)."""
        if not self._out and self._paused and not self.closed:
            self._paused = False
            self._drain()
        out = self._out
        if len(out) > 1 and any(len(piece) > _LARGE_PIECE for piece in out):
            return out.pop(0)  # a large body goes out as its own piece, not copied into a join
        data = b"".join(out)
        out.clear()
        return data

    def receive_data(self, data: bytes) -> None:
        """`b""` means the peer closed its side."""
        if self.closed:
            return
        self._h11.receive_data(data)
        self._drain()

    def shutdown(self) -> None:
        """Finish the answer in progress with `connection: close`; close at once when idle."""
        self.close_after_response = True
        if not self.busy:
            self.closed = True

    def _drain(self) -> None:
        while (not self.closed and self.pending_ticket is None and not self._paused
               and self.large_request is None):
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._protocol_error(exc)
                return
            if event is h11.NEED_DATA:
                if self._h11.they_are_waiting_for_100_continue and self._request is not None:
                    self._send(h11.InformationalResponse(status_code=100, headers=[]))
                return
            if event is h11.PAUSED:
                if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
                    self._h11.start_next_cycle()
                    continue
                return
            if isinstance(event, h11.Request):
                self._begin(event)
            elif isinstance(event, h11.Data):
                self._body_len += len(event.data)
                if self._body_len > self._max_body:
                    self._refuse_body()
                    return
                if self._in_flight is not None:
                    if not self._in_flight.take(len(event.data)):
                        self._refuse_busy()
                        return
                    self._held += len(event.data)
                self._body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._finish()
            elif isinstance(event, h11.ConnectionClosed):
                self.closed = True
                return

    def _begin(self, request: h11.Request) -> None:
        self._request = request
        self._started = self._clock()
        self._body = []
        self._body_len = 0
        # h11 bounds only a header block that arrives in pieces; one that arrives whole is
        # measured here (request line and header lines, as sent on the wire).
        size = len(request.method) + len(request.target) + 12 + sum(
            len(n) + len(v) + 4 for n, v in request.headers)
        if size > MAX_HEADER_BYTES:
            self._service.observe(LIMIT_REJECTIONS, ("header_size",), 1.0)
            self._respond(error_response(431, f"request header block exceeds {MAX_HEADER_BYTES} bytes"),
                          close=True)
            return
        path = request.target.split(b"?", 1)[0]
        # A free's or a prefill mark's body is refused past a few KiB before it is read.
        self._max_body = body_limit(request.method.decode("ascii", "replace"), path.decode("ascii", "replace"))
        if self._auth is not None and path not in OPEN_PATHS:
            given = next((v for n, v in request.headers if n == b"authorization"), b"")
            if not (hmac.compare_digest(given, self._auth) or self._basic_auth(given)):
                self._service.observe(LIMIT_REJECTIONS, ("auth",), 1.0)
                # A browser asks its user for the token only when challenged with Basic.
                challenge = 'Basic realm="selection-proto", charset="UTF-8"' if path.startswith(b"/status") \
                    else "Bearer"
                self._respond(error_response(401, "missing or invalid bearer token",
                                             (("www-authenticate", challenge),)), close=True)
                return
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            # RFC 9112 §6.3: a smuggling attempt until proven otherwise; answer and close.
            self._respond(error_response(400, "malformed HTTP request: both Content-Length and "
                                              "Transfer-Encoding"), close=True)
            return
        for name, value in request.headers:
            # h11 has checked the digits; a declared length of any size is compared as text first.
            if name == b"content-length" and (len(value.lstrip(b"0")) > 19 or int(value) > self._max_body):
                self._refuse_body()
                return
            if name == b"content-length" and self._in_flight is not None and not self._in_flight.fits(int(value)):
                self._refuse_busy()
                return
            if name == b"connection" and b"close" in value.lower():
                self.close_after_response = True

    def _basic_auth(self, given: bytes) -> bool:
        """`Basic` credentials whose password is the token, any user name: how a browser sends it."""
        if self._token is None or given[:6].lower() != b"basic ":
            return False
        try:
            password = base64.b64decode(given[6:].strip(), validate=True).partition(b":")[2]
        except binascii.Error:
            return False
        return hmac.compare_digest(password, self._token)

    def release(self) -> None:
        """Give back the body bytes held in the budget (the body is complete, or gone)."""
        if self._in_flight is not None and self._held:
            self._in_flight.give(self._held)
        self._held = 0

    def _refuse_busy(self) -> None:
        self.release()
        self._service.observe(LIMIT_REJECTIONS, ("buffer_bytes",), 1.0)
        self._respond(error_response(503, "request bytes in flight exceed the server's buffer budget; "
                                          "retry later"), close=True)

    def _refuse_body(self) -> None:
        self.release()
        self._service.observe(LIMIT_REJECTIONS, ("body_size",), 1.0)
        self._respond(error_response(413, "Failed to buffer the request body: length limit exceeded"),
                      close=True)

    def _finish(self) -> None:
        request = self._request
        assert request is not None
        target = request.target.decode("ascii", "replace")
        path, _, query = target.partition("?")
        headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in request.headers]
        method = request.method.decode("ascii", "replace")
        if path == "/kv_events" and any(n == "upgrade" for n, _ in headers):
            checked = check_handshake(method, headers) or server_handshake(target, list(request.headers))
            if isinstance(checked, WSConnection):
                # Hand the connection over to a WebSocket session (transports.md §2, Upgrade).
                self.upgrade = Upgrade(checked, target, self._h11.trailing_data[0])
                self._request = None
                self.closed = True
                return
            self._respond(error_response(400, f"invalid WebSocket upgrade: {checked}"), close=True)
            return
        body = b"".join(self._body)
        self._body = []
        self.release()
        if self._feeds and method == "GET" and path == "/status/events":
            try:
                self.feed_view = view_of(query)
            except SelectionError:
                pass  # the core answers it: 400 with the reason
            else:
                self.feed_requested = True  # the answer is the caller's: `start_feed`
                return
        if self._defer_large and method in ("GET", "HEAD") and path == "/dump":
            self.large_request = LargeRequest(method, path, query, headers, body)
            return
        if self._defer_large and len(body) > LARGE_BODY and _takes_json(method, path, headers):
            self.large_request = LargeRequest(method, path, query, headers, body, parse=True)
            return
        if self._defer_large and self._service.deferred and path not in STATELESS_PATHS:
            self.large_request = LargeRequest(method, path, query, headers, body)
            return
        self._answer(method, path, query, headers, body)

    def complete_large(self, parsed: ParsedBody | None) -> None:
        """The `large_request`'s body as `handler.prepare_large_body` read it (None: not parsed
        ahead, or msgpack that does not parse, which `handle` then reports itself, with the usual
        text); answers it and goes on."""
        request = self.large_request
        if request is None or self.closed:
            return
        self.large_request = None
        method, path, query, headers, raw, _ = request
        self._answer(method, path, query, headers, raw if parsed is None else parsed)
        self._drain()

    def _answer(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                body: bytes | ParsedBody) -> None:
        started = self._clock()
        result = self._service.handle(method, path, query, headers, body, now=started)
        matched = match(path)
        self._service.observe(REQUEST_DURATION,
                              (matched[0] if matched else "unmatched",), self._clock() - started)
        if isinstance(result, Pending):
            # The answer arrives later as a SelectionReady; later pipelined requests wait behind it.
            self.pending_ticket = result.ticket
            return
        self._respond(result, close=self.close_after_response, head=method == "HEAD")

    def answer_with(self, response: Response) -> None:
        """The answer of the deferred `GET /dump` in `large_request`; goes on with pipelined ones."""
        request = self.large_request
        if request is None or self.closed:
            return
        self.large_request = None
        self._respond(response, close=self.close_after_response, head=request.method == "HEAD")
        self._drain()

    def resolve(self, response: Response) -> None:
        """Send the answer of the pending selection, then go on with pipelined requests."""
        if self.pending_ticket is None or self.closed:
            return
        self.pending_ticket = None
        self._respond(response, close=self.close_after_response)
        self._drain()

    def _respond(self, response: Response, *, close: bool, head: bool = False) -> None:
        headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in response.headers]
        headers.append(_SERVER_HEADER)
        if close:
            headers.append((b"connection", b"close"))
        try:
            self._send(h11.Response(status_code=response.status, headers=headers,
                                    reason=_reason(response.status)))
            if response.body and not head:
                # Passed through, not copied: a /ready of 100k workers is tens of megabytes.
                pieces = self._h11.send_with_data_passthrough(h11.Data(data=response.body)) or ()
                self._out.extend(piece for piece in pieces if piece)
            self._send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            self.closed = True
            return
        if self._access is not None and self._request is not None:
            self._access(self._request.method.decode("ascii", "replace"),
                         self._request.target.split(b"?", 1)[0].decode("ascii", "replace"),
                         response.status, self._clock() - self._started)
        self._request = None
        if close or self._h11.our_state is h11.MUST_CLOSE:
            self.closed = True
        else:
            self._paused = True

    def _protocol_error(self, exc: h11.RemoteProtocolError) -> None:
        if self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.closed = True
            return
        if exc.error_status_hint == 431:
            self._service.observe(LIMIT_REJECTIONS, ("header_size",), 1.0)
            response = error_response(431, f"request header block exceeds {MAX_HEADER_BYTES} bytes")
        else:
            response = error_response(400, f"malformed HTTP request: {exc}")
        self._respond(response, close=True)
        self.closed = True

    def _send(self, event: h11.Event) -> None:
        data = self._h11.send(event)
        if data:
            self._out.append(data)

    def start_feed(self, allowed: bool) -> None:
        """Begin the requested event stream (one that ends when the connection does), or refuse it
        with 503 when the caller has as many as it allows."""
        self.feed_requested = False
        if not allowed:
            self._service.observe(LIMIT_REJECTIONS, ("status_viewers",), 1.0)
            self._respond(error_response(503, "too many status page viewers; retry later"), close=True)
            return
        self._send(h11.Response(status_code=200, reason=b"OK", headers=[
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-store"),
            (b"x-accel-buffering", b"no"), _SERVER_HEADER, (b"connection", b"close")]))

    def feed(self, data: bytes) -> None:
        """More of the event stream `start_feed` began."""
        self._send(h11.Data(data=data))

    def timeout_response(self) -> None:
        """The request did not arrive in time: 408 and close."""
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE) and self.busy:
            self._respond(error_response(408, "request timeout"), close=True)
        self.closed = True
