"""gRPC over HTTP/2 for a server, Sans-IO (adapters/http2.py underneath): bytes in, calls and their
length-prefixed messages out; replies and trailers back to bytes. It knows no service: the
transport says what each call does (transports/ext_proc.py). What gRPC's PROTOCOL-HTTP2.md asks of
a server is here, no more: no compression, no binary metadata, no deadlines (the transport keeps
its own).

Flow control is per call: while its handler has read every message emitted, what arrives is
acknowledged, a quarter of a window at a time (a message may be larger than any window; a frame
per message would be a cost on both sides); while one waits unread, nothing is, until the
transport says it has been consumed. A call whose handler is busy so holds back its own peer
after one window, never the connection (whose window http2.py gives back as bytes arrive)."""

from __future__ import annotations

from typing import Final

import attrs

from .http2 import (
    DataReceived,
    ErrorCode,
    H2Server,
    ProtocolError,
    RequestReceived,
    StreamEnded,
    StreamGone,
    StreamReset,
    Terminated,
    WindowUpdated,
)

__all__ = ["CallEnded", "CallReset", "CallStarted", "Event", "GrpcServer", "Message", "Status", "WindowOpened"]


class Status:
    """The gRPC status codes this server answers with."""

    OK: Final = 0
    INVALID_ARGUMENT: Final = 3
    NOT_FOUND: Final = 5
    RESOURCE_EXHAUSTED: Final = 8
    UNIMPLEMENTED: Final = 12
    INTERNAL: Final = 13
    UNAVAILABLE: Final = 14
    UNAUTHENTICATED: Final = 16


@attrs.frozen
class CallStarted:
    stream_id: int
    path: str
    metadata: dict[str, bytes]  # lower-case names; a repeated name keeps its first value


@attrs.frozen
class Message:
    stream_id: int
    payload: bytes


@attrs.frozen
class CallEnded:
    """The peer has sent all it will (half-closed): a read now sees the end."""

    stream_id: int


@attrs.frozen
class CallReset:
    """The peer cancelled the call, or it broke a rule and was answered: its handler stops."""

    stream_id: int


@attrs.frozen
class WindowOpened:
    """The peer made room (0: for every call, by the connection's window or its SETTINGS): what
    waited for it has been framed, and a call held back by `pending` may go on."""

    stream_id: int


Event = CallStarted | Message | CallEnded | CallReset | WindowOpened

STREAM_WINDOW: Final = 1 << 20
CONNECTION_WINDOW: Final = 1 << 24
_GRPC_HEADERS: Final = ((b":status", b"200"), (b"content-type", b"application/grpc"))


@attrs.define
class _Call:
    buffer: bytearray = attrs.field(factory=bytearray)
    unread: int = 0  # messages emitted and not yet consumed
    withheld: int = 0  # flow-control bytes received and not given back while some were unread
    headers_sent: bool = False
    outbound: bytearray = attrs.field(factory=bytearray)  # waiting for window
    trailers: list[tuple[bytes, bytes]] | None = None  # sent once `outbound` is empty


class GrpcServer:
    """One HTTP/2 connection's gRPC calls. After each `receive`, and each send, the transport
    writes `data_to_send()`; `closed` says the connection is over (after those bytes)."""

    def __init__(self, *, max_message_bytes: int, max_calls: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._h2 = H2Server(max_concurrent_streams=max_calls, stream_window=STREAM_WINDOW,
                            connection_window=CONNECTION_WINDOW)
        self._calls: dict[int, _Call] = {}
        self._unframed: set[int] = set()  # calls with messages queued since the last frames
        self.started = False  # the peer's preface has arrived
        self.closed = False

    def data_to_send(self) -> bytes:
        while self._unframed:
            self._flush(self._unframed.pop())
        return self._h2.data_to_send()

    # -- what the peer sent ---------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """The events in `data`. A broken connection is closed (GOAWAY queued, `closed` set)."""
        if self.closed:
            return []
        try:
            h2_events = self._h2.receive_data(data)
        except ProtocolError as exc:
            self._h2.close_connection(exc.code)
            self.closed = True
            return [CallReset(stream_id) for stream_id in self._calls]
        self.started = self._h2.preface_received
        events: list[Event] = []
        for event in h2_events:
            if isinstance(event, DataReceived):
                self._data(event, events)
            elif isinstance(event, RequestReceived):
                self._started(event, events)
            elif isinstance(event, StreamEnded) and event.stream_id in self._calls:
                call = self._calls[event.stream_id]
                if call.buffer:  # a message cut short
                    self.finish(event.stream_id, Status.INVALID_ARGUMENT, "the stream ended inside a message")
                    events.append(CallReset(event.stream_id))
                else:
                    events.append(CallEnded(event.stream_id))
            elif isinstance(event, StreamReset) and self._calls.pop(event.stream_id, None) is not None:
                events.append(CallReset(event.stream_id))
            elif isinstance(event, WindowUpdated):  # 0: the connection's, or every stream's by SETTINGS
                for stream_id in [event.stream_id] if event.stream_id else list(self._calls):
                    self._flush(stream_id)
                events.append(WindowOpened(event.stream_id))
            elif isinstance(event, Terminated):
                self.closed = True
                events += [CallReset(stream_id) for stream_id in self._calls]
        return events

    def _started(self, event: RequestReceived, events: list[Event]) -> None:
        fields: dict[bytes, bytes] = {}
        for name, value in event.headers:
            fields.setdefault(name, value)
        stream_id = event.stream_id
        if fields.get(b":method") != b"POST" or not fields.get(b"content-type", b"").startswith(b"application/grpc"):
            try:
                self._h2.send_headers(stream_id, [(b":status", b"415")], end_stream=True)
            except StreamGone:  # reset later in the same bytes
                return
            self._reset_quietly(stream_id)
            return
        self._calls[stream_id] = _Call()
        metadata = {name.decode("latin-1"): value for name, value in fields.items() if not name.startswith(b":")}
        events.append(CallStarted(stream_id, fields.get(b":path", b"").decode("latin-1"), metadata))

    def _data(self, event: DataReceived, events: list[Event]) -> None:
        stream_id = event.stream_id
        call = self._calls.get(stream_id)
        data = event.data
        if call is None:  # answered (and reset) already: its bytes are dropped
            return
        call.buffer += data
        call.withheld += event.flow_controlled_length
        while len(call.buffer) >= 5:
            compressed, size = call.buffer[0], int.from_bytes(call.buffer[1:5], "big")
            if compressed:
                self._refuse(stream_id, Status.UNIMPLEMENTED, "compressed messages are not accepted", events)
                return
            if size > self.max_message_bytes:
                self._refuse(stream_id, Status.RESOURCE_EXHAUSTED,
                             f"a message of {size} bytes is over the limit of {self.max_message_bytes}", events)
                return
            if len(call.buffer) < 5 + size:
                break
            payload = bytes(call.buffer[5:5 + size])
            del call.buffer[:5 + size]
            call.unread += 1
            events.append(Message(stream_id, payload))
        if not call.unread:  # the handler keeps up: what is buffered is a message not yet whole
            self._give_back(call, stream_id)

    def _refuse(self, stream_id: int, code: int, text: str, events: list[Event]) -> None:
        self.finish(stream_id, code, text)
        self._reset_quietly(stream_id)
        events.append(CallReset(stream_id))

    def _give_back(self, call: _Call, stream_id: int) -> None:
        if call.withheld >= STREAM_WINDOW // 4:
            self._h2.increment_flow_control_window(call.withheld, stream_id)  # (nothing if it has ended)
            call.withheld = 0

    def consumed(self, message: Message) -> None:
        """The handler took `message`: once it has taken all, its peer may send on."""
        call = self._calls.get(message.stream_id)
        if call is not None:
            call.unread -= 1
            if not call.unread:
                self._give_back(call, message.stream_id)

    # -- what this side sends -------------------------------------------------------------------

    def send_message(self, stream_id: int, payload: bytes) -> None:
        """Queue one message; it leaves as the peer's window allows (`pending` says what waits)."""
        call = self._calls.get(stream_id)
        if call is None or call.trailers is not None:
            return  # reset, or finished: nobody reads it
        if not call.headers_sent:
            try:
                self._h2.send_headers(stream_id, _GRPC_HEADERS)
            except StreamGone:  # reset in the same bytes that started it: its CallReset follows
                self._calls.pop(stream_id, None)
                return
            call.headers_sent = True
        call.outbound += len(payload).to_bytes(5, "big")
        call.outbound += payload
        self._unframed.add(stream_id)  # framed later, with the messages queued after it: fewer frames

    def pending(self, stream_id: int) -> int:
        """Bytes of the call's messages still waiting for the peer's window."""
        self._flush(stream_id)
        call = self._calls.get(stream_id)
        return len(call.outbound) if call is not None else 0

    def finish(self, stream_id: int, code: int, text: str = "") -> None:
        """End the call with its status, after the messages queued before (trailers-only when
        none was sent)."""
        call = self._calls.get(stream_id)
        if call is None or call.trailers is not None:
            return
        trailers = [(b"grpc-status", str(code).encode())]
        if text:
            trailers.append((b"grpc-message", _percent_encoded(text)))
        if not call.headers_sent:
            trailers[:0] = _GRPC_HEADERS
            call.headers_sent = True
        call.trailers = trailers
        self._flush(stream_id)

    def go_away(self) -> None:
        """No new calls; those started go on to their end."""
        if not self.closed:
            self._h2.close_connection(ErrorCode.NO_ERROR)

    @property
    def calls(self) -> int:
        return len(self._calls)

    def _flush(self, stream_id: int) -> None:
        self._unframed.discard(stream_id)
        call = self._calls.get(stream_id)
        if call is None:
            return
        try:
            while call.outbound:
                room = min(self._h2.local_flow_control_window(stream_id), self._h2.max_outbound_frame_size)
                if room <= 0:
                    return
                self._h2.send_data(stream_id, bytes(call.outbound[:room]))
                del call.outbound[:room]
            if call.trailers is not None:
                self._h2.send_headers(stream_id, call.trailers, end_stream=True)
                del self._calls[stream_id]
                self._reset_quietly(stream_id)
        except StreamGone:  # the peer reset it meanwhile
            self._calls.pop(stream_id, None)

    def _reset_quietly(self, stream_id: int) -> None:
        """After the answer's end, a peer still sending is told to stop (RFC 9113 §8.1)."""
        self._calls.pop(stream_id, None)
        self._h2.reset_stream(stream_id, ErrorCode.NO_ERROR)  # (nothing if it has ended both ways)


def _percent_encoded(text: str) -> bytes:
    """grpc-message: UTF-8, with '%' and bytes outside printable ASCII percent-encoded."""
    return b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in text.encode())
