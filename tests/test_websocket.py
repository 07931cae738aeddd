"""`GET /kv_events` over a real socket with the `websockets` client against the real server; and
`adapters.ws.PushSession` fed directly, for how a read is handled a turn at a time."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_http import Server, read_response, request
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from selection_proto import SelectionService, Settings, WorkerRequest
from selection_proto.adapters import ws as ws_adapter
from selection_proto.adapters.ws import (
    LargeMessage,
    PushSession,
    StreamSession,
    SubscriptionSession,
    server_handshake,
)
from selection_proto.core.base.errors import SelectionError
from selection_proto.core.base.outputs import SubscribeKvEvents
from selection_proto.core.intake.streams import DecodedMessage, decode_or_error

B1, B2 = 14643705804678351452, 16777012769546811212


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server("--ws-ping-interval-secs", "1")
    with s.connect() as sock:
        buf = bytearray()
        for wid in (1, 2):
            sock.sendall(request("POST", "/workers", {"worker_id": wid, "endpoint": f"http://w{wid}",
                                                      "block_size": 4}))
            assert read_response(sock, buf)[0] == 201
    yield s
    assert s.stop() == 0


def http(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    with server.connect() as sock:
        sock.sendall(request(method, path, body))
        status, _, payload = read_response(sock, bytearray())
        return status, json.loads(payload)


def device_blocks(server: Server) -> dict[int, int]:
    _, answer = http(server, "POST", "/overlap_scores", {"token_ids": list(range(1, 13))})
    return {row["worker_id"]: row["device_blocks"] for row in answer["workers"]}


def engine_batch(hashes: list[int], tokens: list[int], parent: int | None = None) -> bytes:
    return msgpack.packb([0.0, [["BlockStored", hashes, parent, tokens, 4, None, "GPU", None, None]], 0])


def url(server: Server, query: str) -> str:
    return f"ws://127.0.0.1:{server.port}/kv_events?{query}"


def test_text_and_binary_pushes_reach_the_index(server: Server) -> None:
    with connect(url(server, "worker_id=1&ack=true")) as ws:
        ws.send(json.dumps([{"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": 101, "tokens_hash": B1}]}}}]))
        assert json.loads(ws.recv(timeout=5)) == {"ack": 1}
        ws.send(engine_batch([102], [5, 6, 7, 8], parent=101))
        assert json.loads(ws.recv(timeout=5)) == {"ack": 2}
        assert device_blocks(server) == {1: 2}
        ws.ping().wait(timeout=5)


def test_seq_framing_gaps_and_acks(server: Server) -> None:
    with connect(url(server, "worker_id=2&framing=seq&ack=true")) as ws:
        ws.send((5).to_bytes(8, "big") + engine_batch([201], [1, 2, 3, 4]))
        ws.recv(timeout=5)
        ws.send((9).to_bytes(8, "big") + engine_batch([202], [5, 6, 7, 8], parent=201))
        ws.recv(timeout=5)
    _, answer = http(server, "POST", "/overlap_scores", {"token_ids": list(range(1, 13))})
    fresh = {f["worker_id"]: f for f in answer["freshness"]}[2]
    assert (fresh["event_gaps"], fresh["missing_events"], fresh["stale"]) == (1, 3, True)


def test_resume_says_where_the_index_stands(server: Server) -> None:
    """`resume=true`: the first message is the rank's last applied seq (null before any), for a
    sender that resends from there (the relay's `--replay`)."""
    with connect(url(server, "worker_id=2&framing=seq&ack=true&resume=true")) as ws:
        assert json.loads(ws.recv(timeout=5)) == {"resume": None}
        ws.send((7).to_bytes(8, "big") + engine_batch([701], [1, 2, 3, 4]))
        assert json.loads(ws.recv(timeout=5)) == {"ack": 1}
    with connect(url(server, "worker_id=2&framing=seq&resume=true")) as ws:
        assert json.loads(ws.recv(timeout=5)) == {"resume": 7}


@pytest.mark.parametrize(("query", "message", "code", "reason"), [
    ("worker_id=1&resume=maybe", None, 1008, "Failed to deserialize query string: resume: invalid boolean"),
    ("worker_id=9", None, 1008, "worker 9 not found"),
    ("", None, 1008, "worker_id is required"),
    ("worker_id=1&dp_rank=3", None, 1008, "dp_rank 3 is not a rank of worker 1 (ranks 0..0)"),
    ("worker_id=1", b"\xc1\xc1", 1007, "invalid engine batch: "),
    ("worker_id=1", "{not json", 1007, "invalid kv event: "),
    ("worker_id=1", json.dumps({"worker_id": 2, "event": {"event_id": 1, "data": "cleared"}}), 1008,
     "event worker_id 2 does not match stream worker_id 1"),
    ("worker_id=1&framing=seq", b"\x00\x01", 1007, "invalid engine batch: missing 8-byte seq prefix"),
    ("worker_id=1", b"\x00" * (8 * 1024 * 1024 + 1), 1009, "message exceeds 8388608 bytes"),
])
def test_refusals_close_with_code_and_reason(server: Server, query: str, message: Any, code: int,
                                             reason: str) -> None:
    with connect(url(server, query), max_size=None) as ws:
        with pytest.raises(ConnectionClosed) as info:
            if message is not None:
                ws.send(message)
            ws.recv(timeout=5)
    assert info.value.rcvd is not None
    assert info.value.rcvd.code == code and info.value.rcvd.reason.startswith(reason)
    assert http(server, "GET", "/health")[0] == 200


def test_deleting_the_worker_closes_its_stream(server: Server) -> None:
    with connect(url(server, "worker_id=2")) as ws:
        time.sleep(0.2)
        assert http(server, "DELETE", "/workers/2")[0] == 200
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=5)
    assert info.value.rcvd is not None
    assert (info.value.rcvd.code, info.value.rcvd.reason) == (1001, "worker 2 is no longer schedulable")


def test_plain_get_and_bad_handshakes(server: Server) -> None:
    assert http(server, "GET", "/kv_events") == (426, {"error": "this endpoint requires a WebSocket upgrade"})
    with server.connect() as sock:
        sock.sendall(b"GET /kv_events?worker_id=1 HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n"
                     b"connection: upgrade\r\nsec-websocket-version: 12\r\nsec-websocket-key: abc\r\n\r\n")
        status, _, body = read_response(sock, bytearray())
        assert status == 400
        assert json.loads(body) == {"error": "invalid WebSocket upgrade: Sec-WebSocket-Version must be 13"}


def test_subscribe_mode_refuses_pushes() -> None:
    sub = Server(mode="subscribe")
    try:
        with connect(f"ws://127.0.0.1:{sub.port}/kv_events?worker_id=1") as ws:
            with pytest.raises(ConnectionClosed) as info:
                ws.recv(timeout=5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008
        assert info.value.rcvd.reason == ("kv events are pushed only when kv_events=push "
                                          "(this service runs kv_events=subscribe)")
    finally:
        sub.stop()


def test_a_publisher_dying_mid_frame_loses_nothing_acknowledged(server: Server) -> None:
    with connect(url(server, "worker_id=1&ack=true")) as ws:
        ws.send(json.dumps({"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": 101, "tokens_hash": B1}]}}}))
        assert json.loads(ws.recv(timeout=5)) == {"ack": 1}
        raw = ws.socket
        # Half of a masked binary frame (FIN, opcode 2, mask bit, length 100), then the socket dies.
        raw.sendall(bytes([0x82, 0x80 | 100]) + b"\x01\x02\x03\x04" + b"\x00" * 20)
        raw.shutdown(socket.SHUT_RDWR)
    time.sleep(0.3)
    assert device_blocks(server) == {1: 1}
    _, answer = http(server, "POST", "/overlap_scores", {"token_ids": list(range(1, 13))})
    fresh = {f["worker_id"]: f for f in answer["freshness"]}[1]
    assert fresh["open_streams"] == 0


def test_a_slow_publisher_does_not_block_http(server: Server) -> None:
    with connect(url(server, "worker_id=1")) as ws:
        ws.socket.sendall(bytes([0x82, 0x80 | 100]) + b"\x01\x02\x03\x04")  # a frame that never ends
        start = time.monotonic()
        assert http(server, "GET", "/health")[0] == 200
        assert time.monotonic() - start < 2


def test_keepalive_pings_are_answered(server: Server) -> None:
    with connect(url(server, "worker_id=1"), ping_interval=None) as ws:
        time.sleep(2.5)  # the server pings after 1 s of silence; the client library answers
        ws.send(json.dumps({"event_id": 1, "data": "cleared"}))
        time.sleep(0.2)
    assert http(server, "GET", "/health")[0] == 200


def raw_upgrade(server: Server, query: str) -> tuple[socket.socket, bytes]:
    """A WebSocket opened by hand (no client library reading behind the test's back): the socket
    and the bytes that followed the 101 answer."""
    sock = server.connect()
    sock.sendall(f"GET /kv_events?{query} HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n"
                 "connection: Upgrade\r\nsec-websocket-version: 13\r\n"
                 "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock, rest


def test_protocol_violations_close_1002(server: Server) -> None:
    sock, data = raw_upgrade(server, "worker_id=1")
    with sock:
        sock.sendall(bytes([0x82, 0x03]) + b"abc")  # a client frame without a mask
        while len(data) < 4:
            data += sock.recv(4096)
    assert data[0] == 0x88  # a close frame
    code = int.from_bytes(data[2:4], "big")
    assert code == 1002 and data[4:].decode().startswith("protocol error: ")


def test_silent_peer_is_closed_1011(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET /kv_events?worker_id=1 HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n"
                     b"connection: Upgrade\r\nsec-websocket-version: 13\r\n"
                     b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        sock.settimeout(6)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096)
        assert data.startswith(b"HTTP/1.1 101")
        frames = data.partition(b"\r\n\r\n")[2]
        start = time.monotonic()
        while b"\x88" not in frames:  # ignore the server's pings; wait for its close frame
            chunk = sock.recv(4096)
            assert chunk, "closed without a close frame"
            frames += chunk
        close = frames[frames.index(b"\x88"):]
        assert int.from_bytes(close[2:4], "big") == 1011 and close[4:].startswith(b"keepalive ping timeout")
        assert 1.5 < time.monotonic() - start < 5


def _masked(opcode: int, payload: bytes) -> bytes:
    """One client frame (FIN set), masked with a zero key so the payload reads as sent."""
    n = len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, 0x80 | n])
    elif n < 65536:
        head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


def _stored(first: int, count: int) -> bytes:
    return json.dumps([{"event_id": first + i, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": first + i, "tokens_hash": first + i}]}}} for i in range(count)]).encode()


def test_large_messages_apply_in_order_between_small_ones(server: Server) -> None:
    """A message over 256 KiB is decoded off the event loop and applied in slices; messages
    before and after it are applied in arrival order, each acked once."""
    assert http(server, "POST", "/workers", {"worker_id": 1, "endpoint": "http://w1", "block_size": 4})[0] == 201
    sock, data = raw_upgrade(server, "worker_id=1&ack=true")
    with sock:
        large = _stored(2, 6000)
        assert len(large) > 256 * 1024
        sock.sendall(_masked(0x1, _stored(1, 1)) + _masked(0x1, large) + _masked(0x1, _stored(6002, 1)))
        while data.count(b"ack") < 3:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert [json.loads(m)["ack"] for m in re.findall(rb'\{"ack":\d+\}', data)] == [1, 2, 3]
    status, dump = http(server, "GET", "/dump")
    stored = [e for e in dump["events"] if e["worker_id"] == 1]
    assert sum(len(e["event"]["data"]["stored"]["blocks"]) for e in stored) == 6002
    assert http(server, "GET", "/health")[0] == 200


def test_an_invalid_large_message_closes_1007(server: Server) -> None:
    assert http(server, "POST", "/workers", {"worker_id": 1, "endpoint": "http://w1", "block_size": 4})[0] == 201
    sock, data = raw_upgrade(server, "worker_id=1")
    with sock:
        sock.sendall(_masked(0x1, b"[" + b'{"event_id": 1},' * 20000 + b"1]"))
        while len(data) < 4:
            chunk = sock.recv(65536)
            assert chunk
            data += chunk
        assert data[0] == 0x88 and int.from_bytes(data[2:4], "big") == 1007
    assert http(server, "GET", "/dump")[1]["events"] == []


def push_session(target: str, clock: Any) -> tuple[SelectionService, PushSession]:
    """A service with worker 1 and a push stream to it, its 101 taken."""
    import random

    service = SelectionService(Settings(kv_events="push"), random.Random(0))
    service.upsert_worker(WorkerRequest(worker_id=1, model_name="m", endpoint="e", block_size=4), now=0.0)
    ws = server_handshake(target, [(b"host", b"x"), (b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
                                   (b"sec-websocket-version", b"13"),
                                   (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ==")])
    assert not isinstance(ws, str), ws
    session = PushSession(service, clock, ws, target, b"")
    assert session.data_to_send().startswith(b"HTTP/1.1 101")
    return service, session


def test_a_close_right_after_a_large_message_waits_for_it() -> None:
    """A large message, a small one and a close in one read: the close is handled once the large
    message (held for the caller to decode) and the small one are applied, not before (it used to
    close the stream with both still held, unless the turn happened to end between them)."""
    service, session = push_session("/kv_events?worker_id=1&ack=true", lambda: 0.0)
    removed = json.dumps([{"event_id": 6001, "data": {"removed": {"block_hashes": [1]}}}]).encode()
    session.receive_data(_masked(0x1, _stored(1, 6000)) + _masked(0x1, removed)
                         + _masked(0x8, (1000).to_bytes(2, "big")))
    assert not session.closed and session.next_large() is not None
    session.apply_held()
    assert session.closed and session.close_code == 1000
    assert re.findall(rb'"ack":(\d+)', session.data_to_send()) == [b"1", b"2"]
    blocks = [b["block_hash"] for e in service.dump()["events"] for b in e["event"]["data"]["stored"]["blocks"]]
    assert sorted(blocks) == list(range(2, 6001))


def masked_text(payload: bytes) -> bytes:
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + b"\0\0\0\0" + payload


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.lists(st.integers(1, 300), min_size=1, max_size=20), st.integers(1, 6))
def test_a_read_is_handled_a_turn_at_a_time_and_nothing_is_lost(count: int, cuts: list[int], turn: int) -> None:
    """Messages are handled until the clock passes the turn's end, the rest on `resume`, in order:
    each turn handles at most `turn` messages (the clock here moves a tick per read of it, and
    each message reads it), and the stream ends as one fed whole."""
    ticks = iter(range(1 << 30))

    def clock() -> float:
        return float(next(ticks))

    wire = b"".join(masked_text(json.dumps({"event_id": i, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": i, "tokens_hash": i}]}}}, separators=(",", ":")).encode()) for i in range(1, count + 1))
    service, session = push_session("/kv_events?worker_id=1&ack=true", clock)
    acks: list[int] = []

    def turn_acks() -> list[int]:
        data = session.data_to_send()
        return [int(n) for n in re.findall(rb'"ack":(\d+)', data)]

    at = 0
    for cut in [*cuts, len(wire)]:
        if at >= len(wire):
            break
        session.receive_data(wire[at:at + cut], until=clock() + turn)
        at += cut
        while True:
            handled = turn_acks()
            assert len(handled) <= turn
            acks += handled
            if not session.backlog:
                break
            session.resume(until=clock() + turn)
    assert acks == list(range(1, count + 1))
    assert not session.closed
    whole_service, whole = push_session("/kv_events?worker_id=1&ack=true", clock)
    whole.receive_data(wire)
    assert not whole.backlog
    assert whole.data_to_send().count(b'"ack":') == count
    assert service.handle("GET", "/dump", "", [], b"", now=1.0) == whole_service.handle("GET", "/dump", "", [], b"",
                                                                                       now=1.0)


def subscription_session(clock: Any) -> tuple[SelectionService, SubscriptionSession]:
    """A service subscribed to worker 1's engine, and the session of that subscription, its
    handshake answered as an engine would."""
    import base64
    import hashlib
    import random

    service = SelectionService(Settings(kv_events="subscribe"), random.Random(0))
    service.upsert_worker(WorkerRequest(worker_id=1, model_name="m", endpoint="e", block_size=4,
                                        kv_events_endpoint="ws://engine/events"), now=0.0)
    subscribe = next(out for out in iter(service.next_output, None) if isinstance(out, SubscribeKvEvents))
    session = SubscriptionSession(service, clock, subscribe.stream, "engine", "/events")
    key = re.search(rb"(?i)sec-websocket-key: *(\S+)", session.data_to_send())
    assert key is not None
    accept = base64.b64encode(hashlib.sha1(key[1] + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    session.receive_data(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                         b"sec-websocket-accept: " + accept + b"\r\n\r\n")
    assert session.accepted
    return service, session


def stored_blocks(service: SelectionService) -> set[int]:
    return {b["block_hash"] for e in service.dump()["events"] for b in e["event"]["data"]["stored"]["blocks"]}


def _unmasked(opcode: int, payload: bytes) -> bytes:
    """One server frame (FIN set), as an engine sends it."""
    masked = _masked(opcode, payload)
    return bytes([masked[0], masked[1] & 0x7F]) + masked[2:-len(payload) - 4] + payload


class StreamSessionMachine(RuleBasedStateMachine):
    """Either role's session driven as its transport drives it (bytes read only when nothing
    waits, the backlog resumed a turn at a time, a large message decoded and applied a slice at a
    time), in any interleaving, the bytes cut anywhere: small and large messages storing blocks,
    removing earlier ones or malformed, then maybe a close. Whenever no large message is part
    applied, the index holds what applying the messages handled so far in order gives; a
    malformed message is refused as a small one is (push: closed 1007; subscription: dropped and
    counted); acks count applied messages; a close is handled only after every message before
    it. The large-message and slice bounds are scaled down (600 bytes, 3 events, 8 blocks) so that
    an example stays cheap."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = [mock.patch.object(ws_adapter, name, value) for name, value in
                        (("LARGE_MESSAGE", 600), ("SLICE_EVENTS", 3), ("SLICE_BLOCKS", 8))]
        for patch in self.patches:
            patch.start()
        self.ticks = 0
        self.role = ""
        self.wire = b""
        self.sent: list[list[int] | tuple[int, ...] | None] = []  # stored, removed, malformed
        self.closing = False
        self.next_hash = self.next_event = 1
        self.acks: list[int] = []
        self.slicing: tuple[LargeMessage, DecodedMessage | SelectionError, int] | None = None

    def clock(self) -> float:
        self.ticks += 1
        return float(self.ticks)

    @precondition(lambda self: not self.role)
    @rule(role=st.sampled_from(["push", "subscription"]))
    def open(self, role: str) -> None:
        self.role = role
        opened: tuple[SelectionService, StreamSession] = (
            push_session("/kv_events?worker_id=1&ack=true", self.clock) if role == "push"
            else subscription_session(self.clock))
        self.service, self.session = opened

    def frame(self, opcode: int, payload: bytes) -> bytes:
        return _masked(opcode, payload) if self.role == "push" else _unmasked(opcode, payload)

    def events(self, data: list[dict[str, Any]]) -> bytes:
        self.next_event += len(data)
        return json.dumps([{"event_id": self.next_event - len(data) + i, "data": d} for i, d in enumerate(data)]).encode()

    @precondition(lambda self: self.role and not self.closing)
    @rule(count=st.integers(1, 12), large=st.booleans(), text=st.booleans())
    def send_stored(self, count: int, large: bool, text: bool) -> None:
        hashes = list(range(self.next_hash, self.next_hash + count + (10 if large else 0)))  # 10 more: past 600 bytes
        self.next_hash += len(hashes)
        if text:
            payload = self.events([{"stored": {"parent_hash": None, "blocks": [{"block_hash": h, "tokens_hash": h}]}}
                                   for h in hashes])
        else:  # an engine batch
            payload = msgpack.packb([0.0, [["BlockStored", [h], None, [h, h, h, h], 4, None, "GPU", None, None]
                                           for h in hashes], 0])
        self.wire += self.frame(0x1 if text else 0x2, payload)
        self.sent.append(hashes)

    @precondition(lambda self: self.role and not self.closing and self.next_hash > 1)
    @rule(data=st.data())
    def send_removed(self, data: st.DataObject) -> None:
        hashes = tuple(data.draw(st.lists(st.integers(1, self.next_hash - 1), min_size=1, max_size=60)))
        self.wire += self.frame(0x1, self.events([{"removed": {"block_hashes": list(hashes)}}]))
        self.sent.append(hashes)

    @precondition(lambda self: self.role and not self.closing)
    @rule(large=st.booleans())
    def send_malformed(self, large: bool) -> None:
        self.wire += self.frame(0x1, b"[" + b'{"event_id": 1},' * (60 if large else 1) + b"1]")
        self.sent.append(None)

    @precondition(lambda self: self.role and not self.closing)
    @rule()
    def send_close(self) -> None:
        self.wire += self.frame(0x8, (1000).to_bytes(2, "big"))
        self.closing = True

    def may_read(self) -> bool:
        return bool(self.wire) and not self.session.backlog and self.session.next_large() is None

    @precondition(lambda self: self.role and self.may_read())
    @rule(size=st.integers(1, 3000), turn=st.integers(1, 4))
    def read(self, size: int, turn: int) -> None:
        chunk, self.wire = self.wire[:size], self.wire[size:]
        self.session.receive_data(chunk, until=self.clock() + turn)
        self.take_acks()

    @precondition(lambda self: self.role and not self.session.backlog and self.session.next_large() is None)
    @rule()
    def keepalive(self) -> None:
        """Nothing read for a while: the transport pings (a no-op once closed)."""
        self.session.ping()
        self.session.data_to_send()

    @precondition(lambda self: self.role and self.session.backlog and self.session.next_large() is None)
    @rule(turn=st.integers(1, 4))
    def resume(self, turn: int) -> None:
        self.session.resume(until=self.clock() + turn)
        self.take_acks()

    @precondition(lambda self: self.role and self.session.next_large() is not None)
    @rule()
    def apply_a_slice(self) -> None:
        message = self.session.next_large()
        assert message is not None and len(message.data) > 600
        if self.slicing is None or self.slicing[0] is not message:
            self.slicing = (message, decode_or_error(message.data), 0)
        _, decoded, start = self.slicing
        following = self.session.apply_slice(message, decoded, start)
        self.slicing = None if following is None else (message, decoded, following)
        self.take_acks()

    def take_acks(self) -> None:
        self.acks += [int(n) for n in re.findall(rb'"ack":(\d+)', self.session.data_to_send())]

    def metric(self, family: str, label: str) -> int:
        text = self.service.handle("GET", "/metrics", "", [], b"", now=float(self.ticks)).body.decode()  # type: ignore[union-attr]
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(family + "{") and label in line))

    @invariant()
    def the_index_is_the_messages_applied_in_order(self) -> None:
        if not self.role or self.session.next_large() is not None:
            return  # a large message part applied: checked once it is done
        handled = self.metric("selection_proto_ws_messages_total", 'direction="in"')
        blocks: set[int] = set()
        applied = malformed = 0
        for message in self.sent[:handled]:
            if message is None:
                malformed += 1
                if self.role == "push":
                    break
            else:
                applied += 1
                blocks = blocks | set(message) if isinstance(message, list) else blocks - set(message)
        assert stored_blocks(self.service) == blocks
        if self.role == "push":
            assert self.acks == list(range(1, applied + 1))
            assert self.session.closed == (malformed > 0 or self.session.close_code == 1000)
            assert self.session.close_code in (None, 1007 if malformed else 1000)
        else:
            assert self.metric("selection_proto_kv_events_dropped_total", 'reason="invalid_message"') == malformed
        if self.session.close_code == 1000:
            assert handled == len(self.sent)  # every message before the close

    def teardown(self) -> None:
        try:
            if self.role:  # everything sent is read and handled
                while not self.session.closed and (self.wire or self.session.backlog):
                    if self.session.next_large() is not None:
                        self.apply_a_slice()
                    elif self.session.backlog:
                        self.resume(4)
                    else:
                        self.read(3000, 4)
                self.the_index_is_the_messages_applied_in_order()
                if self.closing and (self.role == "subscription" or None not in self.sent):
                    assert self.session.close_code == 1000
        finally:
            for patch in self.patches:
                patch.stop()


StreamSessionMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=25, deadline=None)
test_stream_sessions = StreamSessionMachine.TestCase
