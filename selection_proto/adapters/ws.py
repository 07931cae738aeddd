"""Sans-IO WebSocket KV-event streams on wsproto (transports.md §3, §4; events.md §7).

`PushSession` is the server side of `GET /kv_events` after the HTTP upgrade; `SubscriptionSession`
is the client side of an outbound `ws://` subscription. Both reassemble fragmented messages up to
8 MiB, answer pings, echo closes, and hand each complete message to the core: a small one at once,
a large one (`StreamSession.next_large`) to the transport, which decodes it in a worker thread and
feeds it back a slice at a time (`apply_slice`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable, Iterator
from typing import Final, NamedTuple

import h11
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from ..core.base import jsonio
from ..core.base.errors import SelectionError, StreamError
from ..core.base.metrics import LIMIT_REJECTIONS, WS_CLOSES, WS_MESSAGES
from ..core.base.routes import PUSH_QUERY
from ..core.base.wire import parse_query, query_int
from ..core.cache.engine import EngineBatch
from ..core.intake.streams import DecodedMessage, decode_or_error, slice_end
from ..core.service import SelectionService
from .inflight import InFlight

__all__ = ["LARGE_MESSAGE", "MAX_MESSAGE", "SLICE_BLOCKS", "SLICE_EVENTS", "ForwardingClient", "LargeMessage", "PushSession", "StreamSession", "SubscriptionSession", "check_handshake", "cut_reason", "server_handshake"]

MAX_MESSAGE: Final = 8 * 1024 * 1024
# A stream message (pushed or subscribed to) larger than this is held for the transport, which
# decodes it away from the event loop and applies it a slice at a time (SLICE_EVENTS events,
# SLICE_BLOCKS blocks), letting other connections run in between.
LARGE_MESSAGE: Final = 256 * 1024
SLICE_EVENTS: Final = 1024
SLICE_BLOCKS: Final = 8192


def cut_reason(reason: str) -> str:
    """At most 123 bytes of UTF-8, cut on a character boundary (RFC 6455 §5.5)."""
    data = reason.encode("utf-8")
    if len(data) <= 123:
        return reason
    return data[:123].decode("utf-8", "ignore")


def check_handshake(method: str, headers: Iterable[tuple[str, str]]) -> str | None:
    """Why a request with an `Upgrade` header is not a valid RFC 6455 handshake, or None."""
    fields: dict[str, str] = {}
    for name, value in headers:
        key = name.lower()
        fields[key] = f"{fields[key]}, {value}" if key in fields else value
    if method != "GET":
        return "the method must be GET"
    if fields.get("upgrade", "").strip().lower() != "websocket":
        return "the Upgrade header must be websocket"
    if "upgrade" not in [t.strip().lower() for t in fields.get("connection", "").split(",")]:
        return "the Connection header must include upgrade"
    if fields.get("sec-websocket-version", "").strip() != "13":
        return "Sec-WebSocket-Version must be 13"
    key = fields.get("sec-websocket-key", "").strip()
    try:
        if len(base64.b64decode(key, validate=True)) != 16:
            raise ValueError
    except (binascii.Error, ValueError):
        return "missing or invalid Sec-WebSocket-Key"
    return None


def server_handshake(target: str, headers: list[tuple[bytes, bytes]]) -> WSConnection | str:
    """The server side of an upgrade that `check_handshake` passed, with its `Request` taken, or
    why wsproto refuses it (it checks more than RFC 6455 asks: a `Host` that IDNA decodes, and
    the header rules of h11)."""
    ws = WSConnection(ConnectionType.SERVER)
    try:
        ws.initiate_upgrade_connection(headers, target)
        events = list(ws.events())
    except UnicodeError:
        return "the Host header is not a valid host name"
    except (LocalProtocolError, RemoteProtocolError, h11.ProtocolError) as exc:
        return str(exc) or type(exc).__name__
    if not any(isinstance(event, Request) for event in events):
        return "the request was not taken as a WebSocket handshake"
    return ws


class LargeMessage(NamedTuple):
    data: bytes | str
    seq: int | None


class StreamSession:
    """Message reassembly, control frames, closing, and the handing over of large messages,
    shared by both roles.

    Messages are applied as they complete, in order, except a large one: it is held, and the
    frames after it wait (`backlog`) until the caller has taken it with `next_large`, decoded it
    (`decode_or_error`, pure, in any thread) and fed it to `apply_slice` to the end. A close that
    follows a large message at once so waits for it too."""

    kind = "websocket_in"

    def __init__(self, service: SelectionService, clock: Callable[[], float], ws: WSConnection,
                 in_flight: InFlight | None = None) -> None:
        self._service = service
        self._in_flight = in_flight  # the bytes of an unfinished message are held there
        self._clock = clock
        self._ws = ws
        self._out: list[bytes] = []
        self._parts: list[bytes | bytearray | str] = []
        self._size = 0
        self.closed = False
        self.close_code: int | None = None
        self.ping_outstanding = False
        self._backlog: Iterator[Event] | None = None  # frames received and not yet handled
        self._large: LargeMessage | None = None  # a large message the caller has yet to apply
        self.stream: int | None = None  # the core's id of the event stream, while it is open

    @property
    def backlog(self) -> bool:
        """Received bytes wait to be handled (`receive_data` stopped at its `until`, or at a large
        message): apply the large message, if any, and call `resume` before reading more."""
        return self._backlog is not None and not self.closed

    def data_to_send(self) -> bytes:
        data = b"".join(self._out)
        self._out.clear()
        return data

    def _send(self, event: Event) -> None:
        try:
            self._out.append(self._ws.send(event))
        except LocalProtocolError:
            self.closed = True

    def _count(self, family: str, labels: tuple[str, ...]) -> None:
        self._service.observe(family, labels, 1.0)

    def close(self, code: int, reason: str) -> None:
        if self.closed:
            return
        if self._ws.state is ConnectionState.OPEN:
            self._send(CloseConnection(code=code, reason=cut_reason(reason)))
            self._count(WS_CLOSES, ("out", str(code)))
        self.closed = True
        self.close_code = code
        self.release()
        self._closed()

    def release(self) -> None:
        """Give back the bytes of the unfinished message (complete, or the stream is gone)."""
        if self._in_flight is not None and self._size:
            self._in_flight.give(self._size)
        self._parts, self._size = [], 0

    def _closed(self) -> None:
        """Hook: the stream ended (tell the core)."""

    def ping(self) -> None:
        if not self.closed and self._ws.state is ConnectionState.OPEN:
            self._send(Ping(payload=b"keepalive"))
            self.ping_outstanding = True

    def connection_lost(self) -> None:
        self.release()
        if not self.closed:
            self.closed = True
            self.close_code = 1006
            self._closed()

    def receive_data(self, data: bytes, until: float | None = None) -> None:
        """`b""` means the peer closed the TCP connection. With `until`, frames are handled only
        until the clock reads past it (a turn of the caller's event loop): the rest wait, parsed
        as they are handled, for `resume`. A flood of small messages has many per read, and its
        bytes alone do not bound a turn (docs/INVARIANTS.md)."""
        if self.closed:
            return
        if not data:
            self.connection_lost()
            return
        try:
            self._ws.receive_data(data)
        except (LocalProtocolError, RemoteProtocolError) as exc:
            self.close(1002, f"protocol error: {exc}")
            return
        self.resume(until)

    def resume(self, until: float | None = None) -> None:
        """Handle the frames `receive_data` left: all of them, or until the clock passes `until`,
        or up to a large message (`next_large`)."""
        if self._large is not None and not self.closed:
            return  # the large message first
        events = self._backlog if self._backlog is not None else self._ws.events()
        self._backlog = None
        clock = self._clock
        for event in events:
            if self.closed:
                return
            self._event(event)
            if self._large is not None or (until is not None and clock() >= until):
                self._backlog = events
                return

    def _event(self, event: Event) -> None:
        if isinstance(event, (TextMessage, BytesMessage)):
            if self._size + len(event.data) > MAX_MESSAGE:
                self._service.observe(LIMIT_REJECTIONS, ("ws_message_size",), 1.0)
                self.close(1009, f"message exceeds {MAX_MESSAGE} bytes")
                return
            if self._in_flight is not None and not self._in_flight.take(len(event.data)):
                self._service.observe(LIMIT_REJECTIONS, ("buffer_bytes",), 1.0)
                self.close(1013, "message bytes in flight exceed the server's buffer budget; try again later")
                return
            self._parts.append(event.data)
            self._size += len(event.data)
            if event.message_finished:
                parts = self._parts
                self.release()
                if isinstance(event, TextMessage):
                    self._count(WS_MESSAGES, ("in", "text"))
                    self._message("".join(parts))  # type: ignore[arg-type]
                else:
                    self._count(WS_MESSAGES, ("in", "binary"))
                    self._message(b"".join(parts))  # type: ignore[arg-type]
        elif isinstance(event, Ping):
            self._send(event.response())
        elif isinstance(event, Pong):
            self.ping_outstanding = False
        elif isinstance(event, CloseConnection):
            if self._ws.state is ConnectionState.REMOTE_CLOSING:
                self._count(WS_CLOSES, ("in", str(event.code)))
                self._send(event.response())
                self.closed = True
                self.close_code = event.code
                self._closed()
            elif event.code == 1007:  # wsproto found invalid UTF-8 in a text frame
                self.close(1007, "invalid UTF-8 in text message")
            else:
                self.close(1002, f"protocol error: {event.reason}")
        else:
            self._other(event)

    def _message(self, data: bytes | str) -> None:
        """Hook: a complete message; its framing read, it goes on to `_take`."""
        raise NotImplementedError

    def _other(self, event: Event) -> None:
        """Hook for handshake events (client role)."""

    def _take(self, data: bytes | str, seq: int | None) -> None:
        """Apply a message's events now, or hold a large one for the caller."""
        if len(data) > LARGE_MESSAGE:
            self._large = LargeMessage(data, seq)
        else:
            self._apply(data, seq, 0, None)

    def next_large(self) -> LargeMessage | None:
        """The large message the caller is to decode and apply before anything after it, or None."""
        return None if self.closed else self._large

    def apply_slice(self, message: LargeMessage, decoded: DecodedMessage | SelectionError,
                    start: int) -> int | None:
        """Apply the events of `message` from `start` on, a slice of at most SLICE_EVENTS events and
        SLICE_BLOCKS blocks (`slice_end`); the next start, or None when the message is done
        (applied or refused, or the stream closed)."""
        if self.closed:
            return None
        if isinstance(decoded, SelectionError):
            count = stop = 0  # refused whole, as a small one would be (`_apply`)
        else:
            count = len(decoded.events) if isinstance(decoded, EngineBatch) else len(decoded)
            stop = slice_end(decoded, start, SLICE_EVENTS, SLICE_BLOCKS)
        if not self._apply(decoded, message.seq, start, stop, last=stop >= count):
            return None
        if stop < count:
            return stop
        self._large = None
        return None

    def apply_held(self) -> None:
        """Handle everything received, large messages decoded here: for a caller that has no
        worker thread to decode in (the transports do, and apply slices between turns)."""
        while not self.closed:
            if (message := self.next_large()) is not None:
                decoded = decode_or_error(message.data)
                start: int | None = 0
                while start is not None:
                    start = self.apply_slice(message, decoded, start)
            elif self.backlog:
                self.resume()
            else:
                return

    def _apply(self, data: bytes | str | DecodedMessage | SelectionError, seq: int | None, start: int,
               stop: int | None, last: bool = True) -> bool:
        """One message, or its events `start:stop`; False when the core refused it and the
        stream is closed (a subscription's core drops and counts a bad message instead)."""
        assert self.stream is not None
        try:
            self._service.stream_message(self.stream, data, seq=seq, now=self._clock(), start=start,
                                         stop=stop)
        except StreamError as exc:
            self.close(exc.code, exc.reason)
            return False
        if last:
            self._applied()
        return True

    def _applied(self) -> None:
        """Hook: a message's last event was applied."""


class PushSession(StreamSession):
    """The server side of `GET /kv_events` (a push stream), from the upgrade request on."""

    def __init__(self, service: SelectionService, clock: Callable[[], float], ws: WSConnection,
                 target: str, trailing: bytes, in_flight: InFlight | None = None) -> None:
        """`ws` comes from `server_handshake`, its request taken and not yet answered."""
        super().__init__(service, clock, ws, in_flight)
        self._send(AcceptConnection())
        self._seq_framing = False
        self._ack = False
        self._processed = 0
        self._bind(target.partition("?")[2])
        if trailing and not self.closed:
            self.receive_data(trailing)

    def _bind(self, query: str) -> None:
        """The events.md §7.2 checks; a failure closes the new connection with 1008."""
        try:
            service = self._service
            service.check_push_mode()
            params = parse_query(query, PUSH_QUERY)
            if "worker_id" not in params:
                raise SelectionError("worker_id is required", 400)
            worker_id = query_int(params, "worker_id", 64)
            dp_rank = query_int(params, "dp_rank", 32)
            framing = params.get("framing", "raw")
            ack = params.get("ack", "false")
            resume = params.get("resume", "false")
            if resume not in ("true", "false"):
                raise SelectionError("Failed to deserialize query string: resume: invalid boolean "
                                     f"`{resume}`", 400)
            if framing not in ("raw", "seq"):
                raise SelectionError("Failed to deserialize query string: framing: unknown variant "
                                     f"`{framing}`, expected `raw` or `seq`", 400)
            if ack not in ("true", "false"):
                raise SelectionError("Failed to deserialize query string: ack: invalid boolean "
                                     f"`{ack}`", 400)
            assert worker_id is not None
            self.stream = service.open_event_stream(
                worker_id, 0 if dp_rank is None else dp_rank, model_name=params.get("model_name"),
                tenant_id=params.get("tenant_id"), now=self._clock())
            self._seq_framing = framing == "seq"
            self._ack = ack == "true"
            if resume == "true":  # where the index stands, so that a sender can resend from there
                position = service.stream_position(self.stream)
                self._send(TextMessage(data=f'{{"resume":{"null" if position is None else position}}}'))
        except SelectionError as exc:
            self.close(1008, exc.message)

    def _message(self, data: bytes | str) -> None:
        assert self.stream is not None
        seq = None
        if isinstance(data, bytes) and self._seq_framing:
            if len(data) < 8:
                self.close(1007, "invalid engine batch: missing 8-byte seq prefix")
                return
            seq, data = int.from_bytes(data[:8], "big"), data[8:]
        self._take(data, seq)

    def _applied(self) -> None:
        self._processed += 1
        if self._ack:
            self._send(TextMessage(data=f'{{"ack":{self._processed}}}'))
            self._count(WS_MESSAGES, ("out", "text"))

    def _closed(self) -> None:
        if self.stream is not None:
            self._service.close_event_stream(self.stream, now=self._clock())
            self.stream = None


class SubscriptionSession(StreamSession):
    """The client side of an outbound `ws://` / `wss://` subscription (transports.md §4)."""

    kind = "websocket_out"
    stream: int  # the subscription's, for the session's whole life

    def __init__(self, service: SelectionService, clock: Callable[[], float], stream: int, host: str,
                 target: str) -> None:
        super().__init__(service, clock, WSConnection(ConnectionType.CLIENT))
        self.stream = stream
        self.accepted = False
        self.rejected: str | None = None
        self._seq_framing = "framing=seq" in target.partition("?")[2].split("&")
        self._send(Request(host=host, target=target))

    def _other(self, event: Event) -> None:
        if isinstance(event, AcceptConnection):
            self.accepted = True
            self._service.subscription_state(self.stream, True, now=self._clock())
        elif isinstance(event, RejectConnection):
            self.rejected = f"handshake refused with status {event.status_code}"
            self.closed = True

    def _message(self, data: bytes | str) -> None:
        seq = None
        if isinstance(data, bytes) and self._seq_framing:
            if len(data) < 8:
                self._service.stream_dropped(self.stream, "invalid_message")
                return
            seq, data = int.from_bytes(data[:8], "big"), data[8:]
        self._take(data, seq)

    def _closed(self) -> None:
        if self.accepted:
            self._service.subscription_state(self.stream, False, now=self._clock())


def parse_resume(text: str) -> tuple[int | None] | None:
    """`({"resume": n}["resume"],)` from the service, None for anything else."""
    try:
        message = jsonio.loads(text)
    except jsonio.JSONSyntaxError:
        return None
    if not isinstance(message, dict) or "resume" not in message:
        return None
    value = message["resume"]
    if value is None or (type(value) is int and 0 <= value < 1 << 63):
        return (value,)
    return None


def parse_ack(text: str) -> int:
    """The count of `{"ack": n}` from the service, or 0 for anything else: whatever the service
    sends (deep nesting, a thousand-digit number), the relay keeps forwarding."""
    try:
        message = jsonio.loads(text)
    except jsonio.JSONSyntaxError:
        return 0
    ack = message.get("ack") if isinstance(message, dict) else None
    if type(ack) is not int or not 0 <= ack < 1 << 63:
        return 0
    return ack


class ForwardingClient:
    """The client side of the relay's connection to `/kv_events`: sends binary messages, reads
    `{"ack": n}` texts, and reports how the connection ended. No core involved."""

    def __init__(self, host: str, target: str) -> None:
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._out: list[bytes] = [self._ws.send(Request(host=host, target=target))]
        self.accepted = False
        self.closed = False
        self.acked = 0
        self.resume: int | None = None  # the service's last applied seq, once it said it
        self.resumed = False
        self.close_code: int | None = None
        self.close_reason = ""
        self.rejected: str | None = None

    def data_to_send(self) -> bytes:
        data = b"".join(self._out)
        self._out.clear()
        return data

    def send_binary(self, data: bytes) -> None:
        self._out.append(self._ws.send(BytesMessage(data=data)))

    def receive_data(self, data: bytes) -> None:
        if self.closed:
            return
        if not data:
            self.closed, self.close_code = True, 1006
            return
        try:
            self._ws.receive_data(data)
        except (LocalProtocolError, RemoteProtocolError) as exc:
            self.closed, self.close_code, self.close_reason = True, 1002, str(exc)
            return
        for event in self._ws.events():
            if isinstance(event, AcceptConnection):
                self.accepted = True
            elif isinstance(event, RejectConnection):
                self.rejected = f"handshake refused with status {event.status_code}"
                self.closed = True
            elif isinstance(event, TextMessage):
                resume = parse_resume(event.data)
                if resume is not None:
                    self.resumed, self.resume = True, resume[0]
                else:
                    self.acked = max(self.acked, parse_ack(event.data))
            elif isinstance(event, Ping):
                self._out.append(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self.close_code, self.close_reason = event.code, event.reason or ""
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    self._out.append(self._ws.send(event.response()))
                self.closed = True
