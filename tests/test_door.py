"""A client that holds the door or the loop by doing little (docs/DECISIONS.md, "Bounds"): silent
HTTP/2 connections to the picker, a flood of picker connections under a low descriptor limit,
hostile frees, a queue of many priorities, a trickling `metrics_endpoint`. Each against a real
`serve` over real sockets, which must answer on afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_hardening import assert_its_turn, health_latencies
from test_hostile import assert_healthy, post
from test_http import Server, read_response

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def picker_address(server: Server) -> tuple[str, int]:
    host, port = server.ext_proc_url().removeprefix("grpc://").rsplit(":", 1)
    return host, int(port)


def closed_after(sock: socket.socket, limit: float) -> float | None:
    """Seconds until the server closed `sock` (reading and dropping what it sends), or None if it
    did not within `limit`."""
    started = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - started < limit:
        try:
            if not sock.recv(65536):
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:  # reset
            return time.monotonic() - started
    return None


def silent_connections(address: tuple[str, int], count: int, preface: bool = True) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(address, timeout=5)
        if preface:
            sock.sendall(PREFACE + EMPTY_SETTINGS)
        socks.append(sock)
    return socks


def grpc_call(address: tuple[str, int], token: str | None = None, timeout: float = 10) -> Any:
    """One Process call through a real grpcio client: its first reply."""
    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_ext_proc import body, completion, headers

    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(f"{address[0]}:{address[1]}") as channel:
        messages = [headers(), body(completion(list(range(16))), end=True)]
        return next(ExternalProcessorStub(channel).Process(iter(messages), metadata=metadata, timeout=timeout))


def register(server: Server, token: str | None = None) -> None:
    import http.client
    import json

    worker = {"worker_id": 1, "model_name": "m", "block_size": 4, "endpoint": "http://127.0.0.1:9"}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    auth = {} if token is None else {"authorization": f"Bearer {token}"}
    conn.request("POST", "/workers", json.dumps(worker), {"content-type": "application/json", **auth})
    assert conn.getresponse().status == 201
    conn.close()


def test_silent_picker_connections_are_closed_within_the_keep_alive_timeout() -> None:
    """50 connections that send the HTTP/2 preface and an empty SETTINGS, then nothing, and 10 that
    send nothing at all: every one is closed within `--keep-alive-timeout-secs` (they were never
    closed); one whose call has ended idles out alike; a real gRPC call is routed afterwards."""
    server = Server("--ext-proc-port", "0", "--keep-alive-timeout-secs", "2", mode="approximate")
    try:
        address = picker_address(server)
        register(server)
        socks = silent_connections(address, 50) + silent_connections(address, 10, preface=False)
        waits = [closed_after(sock, 6.0) for sock in socks]
        assert all(wait is not None and wait < 4.0 for wait in waits), waits
        for sock in socks:
            sock.close()
        import grpc

        with grpc.insecure_channel(f"{address[0]}:{address[1]}") as channel:
            from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
            from test_ext_proc import body, completion, headers

            stub = ExternalProcessorStub(channel)
            messages = [headers(), body(completion(list(range(16))), end=True)]
            assert next(stub.Process(iter(messages), timeout=10)).HasField("request_headers")
            # The channel's connection idles out in ~2 s (GOAWAY); the next call opens another.
            time.sleep(4.5)
            assert next(stub.Process(iter(messages), timeout=10)).HasField("request_headers")
        assert 'selection_proto_limit_rejections_total{limit="ext_proc_handshake"} 10.0' in \
            get_text(server, "/metrics")
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def get_text(server: Server, path: str) -> str:
    from test_hostile import get

    return get(server, path)[1].decode()


def test_unauthenticated_picker_connections_cannot_lock_out_callers_with_the_token(tmp_path: Path) -> None:
    """With `--auth-token-file`, `--max-connections` connections that never start a call with the
    token (silent, or asking only for health) are closed within `--keep-alive-timeout-secs`: an
    authenticated gRPC call is routed within that time of the flood (it failed UNAVAILABLE for as
    long as the flood stayed)."""
    (tmp_path / "token").write_text("s3cret\n")
    server = Server("--auth-token-file", str(tmp_path / "token"), "--ext-proc-port", "0",
                    "--max-connections", "16", "--keep-alive-timeout-secs", "2", mode="approximate")
    try:
        address = picker_address(server)
        register(server, "s3cret")
        flood = silent_connections(address, 16)
        started = time.monotonic()
        while True:
            try:
                reply = grpc_call(address, "s3cret", timeout=2)
                break
            except Exception:  # noqa: BLE001 - UNAVAILABLE while the flood holds every slot
                assert time.monotonic() - started < 5.0, "locked out past the keep-alive timeout"
                time.sleep(0.2)
        assert reply.HasField("request_headers")
        assert all(closed_after(sock, 3.0) is not None for sock in flood)
        for sock in flood:
            sock.close()
        assert 'selection_proto_limit_rejections_total{limit="ext_proc_unauthenticated"} 16.0' in \
            get_text(server, "/metrics")
        assert server.proc.poll() is None and get_text(server, "/health") == '{"status":"ok"}'
    finally:
        assert server.stop() == 0


def test_a_picker_flood_under_a_low_descriptor_limit_leaves_the_http_api_up_and_the_log_small() -> None:
    """`ulimit -n 128`: connections to the picker's port until it refuses (each closed at once past
    its half of the descriptors left for connections). The HTTP API answers on meanwhile (it stayed
    down for the whole flood), the log holds a line per second at most (asyncio's listener logged
    a traceback per accept retry: 178 MB in 3 minutes), and once the flood is gone both serve."""
    server = Server("--ext-proc-port", "0", "--keep-alive-timeout-secs", "60", mode="approximate", open_files=128)
    try:
        address = picker_address(server)
        register(server)
        idle = health_latencies(server, count=20)
        flood: list[socket.socket] = []
        refused = 0
        for _ in range(300):  # more than the process has descriptors for
            try:
                sock = socket.create_connection(address, timeout=2)
                sock.sendall(PREFACE + EMPTY_SETTINGS)
                flood.append(sock)
            except OSError:
                refused += 1
        lines_before = len(server.logs)
        assert_its_turn(health_latencies(server, count=40), idle, None, 0.25)
        closed = sum(closed_after(sock, 0.05) is not None for sock in flood)
        assert closed > 100, closed  # refused: closed at once, past the picker's share
        time.sleep(2.0)
        logs = server.logs[lines_before - 5:]
        assert len(server.logs) < 40 and sum(map(len, server.logs)) < 30_000, logs
        assert any('"ext_proc_connections_refused"' in line for line in server.logs)
        assert not any("Traceback" in line for line in server.logs)
        for sock in flood:
            sock.close()
        time.sleep(0.5)
        assert grpc_call(address).HasField("request_headers")
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_a_frees_body_past_a_few_kib_is_refused_before_it_is_read() -> None:
    """`DELETE /reservations/{id}` and `prefill_complete` took bodies of up to 8 MiB, parsed on the
    loop even for an unknown id (0.8-1.6 s; 2.1-5.4 s with a trailing NaN). What they carry is
    `cached_tokens`: past 16 KiB (declared or received) they are refused 413 with the spec's text
    before the body is read, the booking untouched; 16 KiB of padding is still taken."""
    from selection_proto.core.base.routes import SMALL_BODY

    server = Server(mode="approximate")
    try:
        register(server)
        assert post(server, "/select_and_reserve", b'{"model_name": "m", "token_ids": [1, 2, 3, 4, 5], '
                                                   b'"reservation_id": "r"}')[0] == 200
        for method, path in (("POST", "/reservations/r/prefill_complete"), ("DELETE", "/reservations/r")):
            with server.connect() as sock:  # only the head: the answer must not wait for 8 MiB
                sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             f"content-length: {8 << 20}\r\n\r\n".encode())
                status, _, answer = read_response(sock, bytearray())
            assert (status, answer) == (413, b'{"error":"Failed to buffer the request body: length limit '
                                             b'exceeded"}'), answer
            with server.connect() as sock:  # chunked: counted as it arrives
                sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             f"transfer-encoding: chunked\r\n\r\n".encode())
                for _ in range(3):
                    sock.sendall(b"2000\r\n" + b" " * 0x2000 + b"\r\n")
                assert read_response(sock, bytearray())[0] == 413
        assert get_text(server, "/loads").count('"active_requests":1') == 1  # the booking stands
        padded = b'{"cached_tokens": 3' + b" " * (SMALL_BODY - 20) + b"}"
        assert len(padded) == SMALL_BODY
        with server.connect() as sock:
            sock.sendall(f"DELETE /reservations/r HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(padded)}\r\n\r\n".encode() + padded)
            assert read_response(sock, bytearray())[:3:2] == (200, b'{"status":"ok"}')
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_queued_selections_of_a_thousand_priorities_come_and_go_and_the_server_answers_on() -> None:
    """A queue that saw 1,000 priority values, each request queued, then gone (its client left):
    nothing waits afterwards, and the server answers (the queue's memory is what waits:
    tests/test_flow_control.py counts it)."""
    from test_http import api_call, request

    server = Server("--queue-threshold", "0.000001", mode="push")
    try:
        assert api_call(server.port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://w1", "max_num_batched_tokens": 64})[0] == 201
        assert api_call(server.port, "POST", "/reservations", {"model_name": "m", "reservation_id": "hold",
                                                               "worker_id": 1, "token_ids": list(range(16))})[0] == 201

        def pending() -> int:
            return int(api_call(server.port, "GET", "/loads")[1][0]["pending_count"])

        for batch in range(10):
            waiting = []
            for priority in range(batch * 100, batch * 100 + 100):
                sock = server.connect()
                sock.sendall(request("POST", "/select", {"model_name": "m", "token_ids": [1, 2, 3],
                                                         "priority": priority}))
                waiting.append(sock)
            deadline = time.monotonic() + 20
            while pending() != 100:
                assert time.monotonic() < deadline, pending()
                time.sleep(0.02)
            for sock in waiting:
                sock.close()
            while pending():
                assert time.monotonic() < deadline, pending()
                time.sleep(0.02)
        assert api_call(server.port, "DELETE", "/reservations/hold")[0] == 200
        assert api_call(server.port, "POST", "/select", {"model_name": "m", "token_ids": [1, 2, 3]})[0] == 200
        assert_healthy(server)
    finally:
        assert server.stop() == 0


TRICKLER = """
import socket, threading
def trickle(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\\r\\ntransfer-encoding: chunked\\r\\n\\r\\n")
        while True:
            conn.sendall(b"1\\r\\n#\\r\\n")
    except OSError:
        conn.close()
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(128)
print(listener.getsockname()[1], flush=True)
while True:
    threading.Thread(target=trickle, args=(listener.accept()[0],), daemon=True).start()
"""


def test_metrics_endpoints_answering_a_byte_at_a_time_leave_health_its_turn() -> None:
    """16 workers whose `metrics_endpoint` answers in 1-byte chunks, as fast as it can, scraped
    every second: each byte went through h11 on the loop, and `/health` stalled 1.6-5.3 s (8.9 s
    in bench/stalls.py). Now the loop only gathers bytes (a read per 10 ms at most), and a scrape
    ends at its deadline or its size cap, with the reason in `/loads`; a worker that answers
    properly is scraped meanwhile. (The trickling peer is a process of its own: threads in this
    one slowed its own probes.)"""
    import http.server
    import subprocess
    import sys

    from test_http import api_call

    class Fine(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            body = b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    fine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fine)
    threading.Thread(target=fine.serve_forever, daemon=True).start()
    trickler = subprocess.Popen([sys.executable, "-c", TRICKLER], stdout=subprocess.PIPE, text=True)
    assert trickler.stdout is not None
    endpoint = f"http://127.0.0.1:{int(trickler.stdout.readline())}/metrics"
    server = Server("--engine-metrics-interval-secs", "1", mode="approximate")
    try:
        idle = health_latencies(server, count=20)
        for wid in range(1, 18):
            url = endpoint if wid <= 16 else f"http://127.0.0.1:{fine.server_address[1]}/metrics"
            assert api_call(server.port, "POST", "/workers", {"worker_id": wid, "model_name": "m", "block_size": 4,
                                                              "endpoint": f"http://w{wid}", "metrics_endpoint": url}
                            )[0] == 201
        flood = threading.Thread(target=time.sleep, args=(6.0,))
        flood.start()
        assert_its_turn(health_latencies(server, flood), idle, None, 0.25)
        engines = {e["worker_id"]: e for e in api_call(server.port, "GET", "/loads")[1][0]["engines"]}
        assert engines[17]["error"] is None and engines[17]["running_requests"] == 3
        assert all(engines[wid]["error"] in ("no answer within 2 s", "the answer is larger than 1048576 bytes")
                   for wid in range(1, 17)), engines
        assert_healthy(server)
    finally:
        trickler.kill()
        trickler.wait()
        fine.shutdown()
        assert server.stop() == 0


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"])
def test_utf16_and_utf32_bodies_are_refused_400_by_the_api_and_the_picker(encoding: str) -> None:
    """JSON between systems is UTF-8 (RFC 8259 §8.1; api.md §2.2: 400). The standard library reads
    UTF-16 and UTF-32 given bytes, so the picker routed such bodies and the API named the wrong
    cause (`lone surrogate in string`); both now refuse them 400, saying which encoding it was."""
    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_ext_proc import body, headers

    wide = encoding[:6].upper()
    server = Server("--ext-proc-port", "0", mode="approximate")
    try:
        address = picker_address(server)
        register(server)
        raw = json.dumps({"model_name": "m", "token_ids": [1, 2, 3, 4, 5]}).encode(encoding)
        assert post(server, "/select", raw) == (400, {"error": f"Failed to parse the request body as JSON: the body "
                                                               f"is {wide}; JSON must be UTF-8"})
        openai = json.dumps({"model": "m", "prompt": [1, 2, 3, 4, 5]}).encode(encoding)
        with grpc.insecure_channel(f"{address[0]}:{address[1]}") as channel:
            reply = next(ExternalProcessorStub(channel).Process(iter([headers(), body(openai, end=True)]),
                                                                 timeout=10))
        assert reply.HasField("immediate_response") and reply.immediate_response.status.code == 400
        assert f"the body is {wide}; JSON must be UTF-8" in reply.immediate_response.body.decode()
        assert post(server, "/select", b'{"model_name": "m", "token_ids": [1, 2, 3, 4, 5]}')[0] == 200
        assert grpc_call(address).HasField("request_headers")
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_a_process_starting_beside_a_sibling_does_not_ask_itself_for_its_dump(ledger: Any) -> None:
    """`serve --processes 2 --ledger`: a process that found its sibling in the ledger's registry
    warmed from that sibling's URL, which is its own (one shared port): the /dump could land in its
    own backlog, which it does not accept until joined. It stalled 10 s, then took connections
    unjoined and refused registrations 503 `ledger unavailable: catalog writes need the ledger`
    (1 run in 2: whichever process the kernel gave the /dump to). Here the sibling has registered
    and gone, so that the /dump would always reach the asker: every registration is answered 201
    at once, and the process asks no peer."""
    import os
    import subprocess
    import sys

    from test_http import api_call

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sibling = {"url": f"http://127.0.0.1:{port}", "seen": time.time(), "settings": {}}
    ledger.client().hset("sp:{default}:replicas", "vm/1/sibling", json.dumps(sibling))
    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", str(port),
                             "--kv-events", "push", "--ledger", ledger.url], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SELECTION_PROTO_PROCESS_INDEX": "1"})  # as the supervisor starts it
    logs: list[str] = []

    def drain() -> None:
        assert proc.stderr is not None
        logs.extend(proc.stderr)

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while not any('"event":"listening"' in line for line in logs):
            assert time.monotonic() < deadline and proc.poll() is None, logs
            time.sleep(0.01)
        for wid in range(1, 11):
            started = time.monotonic()
            answer = api_call(port, "POST", "/workers", {"worker_id": wid, "model_name": "m", "block_size": 4,
                                                         "endpoint": f"http://w{wid}"})
            assert answer[0] == 201 and time.monotonic() - started < 3.0, answer
        assert not any(word in line for line in logs for word in ('"ledger_not_ready"', '"peer_recovery_failed"')), logs
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
