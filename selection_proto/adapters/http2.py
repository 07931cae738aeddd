"""HTTP/2 for one server connection, Sans-IO (RFC 9113): bytes in, a few events out; frames back
to bytes. It owns the frames, the streams' states, flow control and SETTINGS; header blocks are
decoded by `hpack` and our own few encoded here. Only what a gRPC server needs: no server push,
no priorities (read and ignored), no CONNECT. h2 did this before; its per-frame objects and checks
cost more than the rest of a picker call (docs/PERFORMANCE.md), and h2 stays the client the tests
check this against.

Errors: a connection error raises `ProtocolError` from `receive_data` (the caller sends
`close_connection(error.code)`); a stream error resets that stream and the connection goes on.
Frames that arrive for a stream already closed are dropped (a reset may cross them on the wire).
The connection's window is given back as bytes arrive, a quarter of it at a time: it never holds a
stream back; each stream's is given back by the caller (`increment_flow_control_window`) as its
messages are consumed."""

from __future__ import annotations

import re
import struct
from enum import IntEnum
from typing import Final, NamedTuple

from hpack import Decoder, HPACKError
from hpack.table import HeaderTable

__all__ = ["DataReceived", "ErrorCode", "H2Server", "ProtocolError", "RequestReceived", "StreamEnded", "StreamGone",
           "StreamReset", "Terminated", "WindowUpdated"]

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_WINDOW: Final = (1 << 31) - 1
DEFAULT_WINDOW: Final = 65_535
MAX_FRAME: Final = 16_384  # what we accept (the default: never raised by our SETTINGS)
MAX_HEADER_BLOCK: Final = 1 << 16  # the raw bytes of one header block, CONTINUATIONs included
MAX_CONTINUATIONS: Final = 64  # CONTINUATION frames in one block (empty ones would cost nothing else)

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

_FRAME_HEADER: Final = struct.Struct(">BHBBL")  # length (24 bits as 8 + 16), type, flags, stream id
_BAD_NAME: Final = re.compile(rb"[^a-z0-9!#$%&'*+\-.^_`|~]")  # RFC 9110 token, lower case
_BAD_VALUE: Final = re.compile(rb"[\x00\r\n]|^[ \t]|[ \t]$")
_PSEUDO: Final = frozenset((b":method", b":scheme", b":authority", b":path"))
_CONNECTION_SPECIFIC: Final = frozenset((b"connection", b"proxy-connection", b"keep-alive",
                                         b"transfer-encoding", b"upgrade"))


class ErrorCode(IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    ENHANCE_YOUR_CALM = 0xB


class ProtocolError(Exception):
    """The peer broke the protocol: the connection ends with `code`."""

    def __init__(self, code: ErrorCode, text: str) -> None:
        super().__init__(text)
        self.code = code


class RequestReceived(NamedTuple):
    stream_id: int
    headers: list[tuple[bytes, bytes]]  # checked: pseudo-headers first, names lower case


class DataReceived(NamedTuple):
    stream_id: int
    data: bytes
    flow_controlled_length: int  # padding included: what the stream's window is owed


class StreamEnded(NamedTuple):
    stream_id: int


class StreamReset(NamedTuple):
    """The peer reset the stream."""

    stream_id: int


class WindowUpdated(NamedTuple):
    """The peer made room on the stream (0: on the connection, or on every stream by SETTINGS)."""

    stream_id: int


class Terminated(NamedTuple):
    """The peer sent GOAWAY."""

    code: int


Event = RequestReceived | DataReceived | StreamEnded | StreamReset | WindowUpdated | Terminated


class _Stream:
    __slots__ = ("send_window", "recv_window", "remote_closed", "local_closed")

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window
        self.recv_window = recv_window
        self.remote_closed = False
        self.local_closed = False


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """HPACK's integer (RFC 7541 §5.1), its first byte or-ed with `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A field as a literal without indexing (RFC 7541 §6.2.2), never Huffman-coded: our encoder
    keeps no dynamic table, so the peer's decoder state never depends on ours."""
    index = _STATIC_NAMES.get(name)
    head = _integer(index, 4, 0x00) if index else b"\x00" + _integer(len(name), 7, 0) + name
    return head + _integer(len(value), 7, 0) + value


_STATIC_NAMES: Final = {b":status": 8, b"content-type": 31}
DECODED_BLOCKS: Final = 32  # header blocks remembered per connection, decoded and checked


class _CountedTable(HeaderTable):
    """hpack's dynamic table, counting its insertions: with its length and size limit, a state
    that identifies its contents, so that a header block decoded in that state need not be again."""

    def __init__(self) -> None:
        super().__init__()
        self.insertions = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.insertions += 1
        super().add(name, value)

    def state(self) -> tuple[int, int, int]:
        return self.insertions, len(self.dynamic_entries), self.maxsize


class H2Server:
    """One connection, server side. Call `receive_data` with what arrives and write
    `data_to_send()` after it and after each send."""

    def __init__(self, *, max_concurrent_streams: int, stream_window: int, connection_window: int) -> None:
        self.max_concurrent_streams = max_concurrent_streams
        self.stream_window = stream_window
        self.streams: dict[int, _Stream] = {}
        self.preface_received = False  # the peer's preface and first SETTINGS have arrived
        self._buffer = bytearray()
        self._out = bytearray()
        self._decoder = Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_BLOCK
        self._table = self._decoder.header_table = _CountedTable()
        # A peer sends the same block for each call (Envoy: the same literals, never indexed):
        # block -> (table state, its fields, well formed as a request).
        self._decoded: dict[bytes, tuple[tuple[int, int, int], list[tuple[bytes, bytes]], bool]] = {}
        self._highest = 0  # the highest stream id the peer opened
        self._goaway_last: int | None = None  # set once we sent GOAWAY
        self._continuing: tuple[int, int, bytearray] | None = None  # (stream, flags, block) of a HEADERS
        self._continuations = 0  # CONTINUATION frames of that block so far
        self._remote_window = DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_outbound_frame_size = MAX_FRAME  # the peer's SETTINGS_MAX_FRAME_SIZE
        self._send_window = DEFAULT_WINDOW  # the connection's, for what we send
        self._recv_window = DEFAULT_WINDOW  # the connection's, for what the peer sends
        self._connection_window = connection_window
        self._owed = 0  # bytes received on the connection and not yet given back
        self._table_update = True  # our next header block first says "dynamic table size 0"
        self._frame(SETTINGS, 0, 0, struct.pack(">HLHL", 0x3, max_concurrent_streams, 0x4, stream_window))
        self.increment_flow_control_window(connection_window - DEFAULT_WINDOW)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    # -- what the peer sent ---------------------------------------------------------------------

    def receive_data(self, data: bytes) -> list[Event]:
        """The events in `data`; raises ProtocolError for a connection error."""
        buffer = self._buffer
        buffer += data
        events: list[Event] = []
        position = 0
        if not self.preface_received:
            if buffer[:len(PREFACE)] != PREFACE[:len(buffer)]:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            if len(buffer) < len(PREFACE) + 9:
                return events
            if buffer[len(PREFACE) + 3] != SETTINGS:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "the preface's first frame is not SETTINGS")
            position = len(PREFACE)
            self.preface_received = True
        unpack = _FRAME_HEADER.unpack_from
        available = len(buffer)
        while available - position >= 9:
            high, low, kind, flags, stream_id = unpack(buffer, position)
            length = high << 16 | low
            if length > MAX_FRAME:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            end = position + 9 + length
            if end > available:
                break
            payload = bytes(buffer[position + 9:end])
            position = end
            stream_id &= 0x7FFFFFFF
            if self._continuing is not None and kind != CONTINUATION:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a frame inside a header block")
            if kind == DATA:
                self._data(flags, stream_id, payload, events)
            elif kind == HEADERS:
                self._headers(flags, stream_id, payload, events)
            elif kind == CONTINUATION:
                self._continuation(flags, stream_id, payload, events)
            elif kind == WINDOW_UPDATE:
                self._window_update(stream_id, payload, events)
            elif kind == SETTINGS:
                self._settings(flags, stream_id, payload, events)
            elif kind == PING:
                if len(payload) != 8 or stream_id:
                    raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR if stream_id == 0 else ErrorCode.PROTOCOL_ERROR,
                                        "a malformed PING")
                if not flags & ACK:
                    self._frame(PING, ACK, 0, payload)
            elif kind == RST_STREAM:
                self._rst_stream(stream_id, payload, events)
            elif kind == PRIORITY:
                if stream_id == 0:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
                if len(payload) != 5:
                    self._stream_error(stream_id, ErrorCode.FRAME_SIZE_ERROR, events)
            elif kind == GOAWAY:
                if stream_id or len(payload) < 8:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a malformed GOAWAY")
                events.append(Terminated(int.from_bytes(payload[4:8], "big")))
            elif kind == PUSH_PROMISE:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a client cannot push")
            # Any other type is an extension this side does not know: ignored (RFC 9113 §4.1).
        del buffer[:position]
        if self._owed >= self._connection_window // 4:
            self.increment_flow_control_window(self._owed)
            self._owed = 0
        return events

    def _idle(self, stream_id: int) -> bool:
        """Never opened: a client opens odd ids only, each above the last."""
        return stream_id > self._highest or stream_id % 2 == 0

    def _data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0 or self._idle(stream_id):
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
        length = len(payload)
        self._recv_window -= length
        if self._recv_window < 0:
            raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "DATA over the connection's window")
        self._owed += length
        data = _unpadded(flags, payload)
        stream = self.streams.get(stream_id)
        if stream is None:  # closed: dropped
            return
        if stream.remote_closed:
            self._stream_error(stream_id, ErrorCode.STREAM_CLOSED, events)
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            self._stream_error(stream_id, ErrorCode.FLOW_CONTROL_ERROR, events)
            return
        events.append(DataReceived(stream_id, data, length))
        if flags & END_STREAM:
            self._remote_end(stream_id, stream, events)

    def _headers(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        block = _unpadded(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a HEADERS frame too short for its priority")
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, flags, block, events)
        else:
            self._continuing, self._continuations = (stream_id, flags, bytearray(block)), 0

    def _continuation(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        continuing = self._continuing
        if continuing is None or continuing[0] != stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION outside a header block")
        block = continuing[2]
        block += payload
        self._continuations += 1
        if len(block) > MAX_HEADER_BLOCK or self._continuations > MAX_CONTINUATIONS:
            raise ProtocolError(ErrorCode.ENHANCE_YOUR_CALM, "a header block over 64 KiB or 64 CONTINUATIONs")
        if flags & END_HEADERS:
            self._continuing = None
            self._header_block(stream_id, continuing[1], bytes(block), events)

    def _header_block(self, stream_id: int, flags: int, block: bytes, events: list[Event]) -> None:
        fields, well_formed = self._decode(block)
        end = bool(flags & END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            if stream.remote_closed or not end or any(n.startswith(b":") for n, _ in fields):
                self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, events)
            else:
                self._remote_end(stream_id, stream, events)
            return
        if not self._idle(stream_id):
            return  # a stream already closed: dropped
        self._highest = stream_id
        if (self._goaway_last is not None and stream_id > self._goaway_last) or \
                len(self.streams) >= self.max_concurrent_streams:
            self._reset(stream_id, ErrorCode.REFUSED_STREAM)
            return
        if not well_formed:
            self._reset(stream_id, ErrorCode.PROTOCOL_ERROR)
            return
        stream = self.streams[stream_id] = _Stream(self._remote_window, self.stream_window)
        events.append(RequestReceived(stream_id, list(fields)))
        if end:
            self._remote_end(stream_id, stream, events)

    def _decode(self, block: bytes) -> tuple[list[tuple[bytes, bytes]], bool]:
        """The block's fields, and whether they make a well-formed request. Decoded whatever
        becomes of the stream: the decoder's table must follow the peer's."""
        state = self._table.state()
        known = self._decoded.get(block)
        if known is not None and known[0] == state:
            return known[1], known[2]
        try:
            headers = self._decoder.decode(block, raw=True)
        except (HPACKError, IndexError, ValueError) as exc:
            raise ProtocolError(ErrorCode.COMPRESSION_ERROR, f"a header block that does not decode: {exc}") from None
        fields = [(bytes(n), bytes(v)) for n, v in headers]
        well_formed = _well_formed(fields)
        if self._table.state() == state:  # the block did not change the table: it will decode the same
            if len(self._decoded) >= DECODED_BLOCKS:
                self._decoded.clear()
            self._decoded[block] = (state, fields, well_formed)
        return fields, well_formed

    def _remote_end(self, stream_id: int, stream: _Stream, events: list[Event]) -> None:
        stream.remote_closed = True
        events.append(StreamEnded(stream_id))
        if stream.local_closed:
            del self.streams[stream_id]

    def _window_update(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
            events.append(WindowUpdated(0))
            return
        if self._idle(stream_id):
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {stream_id}")
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if increment == 0:
            self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, events)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._stream_error(stream_id, ErrorCode.FLOW_CONTROL_ERROR, events)
            return
        events.append(WindowUpdated(stream_id))

    def _settings(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id:
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        widened = False
        for offset in range(0, len(payload), 6):
            code, value = struct.unpack_from(">HL", payload, offset)
            if code == 0x1:  # HEADER_TABLE_SIZE: our encoder keeps no table, but says so again
                self._table_update = True
            elif code == 0x2 and value > 1:
                raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "ENABLE_PUSH not 0 or 1")
            elif code == 0x4:
                if value > MAX_WINDOW:
                    raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE over 2^31-1")
                delta, self._remote_window = value - self._remote_window, value
                for stream in self.streams.values():  # RFC 9113 §6.9.2: every stream's window moves
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise ProtocolError(ErrorCode.FLOW_CONTROL_ERROR, "a stream's window over 2^31-1")
                widened = widened or delta > 0
            elif code == 0x5:
                if not MAX_FRAME <= value <= (1 << 24) - 1:
                    raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.max_outbound_frame_size = value
        self._frame(SETTINGS, ACK, 0, b"")
        if widened and self.streams:
            events.append(WindowUpdated(0))

    def _rst_stream(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise ProtocolError(ErrorCode.FRAME_SIZE_ERROR, "a RST_STREAM not of 4 bytes")
        if stream_id == 0 or self._idle(stream_id):
            raise ProtocolError(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        if self.streams.pop(stream_id, None) is not None:
            events.append(StreamReset(stream_id))

    def _stream_error(self, stream_id: int, code: ErrorCode, events: list[Event]) -> None:
        """The stream broke a rule: reset it; its handler hears of it as a reset by the peer."""
        if stream_id in self.streams:
            events.append(StreamReset(stream_id))
        self._reset(stream_id, code)

    # -- what this side sends -------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        length = len(payload)
        self._out += _FRAME_HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)
        self._out += payload

    def send_headers(self, stream_id: int, fields: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...],
                     end_stream: bool = False) -> None:
        """Our own fields (constants and checked texts: not validated again)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed:
            raise StreamGone(stream_id)
        block = b"".join(b"\x88" if f == (b":status", b"200") else _literal(*f) for f in fields)
        if self._table_update:
            block, self._table_update = b"\x20" + block, False
        size = self.max_outbound_frame_size
        flags = END_STREAM if end_stream else 0
        first, rest = block[:size], block[size:]
        self._frame(HEADERS, flags | (0 if rest else END_HEADERS), stream_id, first)
        while rest:
            piece, rest = rest[:size], rest[size:]
            self._frame(CONTINUATION, 0 if rest else END_HEADERS, stream_id, piece)
        if end_stream:
            self._local_end(stream_id, stream)

    def send_data(self, stream_id: int, data: bytes) -> None:
        """Within `local_flow_control_window` and `max_outbound_frame_size`."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed:
            raise StreamGone(stream_id)
        length = len(data)
        if length > min(self._send_window, stream.send_window, self.max_outbound_frame_size):
            raise ValueError("DATA over the window or the frame size")
        self._send_window -= length
        stream.send_window -= length
        self._frame(DATA, 0, stream_id, data)

    def _local_end(self, stream_id: int, stream: _Stream) -> None:
        stream.local_closed = True
        if stream.remote_closed:
            del self.streams[stream_id]

    def local_flow_control_window(self, stream_id: int) -> int:
        """What may be sent on the stream now."""
        stream = self.streams.get(stream_id)
        if stream is None:
            raise StreamGone(stream_id)
        return min(self._send_window, stream.send_window)

    def increment_flow_control_window(self, increment: int, stream_id: int = 0) -> None:
        """Give the peer room: on the connection (0), or on an open stream (else nothing)."""
        if increment <= 0:
            return
        if stream_id:
            stream = self.streams.get(stream_id)
            if stream is None or stream.remote_closed:
                return  # it sends nothing more
            stream.recv_window += increment
        else:
            self._recv_window += increment
        self._frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))

    def reset_stream(self, stream_id: int, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        if stream_id in self.streams:
            self._reset(stream_id, code)

    def _reset(self, stream_id: int, code: ErrorCode) -> None:
        self.streams.pop(stream_id, None)
        self._frame(RST_STREAM, 0, stream_id, int(code).to_bytes(4, "big"))

    def close_connection(self, code: ErrorCode = ErrorCode.NO_ERROR) -> None:
        """GOAWAY: the streams opened so far go on to their end; later ones are refused."""
        self._goaway_last = self._highest
        self._frame(GOAWAY, 0, 0, struct.pack(">LL", self._highest, int(code)))


class StreamGone(Exception):
    """The stream is closed (reset by the peer, or ended) and takes nothing more."""


def _unpadded(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(ErrorCode.PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1:len(payload) - payload[0]]


def _well_formed(fields: list[tuple[bytes, bytes]]) -> bool:
    """RFC 9113 §8.2-8.3 for a request: pseudo-headers first, each once and known, the three a
    request needs; lower-case names that are tokens; no line breaks or NUL in values, no
    surrounding spaces; no connection-specific fields; `te` only "trailers"."""
    seen: set[bytes] = set()
    regular = False
    for name, value in fields:
        if name.startswith(b":"):
            if regular or name not in _PSEUDO or name in seen:
                return False
            seen.add(name)
        else:
            regular = True
            if not name or _BAD_NAME.search(name) or name in _CONNECTION_SPECIFIC or (
                    name == b"te" and value != b"trailers"):
                return False
        if _BAD_VALUE.search(value):
            return False
    return {b":method", b":scheme", b":path"} <= seen and dict(fields).get(b":path") != b""
