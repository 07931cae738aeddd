"""Fuzz targets: each takes arbitrary bytes, feeds one adapter or decoder, and checks that nothing
raises and that what comes out is well formed. Shared by the Hypothesis runs in the test suite and
by `python fuzz/run.py TARGET` (atheris when installed)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Final

import msgpack

from selection_proto import SelectionService, Settings, WorkerRequest
from selection_proto.adapters.grpc import CallEnded, GrpcServer, Message
from selection_proto.adapters.http import HttpConnection
from selection_proto.adapters.jsonl import JsonRpcSession
from selection_proto.adapters.ws import PushSession, server_handshake
from selection_proto.core.base.errors import SelectionError, StreamError
from selection_proto.core.cache.engine import InvalidBatch, decode_batch
from selection_proto.core.fleet.journal import LedgerSettings
from selection_proto.core.fleet.ledger_wire import (
    KINDS,
    AddRecord,
    LedgerWireError,
    decode_replies,
    decode_snapshot,
    encode_add,
)

__all__ = ["SPLITTERS", "TARGETS", "fresh_service", "seeds"]

ALLOWED_STATUSES = {100, 101, 200, 201, 400, 404, 405, 408, 409, 413, 415, 422, 426, 429, 431, 500, 503}


def fresh_service(mode: str = "push") -> SelectionService:
    service = SelectionService(Settings(kv_events=mode), random.Random(0))  # type: ignore[arg-type]
    for wid in (1, 2):
        service.upsert_worker(WorkerRequest(worker_id=wid, model_name="default", endpoint=f"http://w{wid}",
                                            block_size=4, data_parallel_size=2), now=0.0)
    return service


def _clock() -> float:
    return 1.0


def http_stream(data: bytes) -> None:
    """Arbitrary bytes into one HTTP connection, in chunks whose sizes come from the data itself."""
    service = fresh_service()
    conn = HttpConnection(service, _clock)
    pos = 0
    step = (data[0] % 13 + 1) if data else 1
    out = b""
    while pos < len(data) and not conn.closed:
        conn.receive_data(data[pos:pos + step])
        out += _drain_http(conn)
        pos += step
    if not conn.closed:
        conn.receive_data(b"")
        out += _drain_http(conn)
    _check_http_output(out)
    # Whatever that connection did, the service keeps serving everyone else.
    other = HttpConnection(service, _clock)
    other.receive_data(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    assert _drain_http(other).startswith(b"HTTP/1.1 200 ")


def _drain_http(conn: HttpConnection) -> bytes:
    """Everything the connection has to say now (one answer per call)."""
    out = b""
    while data := conn.data_to_send():
        out += data
    return out


def _check_http_output(out: bytes) -> None:
    rest = out
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        assert sep, out[:200]
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        assert status in ALLOWED_STATUSES, lines[0]
        headers = dict(line.split(b": ", 1) for line in lines[1:])
        length = int(headers.get(b"content-length", b"0"))
        body, rest = rest[:length], rest[length:]
        if headers.get(b"content-type") == b"application/json" and body:
            json.loads(body)


def jsonl_stream(data: bytes) -> None:
    service = fresh_service()
    session = JsonRpcSession(service, _clock)
    session.receive_data(data)
    session.end_of_input()
    for line in session.data_to_send().splitlines():
        message = json.loads(line)
        assert message["jsonrpc"] == "2.0" and ("result" in message) != ("error" in message)


_UPGRADE_HEADERS: Final = [
    (b"host", b"x"), (b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
    (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="), (b"sec-websocket-version", b"13")]


def _push_session(service: SelectionService, target: str) -> PushSession:
    ws = server_handshake(target, _UPGRADE_HEADERS)
    assert not isinstance(ws, str), ws
    return PushSession(service, _clock, ws, target, b"")


def ws_stream(data: bytes) -> None:
    """Arbitrary frame bytes after a valid upgrade of a push stream."""
    service = fresh_service()
    query = "worker_id=1&framing=seq&ack=true" if data[:1] == b"\x01" else "worker_id=1&ack=true"
    session = _push_session(service, f"/kv_events?{query}")
    assert session.data_to_send().startswith(b"HTTP/1.1 101")
    session.receive_data(data)
    session.apply_held()
    session.data_to_send()
    session.receive_data(b"")
    assert session.closed


def json_events(data: bytes) -> None:
    service = fresh_service()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    before = service.dump()
    status, _, body = service.handle("POST", "/kv_events", "worker_id=1", [("content-type", "application/json")],
                                     data, now=1.0)
    assert status in ALLOWED_STATUSES
    payload = json.loads(body)
    if status != 200:
        assert service.dump() == before and "error" in payload
    stream = service.open_event_stream(2, 0, now=1.0)
    try:
        service.stream_message(stream, text, now=1.0)
    except StreamError as exc:
        assert exc.code in (1007, 1008)


def engine_batch(data: bytes) -> None:
    service = fresh_service()
    try:
        decode_batch(data)
        valid = True
    except InvalidBatch:
        valid = False
    before = service.dump()
    try:
        report = service.apply_engine_batch(data, worker_id=1, now=1.0)
        assert valid and report.received == report.applied + report.failed + report.dropped
    except SelectionError as exc:
        assert not valid or exc.status in (400, 409)
        assert service.dump() == before


_MSGPACK_ROUTES: Final = (("POST", "/select"), ("POST", "/select_and_reserve"), ("POST", "/workers"),
                          ("PATCH", "/workers/1"), ("POST", "/reservations"), ("POST", "/overlap_scores"),
                          ("POST", "/potential_loads"), ("POST", "/reservations/r/output_block"),
                          ("POST", "/select_pd_and_reserve"), ("POST", "/select_pd"))


def msgpack_body(data: bytes) -> None:
    """Arbitrary bytes as an `application/msgpack` body of a JSON route (the first byte picks
    the route): an answer with a spec status, an `error` on failure, and nothing changed by one."""
    service = fresh_service()
    method, path = _MSGPACK_ROUTES[data[0] % len(_MSGPACK_ROUTES)] if data else _MSGPACK_ROUTES[0]
    before = service.dump(), service.handle("GET", "/loads", "", [], b"", now=1.0).body
    status, _, body = service.handle(method, path, "", [("content-type", "application/msgpack")], data[1:],
                                     now=1.0)
    assert status in ALLOWED_STATUSES
    if status >= 400:
        assert "error" in json.loads(body)
        assert (service.dump(), service.handle("GET", "/loads", "", [], b"", now=1.0).body) == before


_EMPTY_SNAPSHOT: Final = [b"e", b"0", None, [], [], [], [], [], [], [], []]


def ledger_feed(data: bytes) -> None:
    """Arbitrary bytes as what a shared ledger answers: feed entries (a msgpack list of [id, fields]
    pairs, and one entry whose body is the bytes), a script's replies and a snapshot. The readers
    raise only LedgerWireError; the mirror never raises, and its service answers afterwards."""
    service = fresh_service()
    ledger = service.share(LedgerSettings(), "me")
    ledger.connected(True, 1.0)
    ledger.load(decode_snapshot(_EMPTY_SNAPSHOT), 1.0)
    try:
        value = msgpack.unpackb(data, raw=True, strict_map_key=False)
    except (ValueError, msgpack.UnpackException, TypeError):
        value = None
    entries = [tuple(v) for v in value if isinstance(v, list) and len(v) == 2] if isinstance(value, list) else []
    kind = sorted(KINDS)[data[0] % len(KINDS)].encode() if data else b"add"
    entries.append((b"1-0", {b"n": b"1", b"o": b"other", b"k": kind, b"i": data[1:9], b"b": data}))
    ledger.apply(entries, 2.0)
    for raw in (value, [value], data):
        try:
            decode_replies(raw, 1)
        except LedgerWireError:
            pass
        try:
            decode_snapshot(raw)
        except LedgerWireError:
            pass
    assert service.handle("GET", "/loads", "", [], b"", now=3.0).status == 200


def grpc_stream(data: bytes) -> None:
    """Arbitrary bytes into the picker's gRPC framing (adapters/grpc.py on adapters/http2.py), in
    chunks sized by the data, every message echoed and every ended call finished: nothing raises,
    and what it writes is whole HTTP/2 frames."""
    server = GrpcServer(max_message_bytes=1 << 16, max_calls=4)
    out = bytearray(server.data_to_send())
    step = (data[0] % 61 + 1) if data else 1
    for position in range(0, len(data), step):
        for event in server.receive(data[position:position + step]):
            if isinstance(event, Message):
                server.consumed(event)
                server.send_message(event.stream_id, event.payload[:64])
            elif isinstance(event, CallEnded):
                server.finish(event.stream_id, 0)
        out += server.data_to_send()
    position = 0
    while position < len(out):  # each frame whole: a 9-byte header and the length it says
        length = int.from_bytes(out[position:position + 3], "big")
        assert length <= 16_384 and position + 9 + length <= len(out), "a frame cut short"
        position += 9 + length


TARGETS: dict[str, Callable[[bytes], None]] = {
    "http": http_stream,
    "jsonl": jsonl_stream,
    "ws": ws_stream,
    "json_events": json_events,
    "engine_batch": engine_batch,
    "msgpack_body": msgpack_body,
    "ledger_feed": ledger_feed,
    "grpc": grpc_stream,
}


def seeds(target: str) -> list[bytes]:
    """Valid inputs that mutation starts from."""
    body = json.dumps({"token_ids": list(range(12))}).encode()
    batch = msgpack.packb([0.0, [["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU", None, None],
                                 ["BlockRemoved", [1]], ["AllBlocksCleared"]], 0])
    if target == "http":
        return [b"POST /select HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body) + b"GET /loads HTTP/1.1\r\nhost: x\r\n\r\n",
                b"POST /workers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                b"5\r\n{\"wor\r\n0\r\n\r\n"]
    if target == "jsonl":
        return [b'{"jsonrpc":"2.0","id":1,"method":"select","params":' + body + b"}\n"
                b'{"jsonrpc":"2.0","id":2,"method":"loads"}\n{"jsonrpc":"2.0","method":"cancel","params":{"id":1}}\n']
    if target == "ws":
        text = b'{"event_id":1,"data":"cleared"}'
        return [b"\x81" + bytes([0x80 | len(text)]) + b"\x00\x00\x00\x00" + text + b"\x89\x80\x00\x00\x00\x00"]
    if target == "ledger_feed":
        add = encode_add(AddRecord("default", "default", 1, 0, 4, None, [1, 2]))
        return [msgpack.packb([[b"1-0", {b"n": b"1", b"o": b"x", b"k": b"add", b"i": b"r", b"b": add}],
                               [b"2-0", {b"n": b"2", b"o": b"x", b"k": b"free", b"i": b"r", b"b": b""}]]),
                b"\x00" + add, msgpack.packb([b"ok 1", b"conflict 3"])]
    if target == "msgpack_body":
        prompt = {"model_name": "default", "token_ids": b"".join(i.to_bytes(4, "little") for i in range(12)),
                  "reservation_id": "r"}
        return [b"\x00" + msgpack.packb({"model_name": "default", "token_ids": list(range(12))}),
                b"\x01" + msgpack.packb(prompt),
                b"\x02" + msgpack.packb({"worker_id": 3, "endpoint": "http://w3", "block_size": 4})]
    if target == "grpc":  # a client's preface, a call with one message, its end; then a ping
        path = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
        block = (b"\x83\x86\x04" + bytes([len(path)]) + path  # :method POST, :scheme http, :path
                 + b"\x0f\x10\x10application/grpc")  # content-type, a literal with its name indexed
        message = b"\x00\x00\x00\x00\x05hello"

        def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
            return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

        return [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") + frame(1, 4, 1, block)
                + frame(0, 1, 1, message) + frame(6, 0, 0, b"12345678")]
    if target == "json_events":
        return [json.dumps([{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"parent_hash": None,
                "blocks": [{"block_hash": 5, "tokens_hash": 6}]}}}}]).encode()]
    return [batch]


def _http_out(chunks: list[bytes]) -> bytes:
    conn = HttpConnection(fresh_service(), _clock)
    out = b""
    for chunk in chunks:
        conn.receive_data(chunk)
        out += _drain_http(conn)
    return out


def _jsonl_out(chunks: list[bytes]) -> bytes:
    session = JsonRpcSession(fresh_service(), _clock)
    for chunk in chunks:
        session.receive_data(chunk)
    session.end_of_input()
    return session.data_to_send()


def _ws_out(chunks: list[bytes]) -> bytes:
    service = fresh_service()
    session = _push_session(service, "/kv_events?worker_id=1&ack=true")
    out = session.data_to_send()
    for chunk in chunks:
        session.receive_data(chunk)
        session.apply_held()
        out += session.data_to_send()
    return out + json.dumps(service.dump()).encode()


# target -> function from input chunks to everything observable; splitting must not change it
SPLITTERS: dict[str, Callable[[list[bytes]], bytes]] = {"http": _http_out, "jsonl": _jsonl_out, "ws": _ws_out}
