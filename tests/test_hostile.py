"""Hostile input from outside, over real sockets and a real `stdio` subprocess: every class of input
that once ended the process is answered as a client error, and the server answers afterwards."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_http import Server, read_response, request

UPGRADE = (b"upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\n"
           b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
HUGE = "1" * 5000


def exchange(server: Server, data: bytes) -> tuple[int, dict[str, str], Any]:
    with server.connect() as sock:
        sock.sendall(data)
        status, headers, payload = read_response(sock, bytearray())
    return status, headers, json.loads(payload) if payload else None


def post(server: Server, path: str, raw: bytes) -> tuple[int, Any]:
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n\r\n").encode()
    status, _, payload = exchange(server, head + raw)
    return status, payload


def get(server: Server, path: str) -> tuple[int, bytes]:
    with server.connect() as sock:
        sock.sendall(request("GET", path))
        status, _, payload = read_response(sock, bytearray())
    return status, payload


def assert_healthy(server: Server) -> None:
    """The process is alive and every read still encodes (nothing poisoned the state)."""
    assert server.proc.poll() is None
    for path in ("/health", "/workers", "/loads", "/dump", "/metrics"):
        status, _ = get(server, path)
        assert status == 200, path
    assert get(server, "/ready")[0] in (200, 503)


def internal_errors(server: Server) -> float:
    text = get(server, "/metrics")[1].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("selection_proto_internal_errors_total{"))


@pytest.fixture(params=["subscribe", "push"])
def any_mode(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server("--request-timeout-secs", "2", mode=request.param)
    yield s
    assert s.stop() == 0


@pytest.fixture
def push() -> Iterator[Server]:
    s = Server("--request-timeout-secs", "2")
    yield s
    assert s.stop() == 0


WORKER = b'{"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4'


@pytest.mark.parametrize(("body", "detail"), [
    (b'{"worker_id": 1, "model_name": "\\ud800", "endpoint": "http://w1", "block_size": 4}',
     "lone surrogate in string"),
    (b'{"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4, "topology_domains": {"\\udc00": "x"}}',
     "lone surrogate in string"),
    (b'{"worker_id": 1, "model_name": "m", "endpoint": "\\ud83d\\u0041", "block_size": 4}',
     "lone surrogate in string"),
    (b'{"worker_id": ' + HUGE.encode() + b', "endpoint": "http://w1", "block_size": 4}',
     "integer with 5000 digits (at most 4300)"),
])
def test_json_bodies_that_the_readers_refuse(any_mode: Server, body: bytes, detail: str) -> None:
    status, payload = post(any_mode, "/workers", body)
    assert (status, payload) == (400, {"error": f"Failed to parse the request body as JSON: {detail}"})
    assert json.loads(get(any_mode, "/workers")[1]) == []  # nothing was stored
    assert internal_errors(any_mode) == 0
    assert_healthy(any_mode)


def test_a_valid_surrogate_pair_is_stored_and_read_back(any_mode: Server) -> None:
    status, record = post(any_mode, "/workers", WORKER + b', "topology_domains": {"e": "\\ud83d\\ude00"}}')
    assert status == 201 and record["topology_domains"] == {"e": "\U0001F600"}
    assert json.loads(get(any_mode, "/workers")[1])[0]["topology_domains"] == {"e": "\U0001F600"}
    assert_healthy(any_mode)


def test_integers_beyond_what_the_interpreter_parses(any_mode: Server) -> None:
    status, _, payload = exchange(any_mode, f"DELETE /workers/{HUGE} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    assert status == 400 and payload["error"] == f"Invalid URL: Cannot parse `{HUGE}` to a `u64`"
    status, _, payload = exchange(any_mode, request("POST", f"/kv_events?worker_id={HUGE}", []))
    assert (status, payload["error"]) == (
        400, "Failed to deserialize query string: worker_id: number too large to fit in target type")
    status, payload = post(any_mode, "/workers", WORKER + b', "kv_events_endpoints": {"' + HUGE.encode()
                           + b'": "tcp://h:1"}}')
    assert status == 422 and payload["error"].endswith("expected a dp_rank (u32)")
    status, _, payload = exchange(any_mode, request("DELETE", f"/reservations/r?model_name=m&tenant_id={HUGE}"))
    assert status in (404, 400)
    assert internal_errors(any_mode) == 0
    assert_healthy(any_mode)


@pytest.mark.parametrize(("head", "detail"), [
    (b"GET /kv_events?worker_id=1 HTTP/1.0\r\n", "Missing mandatory Host: header"),
    (b"GET /kv_events?worker_id=1 HTTP/1.1\r\nhost: \xff\xfe\r\n", "the Host header is not a valid host name"),
])
def test_upgrades_the_websocket_library_refuses(any_mode: Server, head: bytes, detail: str) -> None:
    with any_mode.connect() as sock:
        sock.sendall(head + UPGRADE + b"\r\n")
        status, headers, payload = read_response(sock, bytearray())
        assert (status, json.loads(payload)) == (400, {"error": f"invalid WebSocket upgrade: {detail}"})
        assert sock.recv(10) == b""  # and the connection is closed
    assert internal_errors(any_mode) == 0
    assert_healthy(any_mode)


def test_websocket_query_with_a_huge_integer_closes_1008(push: Server) -> None:
    with push.connect() as sock:
        sock.sendall(f"GET /kv_events?worker_id={HUGE} HTTP/1.1\r\nhost: x\r\n".encode() + UPGRADE + b"\r\n")
        data = b""
        while b"\x88" not in data.partition(b"\r\n\r\n")[2]:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        frame = data.partition(b"\r\n\r\n")[2]
        close = frame[frame.index(b"\x88"):]
        assert int.from_bytes(close[2:4], "big") == 1008
        assert close[4:].startswith(b"Failed to deserialize query string: worker_id: number too large")
    assert_healthy(push)


def test_content_length_with_transfer_encoding_is_refused_and_closed(any_mode: Server) -> None:
    with any_mode.connect() as sock:
        sock.sendall(b"POST /select HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                     + request("GET", "/health"))  # smuggled: must never be answered
        status, headers, payload = read_response(sock, bytearray())
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(payload) == {
            "error": "malformed HTTP request: both Content-Length and Transfer-Encoding"}
        sock.settimeout(5)
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
        assert rest == b""
    assert_healthy(any_mode)


def test_a_413_is_read_by_a_client_that_keeps_sending(any_mode: Server) -> None:
    """The server answers 413 without reading the body, then lingers: reading and dropping what
    arrives, so that closing does not reset the connection before the client reads the answer."""
    with any_mode.connect() as sock:
        sock.sendall(b"POST /select HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 9000000\r\n\r\n")
        time.sleep(0.2)  # the 413 is on its way; the client does not look yet
        sock.settimeout(5)
        chunk = b"[" + b"1," * 32767
        sent = 0
        try:
            while sent < 4_000_000:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, payload = read_response(sock, bytearray())
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(payload) == {"error": "Failed to buffer the request body: length limit exceeded"}
    assert_healthy(any_mode)


def test_a_temperature_that_underflows_the_softmax_picks_the_cheapest(push: Server) -> None:
    for wid in (1, 2):
        assert post(push, "/workers", json.dumps({"worker_id": wid, "endpoint": f"http://w{wid}",
                                                  "block_size": 4}).encode())[0] == 201
    # Worker 2 holds the prompt's first block, so the two costs differ by well under 1.
    event = [{"worker_id": 2, "event": {"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 7, "tokens_hash": 14643705804678351452}]}}}}]
    assert post(push, "/kv_events", json.dumps(event).encode())[0] == 200
    for _ in range(5):
        status, answer = post(push, "/select", b'{"token_ids": [1,2,3,4,5,6,7,8], "router_temperature": 5e-324}')
        assert status == 200 and answer["worker_id"] == 2
    assert internal_errors(push) == 0
    assert_healthy(push)


def test_event_endpoints_the_socket_layer_refuses() -> None:
    """Valid by the catalog's rules, refused by IDNA or ZMQ: a counted subscription failure and a
    stale rank, and the server keeps serving (default mode: subscribe)."""
    server = Server(mode="subscribe")
    try:
        endpoints = ["ws://a..b:1/events", "tcp://[zz]:1", "ws://\u00ff" * 30 + ":1/"]
        for wid, endpoint in enumerate(endpoints, start=1):
            status, _ = post(server, "/workers", json.dumps({
                "worker_id": wid, "endpoint": f"http://w{wid}", "block_size": 4,
                "kv_events_endpoint": endpoint}).encode())
            assert status == 201, endpoint
        deadline = time.monotonic() + 10
        failures = 0.0
        while time.monotonic() < deadline:
            text = get(server, "/metrics")[1].decode()
            failures = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("selection_proto_kv_subscription_failures_total{"))
            if failures >= 2:
                break
            time.sleep(0.2)
        assert failures >= 2
        status, scores = post(server, "/overlap_scores", b'{"model_name": "default", "token_ids": [1, 2, 3, 4]}')
        assert status == 200
        stale = {(f["worker_id"], f["stale"]) for f in scores["freshness"]}
        assert (1, True) in stale
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def rpc_session(lines: list[bytes], *args: str) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "push", *args],
                          input=b"".join(lines), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    return [json.loads(line) for line in proc.stdout.decode().splitlines()]


def test_jsonrpc_hostile_lines() -> None:
    answers = rpc_session([
        b'{"jsonrpc": "2.0", "id": 1, "method": "workers.create", "params": {"worker_id": 1, '
        b'"model_name": "\\ud800", "endpoint": "e", "block_size": 4}}\n',
        b'{"jsonrpc": "2.0", "id": "\\udfff", "method": "health"}\n',
        b'{"jsonrpc": "2.0", "id": 3, "method": "workers.delete", "params": {"worker_id": ' + HUGE.encode() + b"}}\n",
        b'{"jsonrpc": "2.0", "id": 4, "method": "workers.create", "params": {"worker_id": 1, "endpoint": "e", '
        b'"block_size": 4, "kv_events_endpoints": {"' + HUGE.encode() + b'": "tcp://h:1"}}}\n',
        b'{"jsonrpc": "2.0", "id": 5, "method": "workers.delete", "params": {"worker_id": "' + HUGE.encode() + b'"}}\n',
        b'{"jsonrpc": "2.0", "id": 6, "method": "workers.list"}\n',
        b'{"jsonrpc": "2.0", "id": 7, "method": "dump"}\n',
        b'{"jsonrpc": "2.0", "id": 8, "method": "health"}\n',
    ])
    by_id = {a.get("id"): a for a in answers}
    parse_errors = [a["error"] for a in answers if a.get("error", {}).get("code") == -32700]
    assert [e["data"]["detail"] for e in parse_errors] == [  # lines 1-3 do not parse: no id to answer
        "lone surrogate in string", "lone surrogate in string", "integer with 5000 digits (at most 4300)"]
    assert by_id[4]["error"]["code"] == 422
    assert by_id[5]["error"]["code"] == 400
    assert by_id[6]["result"] == [] and by_id[7]["result"]["workers"] == []
    assert by_id[8]["result"] == {"status": "ok"}


def test_restore_refuses_what_the_api_refuses(tmp_path: Any) -> None:
    dump = tmp_path / "dump.json"
    dump.write_text('{"format": "selection-proto-dump/1", "keys": [], "events": [], "workers": '
                    '[{"worker_id": 1, "model_name": "\\ud800", "endpoint": "e", "block_size": 4}]}')
    proc = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--restore", str(dump)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"selection-proto: error: --restore {dump}: invalid JSON: lone surrogate in string"


def test_relay_survives_a_hostile_service() -> None:
    """The service answers every forwarded message with garbage acks; the relay keeps forwarding."""
    import threading

    import zmq
    from test_subscriptions import free_port, vllm_batch
    from websockets.sync.server import serve

    received: list[bytes] = []
    hostile = ['{"ack": 1e400}', "[" * 100_000 + "]" * 100_000, '{"ack": ' + HUGE + "}",
               '{"ack": -5}', '{"ack": "7"}', '{"ack": [1]}', "\U0001F600", '{"ack": 2}']

    def handler(ws: Any) -> None:
        for message in ws:
            received.append(message)
            for text in hostile:
                ws.send(text)

    wport, zport = free_port(), free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{zport}")
    with serve(handler, "127.0.0.1", wport, max_size=None) as ws_server:
        threading.Thread(target=ws_server.serve_forever, daemon=True).start()
        relay = subprocess.Popen(
            [sys.executable, "-m", "selection_proto", "relay", "--zmq", f"tcp://127.0.0.1:{zport}",
             "--to", f"ws://127.0.0.1:{wport}/kv_events", "--worker-id", "1"],
            stderr=subprocess.PIPE, text=True)
        try:
            seq = 0
            deadline = time.monotonic() + 20
            while len(received) < 5 and time.monotonic() < deadline:
                seq += 1
                pub.send_multipart([b"kv", seq.to_bytes(8, "big"), vllm_batch([seq], [1, 2, 3, 4])])
                time.sleep(0.1)
            assert len(received) >= 5 and relay.poll() is None
        finally:
            relay.terminate()
            relay.wait(timeout=15)
            pub.close(linger=0)
    assert relay.stderr is not None
    records = [json.loads(line) for line in relay.stderr.read().splitlines()]
    assert not [r for r in records if r["event"] in ("internal_error", "relay_disconnected")], records
    final = [r for r in records if r["event"] == "relay_stopped"][-1]
    assert final["forwarded"] >= 5 and final["acknowledged"] == 2, records and final["internal_errors"] == 0


def test_websockets_count_against_max_connections() -> None:
    server = Server("--max-connections", "3")
    socks: list[socket.socket] = []
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "endpoint": "http://w1", "block_size": 4}')[0] == 201
        for _ in range(3):
            sock = server.connect()
            sock.sendall(b"GET /kv_events?worker_id=1 HTTP/1.1\r\nhost: x\r\n" + UPGRADE + b"\r\n")
            socks.append(sock)
        time.sleep(0.3)
        with server.connect() as extra:
            extra.sendall(request("GET", "/health"))
            status, _, payload = read_response(extra, bytearray())
        assert (status, json.loads(payload)) == (503, {"error": "too many connections"})
        for sock in socks:
            sock.close()
        time.sleep(0.3)
        assert get(server, "/health")[0] == 200
    finally:
        for sock in socks:
            sock.close()
        assert server.stop() == 0


def test_a_queued_connection_stops_reading_until_answered() -> None:
    """While its selection waits in the queue, a client that pipelines megabytes behind it is not
    read: the server buffers at most 64 KiB of it, and answers everyone else meanwhile."""
    server = Server("--queue-threshold", "0.5", "--queue-timeout-secs", "3")
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "endpoint": "http://w1", "block_size": 4, '
                    b'"max_num_batched_tokens": 8}')[0] == 201
        assert post(server, "/select_and_reserve", b'{"token_ids": [1, 2, 3, 4], "reservation_id": "busy"}')[0] == 200
        with server.connect() as sock:
            sock.sendall(request("POST", "/select", {"token_ids": [1, 2, 3, 4]}))
            time.sleep(0.3)  # queued behind the busy worker
            sock.setblocking(False)
            pipelined = request("GET", "/health") * 200_000  # ~15 MB
            sent = 0
            deadline = time.monotonic() + 2
            while sent < len(pipelined) and time.monotonic() < deadline:
                try:
                    sent += sock.send(pipelined[sent:sent + 65536])
                except BlockingIOError:
                    time.sleep(0.01)
            assert sent < 8_000_000  # the server stopped reading; the kernel buffers filled up
            assert get(server, "/health")[0] == 200  # others are served meanwhile
            status, _, _ = exchange(server, request("DELETE", "/reservations/busy"))
            assert status == 200
            sock.setblocking(True)
            sock.settimeout(10)
            status, _, payload = read_response(sock, bytearray())
            assert status == 200 and json.loads(payload)["worker_id"] == 1
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_a_worker_record_has_a_byte_bound() -> None:
    server = Server("--max-record-bytes", "4096")
    try:
        taints = [f"taint-{i}" for i in range(1000)]  # ~11 KB as JSON
        status, payload = post(server, "/workers", json.dumps({
            "worker_id": 1, "endpoint": "http://w1", "block_size": 4, "taints": taints}).encode())
        assert status == 409 and payload["error"].startswith("worker record exceeds the limit of 4096 bytes (")
        assert json.loads(get(server, "/workers")[1]) == []
        status, _ = post(server, "/workers", json.dumps({
            "worker_id": 1, "endpoint": "http://w1", "block_size": 4, "taints": taints[:10]}).encode())
        assert status == 201
        text = get(server, "/metrics")[1].decode()
        assert 'selection_proto_limit_rejections_total{limit="record_bytes"} 1.0' in text
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_outbound_subscriptions_are_capped() -> None:
    server = Server("--max-subscriptions", "2", mode="subscribe")
    try:
        def worker(wid: int, ranks: int) -> bytes:
            return json.dumps({"worker_id": wid, "endpoint": f"http://w{wid}", "block_size": 4,
                               "data_parallel_size": ranks, "kv_events_endpoints": {
                                   str(r): f"ws://127.0.0.1:9/w{wid}r{r}" for r in range(ranks)}}).encode()
        assert post(server, "/workers", worker(1, 2))[0] == 201
        status, payload = post(server, "/workers", worker(2, 1))
        assert (status, payload) == (409, {"error": "subscription limit reached: at most 2 outbound "
                                                    "KV-event subscriptions"})
        assert post(server, "/workers", worker(1, 2))[0] == 201  # replacing its own stays within
        status, _, _ = exchange(server, request("DELETE", "/workers/1"))
        assert status == 200
        assert post(server, "/workers", worker(2, 1))[0] == 201
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_the_state_budget_refuses_writes_and_keeps_reads() -> None:
    server = Server("--max-state-bytes", "60000")
    try:
        assert post(server, "/workers", WORKER + b"}")[0] == 201

        def store(event_id: int, count: int) -> tuple[int, Any]:
            blocks = [{"block_hash": event_id * 1000 + i, "tokens_hash": event_id * 1000 + i} for i in range(count)]
            return post(server, "/kv_events", json.dumps([{"worker_id": 1, "event": {
                "event_id": event_id, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}}]).encode())

        status, report = store(1, 300)  # 300 blocks * 200 bytes: the budget is now used up
        assert status == 200 and report["applied"] == 1
        status, payload = store(2, 1)
        assert status == 507 and payload["error"].startswith("state budget exhausted: kv events refused")
        status, payload = post(server, "/select_and_reserve", b'{"model_name": "m", "token_ids": [1, 2, 3, 4]}')
        assert status == 507 and payload["error"].startswith("state budget exhausted: booking ")
        assert post(server, "/select", b'{"model_name": "m", "token_ids": [1, 2, 3, 4]}')[0] == 200  # a read
        text = get(server, "/metrics")[1].decode()
        used = float(next(line for line in text.splitlines()
                          if line.startswith("selection_proto_state_bytes ")).split()[1])
        assert used >= 50000 and "selection_proto_state_budget_bytes 60000.0" in text
        # A remove frees memory and is always applied; then writes are accepted again.
        removed = [{"worker_id": 1, "event": {"event_id": 2, "data": {"removed": {
            "block_hashes": [1000 + i for i in range(300)]}}}}]
        status, report = post(server, "/kv_events", json.dumps(removed).encode())
        assert status == 200 and report["applied"] == 1
        assert store(3, 1)[0] == 200
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_stdio_survives_a_reader_that_closes_stdout_and_stops_on_sigterm() -> None:
    import signal as signals

    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "push"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(b'{"jsonrpc": "2.0", "id": 1, "method": "health"}\n')
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["result"] == {"status": "ok"}
    proc.stdout.close()  # the reader goes away
    proc.stdin.write(b'{"jsonrpc": "2.0", "id": 2, "method": "health"}\n')
    proc.stdin.flush()
    assert proc.wait(timeout=20) == 0  # it stops: nobody is left to answer
    logs = [json.loads(line) for line in proc.stderr.read().decode().splitlines()]
    assert [r["event"] for r in logs if r["event"] in ("stdout_closed", "stopped")] == ["stdout_closed", "stopped"]

    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "push"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(b'{"jsonrpc": "2.0", "id": 1, "method": "health"}\n')
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["id"] == 1
    proc.send_signal(signals.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert '"event":"shutdown"' in proc.stderr.read().decode()
