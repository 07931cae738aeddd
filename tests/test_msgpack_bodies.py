"""Binary prompts (docs/DECISIONS.md): every JSON route takes the same members as one msgpack map, and a
u32 array (`token_ids`) may be a `bin` of little-endian u32. The answers are the bytes the JSON
request gets; a body that is not msgpack is a 400 that changes nothing; over a real socket too."""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st
from test_http import Server, read_response

from selection_proto import SelectionService, Settings
from selection_proto.core.base import jsonio

JSON = [("content-type", "application/json")]
MSGPACK = [("content-type", "application/msgpack")]
WORKERS = [{"worker_id": w, "model_name": "m", "endpoint": f"http://w{w}", "block_size": 4} for w in (1, 2, 3)]


def service_with_state() -> SelectionService:
    service = SelectionService(Settings(kv_events="push"), random.Random(5))
    for w in WORKERS:
        assert service.handle("POST", "/workers", "", JSON, jsonio.dumps(w), now=1.0).status == 201
    events = [{"worker_id": 2, "event": {"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 11, "tokens_hash": h} for h in _hashes(list(range(12)))]}}}}]
    assert service.handle("POST", "/kv_events", "", JSON, jsonio.dumps(events), now=1.0).status == 200
    return service


def _hashes(tokens: list[int]) -> list[int]:
    from selection_proto import block_hashes

    return block_hashes(tokens, 4)


def encodings(body: dict[str, Any]) -> list[tuple[list[tuple[str, str]], bytes]]:
    """The body as JSON, as msgpack, and as msgpack with its u32 arrays as `bin`."""
    binary = {k: struct.pack(f"<{len(v)}I", *v) if k in ("token_ids", "routing_token_ids") else v
              for k, v in body.items()}
    return [(JSON, jsonio.dumps(body)), (MSGPACK, msgpack.packb(body)), (MSGPACK, msgpack.packb(binary))]


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1) | st.sampled_from(range(12)), max_size=40),
       prefix=st.booleans(), route=st.sampled_from(["/select", "/select_and_reserve", "/overlap_scores",
                                                      "/potential_loads"]))
def test_every_encoding_gets_the_same_answer(tokens: list[int], prefix: bool, route: str) -> None:
    if prefix:
        tokens = list(range(12)) + tokens  # worker 2 holds this prefix
    body: dict[str, Any] = {"model_name": "m", "token_ids": tokens}
    if route == "/select_and_reserve":
        body["reservation_id"] = "r-1"
    answers = []
    for headers, data in encodings(body):
        service = service_with_state()
        response = service.handle("POST", route, "", headers, data, now=2.0)
        loads = service.handle("GET", "/loads", "", [], b"", now=2.0)
        answers.append((response.status, response.body, loads.body))
    assert answers[0][0] in (200, 422) and answers[0] == answers[1] == answers[2]


def test_catalog_writes_in_msgpack() -> None:
    service = SelectionService(Settings(kv_events="push"), random.Random(0))
    created = service.handle("POST", "/workers", "", MSGPACK, msgpack.packb(WORKERS[0]), now=1.0)
    assert created.status == 201
    patched = service.handle("PATCH", "/workers/1", "", MSGPACK, msgpack.packb({"taints": ["b", "a"]}), now=1.0)
    assert patched.status == 200 and json.loads(patched.body)["taints"] == ["a", "b"]
    # POST /kv_events keeps its meaning: a msgpack body there is one engine batch.
    batch = service.handle("POST", "/kv_events", "worker_id=1", MSGPACK, msgpack.packb({"x": 1}), now=1.0)
    assert (batch.status, batch.body) == (422, b'{"error":"invalid engine batch: events: expected an array"}')


HOSTILE: list[tuple[str, bytes, int, str]] = [
    ("truncated", msgpack.packb({"model_name": "m"})[:-2], 400, "Unpack failed: incomplete input"),
    ("trailing bytes", msgpack.packb({}) + b"\x01", 400, "unpack(b) received extra data."),
    ("an integer key", msgpack.packb({1: 2}), 400, "int is not allowed for map key when strict_map_key=True"),
    ("a bin key", msgpack.packb({b"a": 1}), 400, "map keys must be strings"),
    ("an extension type", msgpack.packb(msgpack.ExtType(5, b"x")), 400, "extension type 5 is not accepted"),
    ("deep nesting", b"\x91" * 100_000 + b"\xc0", 400, "nested too deeply"),
    ("invalid UTF-8", b"\x81\xa1\xff\x01", 400,
     "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
    ("an array of 2**32 - 1 items claimed in 5 bytes", b"\xdd\xff\xff\xff\xff", 400,
     "4294967295 exceeds max_array_len(5)"),
    ("an empty body", b"", 400, "Unpack failed: incomplete input"),
    ("a bin of 3 bytes", msgpack.packb({"model_name": "m", "token_ids": b"abc"}), 422,
     "token_ids: invalid length 3: a bin of little-endian u32 takes a multiple of 4 bytes"),
    ("a bin for a string", msgpack.packb({"model_name": b"m", "token_ids": [1]}), 422,
     "model_name: invalid type: byte array, expected a string"),
    ("a timestamp", msgpack.packb({"model_name": msgpack.Timestamp(1)}), 422,
     "model_name: invalid type: value of type Timestamp, expected a string"),
    ("a float token", msgpack.packb({"model_name": "m", "token_ids": [1.5]}), 422,
     "token_ids[0]: invalid type: floating point `1.5`, expected u32"),
    ("a boolean token", msgpack.packb({"model_name": "m", "token_ids": [True]}), 422,
     "token_ids[0]: invalid type: boolean `true`, expected u32"),
    ("a negative token", msgpack.packb({"model_name": "m", "token_ids": [-1]}), 422,
     "token_ids[0]: invalid value: integer `-1`, expected u32"),
]


def test_a_body_that_is_not_a_request_is_refused_and_changes_nothing() -> None:
    service = service_with_state()
    before = [service.handle("GET", p, "", [], b"", now=3.0).body for p in ("/loads", "/workers", "/dump")]
    for name, data, status, detail in HOSTILE:
        answer = service.handle("POST", "/select_and_reserve", "", MSGPACK, data, now=3.0)
        prefix = ("Failed to parse the request body as msgpack: " if status == 400 else
                  "Failed to deserialize the JSON body into the target type: ")
        assert (answer.status, json.loads(answer.body)["error"]) == (status, prefix + detail), name
    after = [service.handle("GET", p, "", [], b"", now=3.0).body for p in ("/loads", "/workers", "/dump")]
    assert after == before


def test_over_a_socket_small_and_large_bodies_and_hostile_ones() -> None:
    server = Server()
    try:
        def call(method: str, path: str, data: bytes, media: str) -> tuple[int, bytes]:
            with server.connect() as sock:
                sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {media}\r\n"
                             f"content-length: {len(data)}\r\n\r\n".encode() + data)
                status, _, payload = read_response(sock, bytearray())
            return status, payload

        assert call("POST", "/workers", msgpack.packb(WORKERS[0]), "application/msgpack")[0] == 201
        for count in (64, 200_000):  # 200,000 tokens: 800 KB of bin, parsed in a worker thread
            tokens = [(i * 7919) % 50_000 for i in range(count)]
            body = {"model_name": "m", "token_ids": tokens}
            as_json = call("POST", "/select", jsonio.dumps(body), "application/json")
            as_bin = call("POST", "/select", msgpack.packb({**body, "token_ids": struct.pack(
                f"<{count}I", *tokens)}), "application/msgpack")
            assert as_json[0] == 200 and as_bin == as_json
        for _, data, status, _ in HOSTILE:
            assert call("POST", "/select", data, "application/msgpack")[0] == status
        assert call("POST", "/select", b"\x91" * 300_000, "application/msgpack")[0] == 400  # large: in a thread
        assert call("GET", "/health", b"", "application/json") == (200, b'{"status":"ok"}')
    finally:
        assert server.stop() == 0
