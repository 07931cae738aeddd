"""The picker's gRPC framing (adapters/grpc.py) without sockets: an h2 client on the other side,
bytes cut anywhere, hostile bytes, and the flow control that keeps a busy call from holding the
connection."""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from selection_proto.adapters.grpc import (
    STREAM_WINDOW,
    CallEnded,
    CallReset,
    CallStarted,
    Event,
    GrpcServer,
    Message,
    WindowOpened,
)

PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def client() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    return conn


def start_call(conn: h2.connection.H2Connection, metadata: tuple[tuple[bytes, bytes], ...] = ()) -> int:
    stream_id = conn.get_next_available_stream_id()
    conn.send_headers(stream_id, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH.encode()),
                                  (b":authority", b"picker"), (b"content-type", b"application/grpc"),
                                  (b"te", b"trailers"), *metadata])
    return stream_id


def framed(payload: bytes) -> bytes:
    return len(payload).to_bytes(5, "big") + payload


@settings(max_examples=60, deadline=None)
@given(payloads=st.lists(st.binary(max_size=40_000), min_size=1, max_size=5), cuts=st.lists(st.integers(1, 5_000)))
def test_messages_arrive_whole_however_the_bytes_are_cut(payloads: list[bytes], cuts: list[int]) -> None:
    peer, server = client(), GrpcServer(max_message_bytes=1 << 20, max_calls=8)
    peer.receive_data(server.data_to_send())
    stream_id = start_call(peer, ((b"authorization", b"Bearer t"),))
    data = b"".join(framed(p) for p in payloads)
    for start in range(0, len(data), 16_384):
        peer.send_data(stream_id, data[start:start + 16_384])
    peer.end_stream(stream_id)
    wire = peer.data_to_send()
    events = []
    position = 0
    for cut in [*cuts, len(wire)]:
        events += server.receive(wire[position:position + cut])
        position += cut
        if position >= len(wire):
            break
    assert events[0] == CallStarted(stream_id, PATH, {
        "content-type": b"application/grpc", "te": b"trailers", "authorization": b"Bearer t"})
    assert [e.payload for e in events if isinstance(e, Message)] == payloads
    assert events[-1] == CallEnded(stream_id)


@settings(max_examples=200, deadline=None)
@given(garbage=st.binary(max_size=2_000), after_preface=st.booleans())
def test_any_bytes_give_events_or_a_closed_connection_never_an_exception(garbage: bytes, after_preface: bool) -> None:
    server = GrpcServer(max_message_bytes=1 << 20, max_calls=8)
    if after_preface:
        peer = client()
        start_call(peer)
        server.receive(peer.data_to_send())
    events = server.receive(garbage)
    assert all(isinstance(e, (CallStarted, Message, CallEnded, CallReset, WindowOpened)) for e in events)
    server.data_to_send()  # whatever it answers (a GOAWAY, say) can be written


def pump(peer: h2.connection.H2Connection, server: GrpcServer) -> list[object]:
    """Move bytes both ways until neither side has anything to say; the server's events."""
    events: list[object] = []
    while True:
        to_server, to_peer = peer.data_to_send(), server.data_to_send()
        if not to_server and not to_peer:
            return events
        if to_server:
            events += server.receive(to_server)
        if to_peer:
            peer.receive_data(to_peer)


def send_as_window_allows(peer: h2.connection.H2Connection, stream_id: int, data: bytes) -> bytes:
    """What the window lets through now; the rest is returned."""
    room = min(peer.local_flow_control_window(stream_id), len(data))
    for start in range(0, room, 16_384):
        peer.send_data(stream_id, data[start:min(room, start + 16_384)])
    return data[room:]


def test_a_message_larger_than_any_window_gets_through() -> None:
    peer, server = client(), GrpcServer(max_message_bytes=8 << 20, max_calls=8)
    stream_id = start_call(peer)
    rest = framed(b"x" * (3 * STREAM_WINDOW))
    messages: list[object] = []
    for _ in range(100):
        messages += [e for e in pump(peer, server) if isinstance(e, Message)]
        if not rest:
            break
        rest = send_as_window_allows(peer, stream_id, rest)
    messages += [e for e in pump(peer, server) if isinstance(e, Message)]
    assert len(messages) == 1 and len(messages[0].payload) == 3 * STREAM_WINDOW  # type: ignore[attr-defined]


def test_whole_messages_not_read_hold_their_call_back_not_the_connection() -> None:
    """A call whose handler reads nothing stops its peer after about one window; another call on
    the same connection still flows; reading the messages opens the window again."""
    peer, server = client(), GrpcServer(max_message_bytes=8 << 20, max_calls=8)
    busy, other = start_call(peer), start_call(peer)
    pump(peer, server)
    unread: list[Message] = []
    rest = b"".join(framed(b"y" * 100_000) for _ in range(30))  # 3 MB, three windows
    for _ in range(50):
        rest = send_as_window_allows(peer, busy, rest)
        unread += [e for e in pump(peer, server) if isinstance(e, Message)]
    assert rest, "the peer was never held back"
    assert sum(len(m.payload) + 5 for m in unread) <= STREAM_WINDOW + 100_005
    send_as_window_allows(peer, other, framed(b"z" * 200_000))
    assert [len(e.payload) for e in pump(peer, server) if isinstance(e, Message)] == [200_000]
    for message in unread:
        server.consumed(message)
    pump(peer, server)
    assert peer.local_flow_control_window(busy) > 0


def test_replies_wait_for_the_peers_window_and_trailers_follow_them() -> None:
    peer, server = client(), GrpcServer(max_message_bytes=8 << 20, max_calls=8)
    stream_id = start_call(peer)
    pump(peer, server)
    server.send_message(stream_id, b"r" * 200_000)  # over the peer's default 65,535-byte window
    server.finish(stream_id, 0)
    assert server.pending(stream_id) > 0
    received, ended = 0, False
    for _ in range(20):
        for event in peer.receive_data(server.data_to_send()):
            if isinstance(event, h2.events.DataReceived):
                received += len(event.data)
                peer.acknowledge_received_data(event.flow_controlled_length, stream_id)
            ended = ended or isinstance(event, h2.events.StreamEnded)
        server.receive(peer.data_to_send())
        if ended:
            break
    assert ended and received == 200_005 and server.pending(stream_id) == 0


def test_replies_held_by_the_window_go_when_the_peer_widens_it_by_settings_alone() -> None:
    """RFC 9113 §6.9.2: a SETTINGS_INITIAL_WINDOW_SIZE raise widens every stream's window, no
    WINDOW_UPDATE needed. The held reply goes then, and the transport is told (`WindowOpened(0)`)
    so that a call held back by its replies goes on; an unrelated frame tells it nothing."""
    peer, server = client(), GrpcServer(max_message_bytes=8 << 20, max_calls=8)
    stream_id = start_call(peer)
    peer.increment_flow_control_window(1 << 20)  # the connection's window: not what holds it
    pump(peer, server)
    server.send_message(stream_id, b"r" * 100_000)  # over the stream's default 65,535-byte window
    assert server.pending(stream_id) > 0
    peer.receive_data(server.data_to_send())  # (the window's worth, not acknowledged)
    peer.ping(b"12345678")
    assert [e for e in server.receive(peer.data_to_send()) if isinstance(e, WindowOpened)] == []
    peer.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    events = server.receive(peer.data_to_send())
    assert WindowOpened(0) in events and server.pending(stream_id) == 0


# -- the HTTP/2 layer under it (adapters/http2.py), each rule as a peer would break it ------------

def opened() -> tuple[h2.connection.H2Connection, GrpcServer]:
    peer, server = client(), GrpcServer(max_message_bytes=1 << 20, max_calls=2)
    pump(peer, server)
    return peer, server


def raw_frames(server: GrpcServer, *frames: Frame, raw: bytes = b"") -> tuple[list[Event], list[Any]]:
    """Send hand-made frames (or bytes); the server's events and the frames it answers with."""
    events = server.receive(b"".join(f.serialize() for f in frames) + raw)
    data = server.data_to_send()
    answered: list[Any] = []  # hyperframe's frames, each of its own type
    while data:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9:9 + length]))
        answered.append(frame)
        data = data[9 + length:]
    return events, answered


def goaway_code(answered: list[Any]) -> int | None:
    return next((f.error_code for f in answered if isinstance(f, GoAwayFrame)), None)


def test_pings_are_answered_and_a_malformed_one_ends_the_connection() -> None:
    _, server = opened()
    _, answered = raw_frames(server, PingFrame(0, b"abcdefgh"))
    assert [(type(f), f.opaque_data, f.flags) for f in answered] == [(PingFrame, b"abcdefgh", {"ACK"})]
    ping = PingFrame(0, b"abcdefgh").serialize()
    events, answered = raw_frames(server, raw=ping[:2] + b"\x04" + ping[3:13])  # 4 bytes, not 8
    assert events == [] and server.closed and goaway_code(answered) == 6  # FRAME_SIZE_ERROR


def test_a_malformed_request_resets_its_stream_and_the_connection_goes_on() -> None:
    """Upper-case or connection-specific names, `te` other than trailers, a pseudo-header after a
    field, a missing :path: the stream is reset (PROTOCOL_ERROR), no call starts; a good one
    after it does."""
    bad_lists = [
        [(b"Content-Type", b"application/grpc")],
        [(b"connection", b"keep-alive")],
        [(b"te", b"gzip")],
        [(b"x-a", b"1"), (b":authority", b"late")],
        [(b"x-a", b" padded ")],
    ]
    peer, server = opened()
    base = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH.encode()), (b":authority", b"p")]
    encoder = hpack.Encoder()
    for n, extra in enumerate(bad_lists):
        stream_id = 2 * n + 1
        block = encoder.encode([*base, *extra] if extra[0][0] != b"x-a" or n != 3 else
                               [base[0], base[1], base[2], *extra])
        events, answered = raw_frames(server, HeadersFrame(stream_id, block, flags={"END_HEADERS"}))
        assert events == [] and [(type(f), f.error_code) for f in answered] == [(RstStreamFrame, 1)], extra
    stream_id = 2 * len(bad_lists) + 1
    block = encoder.encode([*base, (b"content-type", b"application/grpc")])
    events, _ = raw_frames(server, HeadersFrame(stream_id, block, flags={"END_HEADERS"}))
    assert events == [CallStarted(stream_id, PATH, {"content-type": b"application/grpc"})] and not server.closed


def test_streams_past_the_cap_are_refused_not_the_connection() -> None:
    _, server = opened()  # max_calls=2; a peer that ignores the SETTINGS saying so
    encoder = hpack.Encoder()
    block = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH.encode()),
             (b"content-type", b"application/grpc")]
    events, answered = raw_frames(server, *(HeadersFrame(i, encoder.encode(block), flags={"END_HEADERS"})
                                            for i in (1, 3, 5)))
    assert [e.stream_id for e in events if isinstance(e, CallStarted)] == [1, 3]
    assert [(type(f), f.stream_id, f.error_code) for f in answered] == [(RstStreamFrame, 5, 7)]  # REFUSED_STREAM
    assert not server.closed


def test_header_blocks_in_continuations_padding_and_priority_are_read() -> None:
    """A block larger than a frame arrives in CONTINUATIONs; padded and prioritised frames too."""
    peer, server = opened()
    big = b"v" * 40_000  # over two 16 KiB frames: h2 splits it
    stream_id = start_call(peer, ((b"x-big", big),))
    peer.send_data(stream_id, framed(b"hello"), pad_length=17, end_stream=True)
    events = server.receive(peer.data_to_send())
    assert events[0] == CallStarted(stream_id, PATH, {"content-type": b"application/grpc", "te": b"trailers",
                                                      "x-big": big})
    assert events[1:] == [Message(stream_id, b"hello"), CallEnded(stream_id)]
    encoder = hpack.Encoder()
    block = encoder.encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH.encode()),
                            (b"content-type", b"application/grpc")])
    frame = HeadersFrame(stream_id + 2, block, flags={"END_HEADERS", "PRIORITY", "PADDED"}, pad_length=3,
                         depends_on=0, stream_weight=15)
    _, fresh = opened()
    assert fresh.receive(frame.serialize())[0] == CallStarted(stream_id + 2, PATH, {"content-type": b"application/grpc"})


def test_header_floods_and_broken_frames_end_the_connection() -> None:
    """A header block growing past 64 KiB, or kept open by empty CONTINUATIONs, a frame inside a
    header block, DATA on a stream never opened: GOAWAY with the right code, nothing raised."""
    block = hpack.Encoder().encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH.encode())])
    for frames, code in (
        ([HeadersFrame(1, block[:1])] + [ContinuationFrame(1, b"\x00" * 16_000) for _ in range(5)], 11),
        ([HeadersFrame(1, block[:1])] + [ContinuationFrame(1, b"") for _ in range(100)], 11),
        ([HeadersFrame(1, block[:1]), PingFrame(0, b"12345678")], 1),
        ([DataFrame(5, b"x")], 1),
    ):
        _, server = opened()
        _, answered = raw_frames(server, *frames)
        assert server.closed and goaway_code(answered) == code, (frames[-1], answered)


def test_a_call_overrunning_its_window_or_reset_at_once_is_dropped_not_the_connection() -> None:
    """DATA past a stream's window resets that stream (FLOW_CONTROL_ERROR); a call started and
    broken in the same bytes, even one answered 415 at once, is reset without a raise."""
    for content_type in (b"application/grpc", b"text/plain"):
        _, server = opened()
        block = hpack.Encoder().encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH.encode()),
                                        (b"content-type", content_type)])
        events, answered = raw_frames(server, HeadersFrame(1, block, flags={"END_HEADERS"}),
                                      *(DataFrame(1, b"\x00\x00\x00\x00\x00" * 3_000) for _ in range(80)))
        assert (RstStreamFrame, 3) in [(type(f), getattr(f, "error_code", None)) for f in answered]
        if content_type == b"application/grpc":
            assert events[0] == CallStarted(1, PATH, {"content-type": content_type}) and events[-1] == CallReset(1)
            server.send_message(1, b"late")  # the transport answering what it was told first
        assert not server.closed and server.calls == 0


def test_our_headers_follow_the_peers_table_size_and_frame_size() -> None:
    """After the peer shrinks its HPACK table, our next block says so first (RFC 7541 §4.2); a
    raised MAX_FRAME_SIZE lets replies go in larger frames. h2, as the client, checks both."""
    peer, server = opened()
    peer.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0,
                          h2.settings.SettingCodes.MAX_FRAME_SIZE: 65_536})
    peer.increment_flow_control_window(1 << 20)
    stream_id = start_call(peer)
    pump(peer, server)
    server.send_message(stream_id, b"r" * 40_000)
    server.finish(stream_id, 3, "bad ünïcode % text")
    got = peer.receive_data(server.data_to_send())
    data = [e for e in got if isinstance(e, h2.events.DataReceived)]
    trailers = next(e for e in got if isinstance(e, h2.events.TrailersReceived))
    assert len(data) == 1 and len(data[0].data) == 40_005
    assert dict(trailers.headers)[b"grpc-message"] == b"bad %C3%BCn%C3%AFcode %25 text"


def test_a_repeated_header_block_reads_what_the_table_holds_now() -> None:
    """The same bytes decode to other fields once the peer's HPACK table changed: a block that
    refers to a table entry is not answered from what it decoded to before (http2.py keeps
    decoded blocks per table state)."""
    peer, server = client(), GrpcServer(max_message_bytes=1 << 20, max_calls=8)
    pump(peer, server)
    path = PATH.encode()
    pseudo = b"\x83\x86\x04" + bytes([len(path)]) + path + b"\x0f\x10\x10application/grpc"

    def inserted(value: bytes) -> bytes:  # x-a: value, with incremental indexing (entry 62)
        return pseudo + b"\x40\x03x-a" + bytes([len(value)]) + value

    refers = pseudo + b"\xbe"  # x-a as entry 62 holds it
    seen = []
    for stream_id, block in zip(range(1, 20, 2), [inserted(b"1"), refers, refers, inserted(b"2"), refers],
                                strict=False):
        events, _ = raw_frames(server, HeadersFrame(stream_id, block, flags={"END_HEADERS"}))
        seen.append(events[0].metadata["x-a"])  # type: ignore[union-attr]
    assert seen == [b"1", b"1", b"1", b"2", b"2"]
