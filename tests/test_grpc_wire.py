"""The picker's gRPC framing (adapters/grpc.py) without sockets: an h2 client on the other side,
bytes cut anywhere, hostile bytes, and the flow control that keeps a busy call from holding the
connection."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.settings
from hypothesis import given, settings
from hypothesis import strategies as st

from selection_proto.adapters.grpc import (
    STREAM_WINDOW,
    CallEnded,
    CallReset,
    CallStarted,
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
