"""Fault injection, one layer at a time (tests/fault_injection.py runs the real command with one
component made to raise): the failure stays inside its request, connection, stream, task or call,
is logged once with its traceback, is counted in `selection_proto_internal_errors_total{where}`,
changes nothing, and the server keeps answering everyone else."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from test_hostile import UPGRADE, assert_healthy, get, post
from test_http import Server, read_response, request

WORKER = b'{"worker_id": 1, "endpoint": "http://w1", "block_size": 4}'


def internal_errors(server: Server) -> dict[str, float]:
    text = get(server, "/metrics")[1].decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("selection_proto_internal_errors_total{"):
            where = line.split('where="', 1)[1].split('"', 1)[0]
            out[where] = float(line.rsplit(" ", 1)[1])
    return out


def logged(server: Server, where: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in list(server.logs)]
    return [r for r in records if r["event"] == "internal_error" and r["where"] == where]


def wait_for(check: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def test_a_failing_core_method_is_a_500_that_changes_nothing() -> None:
    server = Server(fault="handle")
    try:
        assert post(server, "/workers", WORKER.replace(b'"endpoint"', b'"model_name": "boom", "endpoint"'))[0] == 201
        status, payload = post(server, "/select", b'{"model_name": "boom", "token_ids": [1, 2, 3, 4]}')
        assert (status, payload) == (500, {"error": "internal error"})
        loads = json.loads(get(server, "/loads")[1])
        assert [r["active_requests"] for m in loads for r in m["loads"]] == [0]  # nothing booked
        assert internal_errors(server) == {"handle": 1.0}
        assert wait_for(lambda: len(logged(server, "handle")) == 1)
        assert "InjectedFault: injected fault in select" in logged(server, "handle")[0]["traceback"]
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_a_failing_http_adapter_answers_500_and_closes_only_that_connection() -> None:
    server = Server(fault="http")
    try:
        with server.connect() as other:  # a keep-alive connection opened before the failure
            other.sendall(request("GET", "/health"))
            assert read_response(other, bytearray())[0] == 200
            with server.connect() as sock:
                sock.sendall(request("GET", "/boom"))
                status, headers, payload = read_response(sock, bytearray())
                assert (status, json.loads(payload)) == (500, {"error": "internal error"})
                assert headers["connection"] == "close" and sock.recv(10) == b""
            other.sendall(request("GET", "/health"))  # still served
            assert read_response(other, bytearray())[0] == 200
        assert internal_errors(server) == {"http": 1.0}
        assert wait_for(lambda: len(logged(server, "http")) == 1)
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_a_failing_websocket_stream_closes_1011() -> None:
    server = Server(fault="websocket")
    try:
        assert post(server, "/workers", WORKER)[0] == 201
        with server.connect() as sock:
            sock.sendall(b"GET /kv_events?worker_id=1 HTTP/1.1\r\nhost: x\r\n" + UPGRADE + b"\r\n")
            sock.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                data += sock.recv(4096)
            assert data.startswith(b"HTTP/1.1 101")
            text = b'{"event_id": 1, "data": "cleared"}'
            sock.sendall(bytes([0x81, 0x80 | len(text)]) + b"\0\0\0\0" + text)  # masked with zeros
            frames = data.partition(b"\r\n\r\n")[2]
            while len(frames) < 4:
                chunk = sock.recv(4096)
                assert chunk
                frames += chunk
            assert frames[0] == 0x88 and int.from_bytes(frames[2:4], "big") == 1011
            assert frames[4:].startswith(b"internal error")
        assert internal_errors(server) == {"websocket": 1.0}
        assert wait_for(lambda: len(logged(server, "websocket")) == 1)
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_a_failing_timer_keeps_the_server_up() -> None:
    server = Server(fault="timer")
    try:
        assert wait_for(lambda: internal_errors(server).get("timer", 0) >= 1, timeout=5)
        assert_healthy(server)
        assert logged(server, "timer")
    finally:
        assert server.stop() == 0


def test_a_failing_subscription_is_retried_and_its_rank_is_stale() -> None:
    server = Server(fault="subscription", mode="subscribe")
    try:
        assert post(server, "/workers", WORKER.replace(b"}", b', "kv_events_endpoint": "ws://127.0.0.1:9/e"}'))[0] == 201
        assert wait_for(lambda: internal_errors(server).get("subscription", 0) >= 2, timeout=10)  # retried
        status, scores = post(server, "/overlap_scores", b'{"token_ids": [1, 2, 3, 4]}')
        assert status == 200 and scores["freshness"][0]["stale"] is True
        text = get(server, "/metrics")[1].decode()
        assert 'selection_proto_kv_subscription_failures_total{scheme="ws",reason="error"}' in text
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_a_failing_queue_dispatch_answers_that_ticket_500_and_the_free_stands() -> None:
    server = Server("--queue-threshold", "0.5", fault="dispatch")
    try:
        assert post(server, "/workers", WORKER.replace(b"}", b', "max_num_batched_tokens": 8}'))[0] == 201
        assert post(server, "/select_and_reserve",
                    b'{"token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "reservation_id": "a"}')[0] == 200
        with server.connect() as waiting:
            waiting.sendall(request("POST", "/select_and_reserve", {"token_ids": [1, 2, 3, 4], "reservation_id": "b"}))
            time.sleep(0.3)  # queued: the only worker is busy
            with server.connect() as sock:
                sock.sendall(request("DELETE", "/reservations/a"))
                assert read_response(sock, bytearray())[0] == 200  # the free itself succeeded
            waiting.settimeout(10)
            status, _, payload = read_response(waiting, bytearray())
            assert (status, json.loads(payload)) == (500, {"error": "internal error"})
        loads = json.loads(get(server, "/loads")[1])
        assert [(r["active_requests"], r["potential_prefill_tokens"]) for m in loads for r in m["loads"]] == [(0, 0)]
        assert internal_errors(server) == {"dispatch": 1.0}
        assert_healthy(server)
    finally:
        assert server.stop() == 0


def test_a_failing_jsonrpc_call_answers_32603_and_the_session_goes_on() -> None:
    lines = [b'{"jsonrpc": "2.0", "id": 1, "method": "loads"}\n',
             b'{"jsonrpc": "2.0", "id": 2, "method": "health"}\n',
             b'{"jsonrpc": "2.0", "id": 3, "method": "metrics"}\n']
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "fault_injection.py"),
                           "jsonrpc", "stdio", "--kv-events", "push"],
                          input=b"".join(lines), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    answers = {a["id"]: a for a in map(json.loads, proc.stdout.decode().splitlines())}
    assert answers[1]["error"] == {"code": -32603, "message": "Internal error"}
    assert answers[2]["result"] == {"status": "ok"}
    assert 'selection_proto_internal_errors_total{where="jsonrpc"} 1.0' in answers[3]["result"]["text"]
    logs = [json.loads(line) for line in proc.stderr.decode().splitlines()]
    assert [r["where"] for r in logs if r["event"] == "internal_error"] == ["jsonrpc"]


def test_running_out_of_descriptors_backs_off_and_recovers() -> None:
    """EMFILE on accept: the server logs (a line per retry at most, retries backing off), waits and
    accepts again once descriptors are free. The limit is lowered once the server runs (`prlimit`):
    at start it would have sized the connection budget to it, and answered 503 before running out."""
    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--kv-events", "push"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        port = int(json.loads(proc.stderr.readline())["url"].rsplit(":", 1)[1])
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (64, 64))
        socks = []
        for _ in range(80):  # more than the server has descriptors for
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        time.sleep(1.0)
        assert proc.poll() is None
        for sock in socks:
            sock.close()
        time.sleep(1.5)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request("GET", "/health"))
            assert read_response(sock, bytearray())[0] == 200
        assert proc.poll() is None
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0
    assert proc.stderr is not None
    records = [json.loads(line) for line in proc.stderr.read().splitlines()]
    failures = [r for r in records if r["event"] == "accept_failed"]
    assert failures and failures[0]["errno"] == 24  # EMFILE
    assert len(failures) < 10, failures  # about a line a second (2.5 s of it here)


def test_a_failing_picker_stream_ends_alone_counted_and_logged_once() -> None:
    """The endpoint picker's adapter raising for one request: that gRPC stream ends with INTERNAL
    at once (Envoy, not answered, fails that request), the error is counted and logged once a
    stream, nothing stays booked, and the next stream is routed; a body booked in the reader's
    turn (small) or in a task of its own (over 64 KiB) alike."""
    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_ext_proc import body, headers

    server = Server("--ext-proc-port", "0", fault="ext_proc", mode="approximate")
    try:
        assert wait_for(lambda: any('"ext_proc_listening"' in line for line in server.logs))
        url = next(json.loads(line) for line in server.logs if '"ext_proc_listening"' in line)["url"]
        for model in ("m", "boom"):
            record = {"worker_id": len(model), "model_name": model, "endpoint": "http://10.0.0.1:8000", "block_size": 4}
            assert post(server, "/workers", json.dumps(record).encode())[0] == 201
        with grpc.insecure_channel(url[len("grpc://"):]) as channel:
            stub = ExternalProcessorStub(channel)
            held = threading.Event()
            for prompt in (b"[1, 2, 3, 4]", json.dumps(list(range(20_000))).encode()):
                def boom(prompt: bytes = prompt) -> Any:
                    yield headers()
                    yield body(b'{"model": "boom", "prompt": ' + prompt + b"}", end=True)
                    held.wait(30)  # the call stays open: its status must come without the peer's end

                with pytest.raises(grpc.RpcError) as failed:
                    list(stub.Process(boom(), timeout=10))
                assert failed.value.code() == grpc.StatusCode.INTERNAL  # type: ignore[attr-defined]
            routed = list(stub.Process(iter([headers(), body(b'{"model": "m", "prompt": [1, 2, 3, 4]}', end=True)])))
            assert routed[0].HasField("request_headers")
            held.set()
        assert wait_for(lambda: internal_errors(server) == {"ext_proc": 2.0})
        assert len(logged(server, "ext_proc")) == 2
        assert wait_for(lambda: all(load["active_requests"] == 0 for key in json.loads(get(server, "/loads")[1])
                                    for load in key["loads"]))
        assert_healthy(server)
    finally:
        server.stop()
