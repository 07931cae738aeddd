"""The real server: `selection-proto serve` in a subprocess on a loopback port, spoken to over sockets."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest


class Server:
    """`selection-proto serve` on a free loopback port; its stderr log lines are kept in `logs`."""

    def __init__(self, *args: str, mode: str = "push", fault: str | None = None,
                 open_files: int | None = None) -> None:
        # `fault`: run through tests/fault_injection.py with that component made to raise.
        program = ["-m", "selection_proto"] if fault is None else [
            os.path.join(os.path.dirname(__file__), "fault_injection.py"), fault]

        def limit() -> None:  # `open_files`: the process's RLIMIT_NOFILE, soft and hard
            if open_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

        self.proc = subprocess.Popen(
            [sys.executable, *program, "serve", "--port", "0", "--kv-events", mode, *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, preexec_fn=limit)
        self.logs: list[str] = []
        self._listening = threading.Event()
        # Keep draining stderr so that a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        assert self._listening.wait(30), "the server did not report its port: " + "".join(self.logs)
        record = next(json.loads(line) for line in self.logs if '"listening"' in line)
        self.port = int(record["url"].rsplit(":", 1)[1])

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.logs.append(line)
            if '"event":"listening"' in line:
                self._listening.set()

    def ext_proc_url(self, timeout: float = 20) -> str:
        """The picker's URL (`serve --ext-proc-port`), once its log line says it listens."""
        deadline = time.monotonic() + timeout
        while not (lines := [line for line in self.logs if '"ext_proc_listening"' in line]):
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.logs)
            time.sleep(0.05)
        return str(json.loads(lines[0])["url"])

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server("--keep-alive-timeout-secs", "2", "--request-timeout-secs", "1")
    yield s
    s.stop()


def api_call(port: int, method: str, path: str, body: Any = None, timeout: float = 30,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One JSON call over a fresh connection (`http.client`): its status and decoded answer."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {**({"content-type": "application/json"} if data is not None else {}),
                                      **(headers or {})})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, json.loads(payload) if payload else None


def request(method: str, path: str, body: Any = None, headers: str = "") -> bytes:
    data = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n{headers}\r\n").encode()
    return head + data


def read_response(sock: socket.socket, buf: bytearray, head_request: bool = False) -> tuple[int, dict[str, str], bytes]:
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = 0 if head_request else int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        rest += chunk
    buf[:] = rest[length:]
    return status, headers, rest[:length]


def test_keep_alive_pipelining_and_routes(server: Server) -> None:
    with server.connect() as sock:
        worker = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
        sock.sendall(request("POST", "/workers", worker) + request("POST", "/select", {
            "model_name": "m", "token_ids": list(range(8))}) + request("GET", "/nope") + request("HEAD", "/health"))
        buf = bytearray()
        answers = [read_response(sock, buf) for _ in range(3)]
        assert [a[0] for a in answers] == [201, 200, 404]
        assert json.loads(answers[1][2])["worker_id"] == 1
        status, headers, _ = read_response(sock, buf, head_request=True)
        assert status == 200 and headers["content-length"] == "15"


def test_chunked_body_and_100_continue(server: Server) -> None:
    with server.connect() as sock:
        body = json.dumps({"worker_id": 2, "endpoint": "e", "block_size": 4}).encode()
        sock.sendall(b"POST /workers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"expect: 100-continue\r\ntransfer-encoding: chunked\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 100")
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        status, _, payload = read_response(sock, bytearray())
        assert status == 201 and json.loads(payload)["lifecycle"] == "schedulable"


def test_limits_and_malformed(server: Server) -> None:
    with server.connect() as sock:
        sock.sendall(b"POST /select HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 9000000\r\n\r\n")
        status, headers, payload = read_response(sock, bytearray())
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(payload) == {"error": "Failed to buffer the request body: length limit exceeded"}
    with server.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n")
        status, _, payload = read_response(sock, bytearray())
        assert status == 431 and json.loads(payload) == {"error": "request header block exceeds 16384 bytes"}
    with server.connect() as sock:
        sock.sendall(b"NOT HTTP\r\n\r\n")
        status, _, payload = read_response(sock, bytearray())
        assert status == 400 and json.loads(payload)["error"].startswith("malformed HTTP request: ")
    with server.connect() as sock:  # an incomplete request times out with 408
        sock.sendall(b"POST /select HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{")
        status, _, payload = read_response(sock, bytearray())
        assert status == 408 and json.loads(payload) == {"error": "request timeout"}
    with server.connect() as sock:  # the server still answers everyone else
        sock.sendall(request("GET", "/health"))
        assert read_response(sock, bytearray())[0] == 200


def test_idle_keep_alive_is_closed(server: Server) -> None:
    with server.connect() as sock:
        start = time.monotonic()
        assert sock.recv(10) == b""
        assert time.monotonic() - start < 4


def test_sigterm_drains_and_exits_zero() -> None:
    s = Server()
    with s.connect() as busy, s.connect() as idle:
        busy.sendall(b"POST /workers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 60\r\n\r\n{")
        idle.sendall(request("GET", "/health"))
        read_response(idle, bytearray())
        time.sleep(0.2)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        text = json.dumps({"worker_id": 5, "endpoint": "e", "block_size": 4}).encode()
        body = text[:-1] + b" " * (60 - len(text)) + b"}"
        busy.sendall(body[1:])
        status, headers, _ = read_response(busy, bytearray())
        assert status == 201 and headers["connection"] == "close"
        assert idle.recv(10) == b""
    assert s.proc.wait(timeout=15) == 0


def test_cli_usage_errors_and_help() -> None:
    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "selection_proto", *args], capture_output=True, text=True,
                              timeout=60, env={**os.environ, **env})

    assert run("--help").returncode == 0
    assert run("serve", "--help").returncode == 0
    assert run("--version").stdout.strip() == "selection-proto 0.1.0"
    for args, env, line in [
        (("serve", "--frob"), {}, "selection-proto: error: unrecognized arguments: --frob"),
        ((), {}, "selection-proto: error: a command is required (serve, stdio, relay, simulate)"),
        (("serve", "--queue-threshold", "0"), {}, "selection-proto: error: --queue-threshold: must be greater than 0"),
        (("serve",), {"SELECTION_PROTO_TRACK_PREFILL_TOKENS": "maybe"},
         "selection-proto: error: SELECTION_PROTO_TRACK_PREFILL_TOKENS: invalid boolean value 'maybe'"),
        (("serve", "--port", "abc"), {}, "selection-proto: error: --port: invalid int value 'abc'"),
        (("serve", "--port", "99999"), {},
         "selection-proto: error: --port: must be between 1 and 65535 (0: any free port), not 99999"),
        (("serve", "--request-timeout-secs", "nan"), {},
         "selection-proto: error: --request-timeout-secs: must be a finite number greater than 0, not nan"),
        (("serve", "--max-connections", "0"), {},
         "selection-proto: error: --max-connections: must be at least 1, not 0"),
    ]:
        result = run(*args, **env)
        assert result.returncode == 2 and result.stderr.strip() == line, result.stderr


def test_dynamo_names_for_settings() -> None:
    """1.6.1's environment variables and flags set our settings; ours win; `--threads` is accepted;
    a variable for a feature we lack stops the start instead of being ignored."""
    from selection_proto import cli, config

    def settings(*args: str, **env: str) -> Any:
        return config.settings_from(cli._build_parser().parse_args(["serve", *args]), env)

    assert settings(DYN_ROUTER_TEMPERATURE="0.5").temperature == 0.5
    assert settings(DYN_ROUTER_TEMPERATURE="0.5", SELECTION_PROTO_TEMPERATURE="0.25").temperature == 0.25
    assert settings("--temperature", "0.125", DYN_ROUTER_TEMPERATURE="0.5").temperature == 0.125
    assert settings(DYN_OVERLAP_SCORE_WEIGHT="2").overlap_score_weight == 2.0
    assert settings("--no-router-assume-kv-reuse").assume_kv_reuse is False
    assert settings("--threads", "8", "--session-affinity-ttl-secs", "1.5").session_affinity_ttl_secs == 1.5
    with pytest.raises(config.UsageError, match="DYN_ROUTER_QUEUE_THRESHOLD: must be greater than 0"):
        settings(DYN_ROUTER_QUEUE_THRESHOLD="0")
    assert settings(DYN_ROUTER_USE_KV_EVENTS="false", DYN_ROUTER_TTL_SECS="3").kv_events == "approximate"
    assert settings(DYN_ROUTER_USE_KV_EVENTS="false", SELECTION_PROTO_KV_EVENTS="push").kv_events == "push"
    with pytest.raises(config.UsageError, match="requires use_kv_events=false"):
        settings(DYN_ROUTER_APPROXIMATE_CACHE_POLICY="lru")
    with pytest.raises(config.UsageError, match="router_predicted_ttl_secs requires use_kv_events=true"):
        settings(DYN_ROUTER_USE_KV_EVENTS="0", DYN_ROUTER_PREDICTED_TTL_SECS="3")
    with pytest.raises(config.UsageError, match="DYN_ROUTER_TRACK_OUTPUT_BLOCKS: not supported yet"):
        settings(DYN_ROUTER_TRACK_OUTPUT_BLOCKS="true")
    with pytest.raises(config.UsageError, match="--session-affinity-ttl-secs: must be between 1 and 31536000"):
        settings("--session-affinity-ttl-secs", "0")


def test_port_in_use_is_a_runtime_failure(server: Server) -> None:
    result = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--port", str(server.port)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"selection-proto: error: cannot listen on 127.0.0.1:{server.port}")


def test_queued_select_is_answered_when_load_frees() -> None:
    s = Server("--queue-threshold", "1", "--queue-timeout-secs", "3")
    try:
        with s.connect() as admin, s.connect() as waiter, s.connect() as leaver:
            buf = bytearray()
            admin.sendall(request("POST", "/workers", {"worker_id": 1, "endpoint": "e", "block_size": 4,
                                                       "max_num_batched_tokens": 8}))
            assert read_response(admin, buf)[0] == 201
            admin.sendall(request("POST", "/reservations", {"reservation_id": "hold", "worker_id": 1,
                                                            "token_ids": list(range(16))}))
            assert read_response(admin, buf)[0] == 201
            waiter.sendall(request("POST", "/select", {"token_ids": [1, 2, 3, 4], "selection_id": "w"})
                           + request("GET", "/health"))
            leaver.sendall(request("POST", "/select", {"token_ids": [1, 2, 3, 4]}))
            time.sleep(0.3)
            leaver.close()  # a client that goes away cancels its ticket
            time.sleep(0.2)
            admin.sendall(request("GET", "/loads"))
            assert json.loads(read_response(admin, buf)[2])[0]["pending_count"] == 1
            waiter.settimeout(0.3)
            with pytest.raises(TimeoutError):
                waiter.recv(1)
            waiter.settimeout(5)
            admin.sendall(request("DELETE", "/reservations/hold"))
            assert read_response(admin, buf)[0] == 200
            wbuf = bytearray()
            status, _, body = read_response(waiter, wbuf)
            assert status == 200 and json.loads(body)["selection_id"] == "w"
            assert read_response(waiter, wbuf)[0] == 200  # the pipelined request behind it
            admin.sendall(request("POST", "/reservations", {"reservation_id": "hold", "worker_id": 1,
                                                            "token_ids": list(range(16))}))
            assert read_response(admin, buf)[0] == 201
            waiter.sendall(request("POST", "/select", {"token_ids": [1]}))
            start = time.monotonic()
            status, _, body = read_response(waiter, wbuf)
            assert status == 503 and "timed out after 3 s waiting in the queue" in json.loads(body)["error"]
            assert 2.5 < time.monotonic() - start < 5
    finally:
        assert s.stop() == 0


def test_trio_backend_serves_the_same_api() -> None:
    s = Server("--backend", "trio", "--request-timeout-secs", "1", "--keep-alive-timeout-secs", "1")
    try:
        with s.connect() as sock:  # timeouts under trio: 408, then an idle close
            start = time.monotonic()
            sock.sendall(b"POST /select HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{")
            status, _, payload = read_response(sock, bytearray())
            assert status == 408 and json.loads(payload) == {"error": "request timeout"}
            assert 0.9 < time.monotonic() - start < 3
        with s.connect() as sock:
            start = time.monotonic()
            assert sock.recv(10) == b""
            assert 0.9 < time.monotonic() - start < 3
        with s.connect() as sock:
            buf = bytearray()
            sock.sendall(request("POST", "/workers", {"worker_id": 1, "endpoint": "e", "block_size": 4}))
            assert read_response(sock, buf)[0] == 201
            sock.sendall(request("POST", "/select", {"token_ids": [1, 2, 3, 4]}))
            status, _, body = read_response(sock, buf)
            assert status == 200 and json.loads(body)["worker_id"] == 1
            sock.sendall(request("GET", "/metrics"))
            text = read_response(sock, buf)[2].decode()
            assert 'selection_proto_request_duration_seconds_count{route="/select"} 1.0' in text
            assert 'selection_proto_connections{kind="http"} 1.0' in text
    finally:
        assert s.stop() == 0


def test_log_level_filters_stderr() -> None:
    proc = subprocess.run([sys.executable, "-m", "selection_proto", "stdio", "--log-level", "warning"],
                          input=b"", capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == b""


def test_connection_cap_answers_503() -> None:
    s = Server("--max-connections", "2")
    try:
        held = [s.connect(), s.connect()]
        for sock in held:  # make sure both are accepted and counted
            sock.sendall(request("GET", "/health"))
            read_response(sock, bytearray())
        with s.connect() as extra:
            status, headers, body = read_response(extra, bytearray())
            assert status == 503 and headers["connection"] == "close"
            assert json.loads(body) == {"error": "too many connections"}
        held[0].close()
        time.sleep(0.2)
        with s.connect() as again:
            again.sendall(request("GET", "/health"))
            assert read_response(again, bytearray())[0] == 200
        held[1].close()
    finally:
        assert s.stop() == 0


def test_second_signal_during_drain_exits_1() -> None:
    s = Server("--shutdown-timeout-secs", "30")
    with s.connect() as busy:
        busy.sendall(b"POST /workers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 60\r\n\r\n{")  # an answer the drain would wait for
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert s.proc.poll() is None  # draining
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=10) == 1


def test_large_json_bodies_parsed_off_the_loop_answer_as_small_ones() -> None:
    """Bodies over 256 KiB are parsed in a worker thread; the answers are the bytes `handle` gives
    for the same request in process, errors included, and pipelined requests keep their order."""
    server = Server()  # the default request timeout: six large bodies take a while on a busy machine
    try:
        _pipelined_large_bodies(server)
    finally:
        server.stop()


def _pipelined_large_bodies(server: Server) -> None:
    import random

    from selection_proto import SelectionService, Settings

    worker = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
    select = json.dumps({"model_name": "m", "token_ids": list(range(100_000))}).encode()
    not_json = b'{"model_name": "m", "token_ids": [' + b"1," * 150_000 + b"]}"
    big_int = b'{"model_name": "m", "token_ids": [' + b"1," * 150_000 + b'18446744073709551616]}'
    # Refused by the fast reader; the error's text comes from the thread that parsed it.
    nan = b'{"model_name": "m", "token_ids": [' + b"1," * 150_000 + b"NaN]}"
    events_not_json = b"[" + b'{"worker_id": 1},' * 20_000 + b"NaN]"
    events_not_utf8 = b"[" + b'{"worker_id": 1},' * 20_000 + b'"\xff"]'
    calls = [("/select", "", select), ("/select", "", not_json), ("/select", "", big_int), ("/select", "", nan),
             ("/kv_events", "worker_id=1", events_not_json), ("/kv_events", "worker_id=1", events_not_utf8)]
    assert min(len(body) for _, _, body in calls) > 256 * 1024
    local = SelectionService(Settings(kv_events="push"), random.Random(0))
    local.handle("POST", "/workers", "", [("content-type", "application/json")], json.dumps(worker).encode(), now=1.0)
    expected = [local.handle("POST", path, query, [("content-type", "application/json")], body, now=2.0)
                for path, query, body in calls]
    with server.connect() as sock:
        sock.sendall(request("POST", "/workers", worker))
        buf = bytearray()
        assert read_response(sock, buf)[0] == 201
        for path, query, body in calls:
            target = f"{path}?{query}" if query else path
            sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (target.encode(), len(body), body))
        sock.sendall(request("GET", "/health"))
        answers = [read_response(sock, buf) for _ in range(len(calls) + 1)]
    assert [(a[0], a[2]) for a in answers[:-1]] == [(e.status, e.body) for e in expected]
    assert [a[0] for a in answers] == [200, 400, 422, 400, 400, 400, 200]
    assert b"NaN" in answers[3][2] and b"UTF-8" in answers[5][2], answers[3][2] + answers[5][2]


def test_a_large_kv_events_request_is_applied_in_steps_with_the_same_report() -> None:
    """More than `max_events_per_step` events are bound, then applied, a step at a time between
    other requests; the report is the one the whole batch gets at once, and a refusal found late
    still changes nothing."""
    import random

    from selection_proto import SelectionService, Settings

    workers = [{"worker_id": w, "endpoint": f"http://w{w}", "block_size": 4} for w in (1, 2)]
    events = []
    for i in range(1000):
        data: Any = {"stored": {"parent_hash": None, "blocks": [{"block_hash": i, "tokens_hash": i}]}}
        if i % 97 == 0:
            data = {"stored": {"parent_hash": 10**6 + i, "blocks": [{"block_hash": i, "tokens_hash": i}]}}
        events.append({"worker_id": 1 + i % 2, "event": {"event_id": i // 2 + 1, "data": data}})
    local = SelectionService(Settings(kv_events="push", max_events_per_step=None), random.Random(0))
    for w in workers:
        local.handle("POST", "/workers", "", [("content-type", "application/json")], json.dumps(w).encode(), now=1.0)
    whole = local.handle("POST", "/kv_events", "", [("content-type", "application/json")],
                         json.dumps(events).encode(), now=2.0)
    s = Server("--max-events-per-step", "100")
    try:
        with s.connect() as sock:
            buf = bytearray()
            for w in workers:
                sock.sendall(request("POST", "/workers", w))
                assert read_response(sock, buf)[0] == 201
            sock.sendall(request("POST", "/kv_events", events) + request("GET", "/health"))
            status, _, body = read_response(sock, buf)
            assert (status, body) == (whole.status, whole.body)
            assert json.loads(body)["failed"] == 11 and read_response(sock, buf)[0] == 200
            late = events + [{"worker_id": 9, "event": {"event_id": 1, "data": "cleared"}}]
            sock.sendall(request("GET", "/dump"))
            before = read_response(sock, buf)[2]
            sock.sendall(request("POST", "/kv_events", late))
            status, _, body = read_response(sock, buf)
            assert status == 404 and json.loads(body)["error"].startswith("worker 9")
            sock.sendall(request("GET", "/dump"))
            assert read_response(sock, buf)[2] == before  # nothing of it was applied
    finally:
        assert s.stop() == 0


def test_metrics_parse_as_prometheus_text_with_process_and_rank_figures() -> None:
    """`/metrics` read by `prometheus_client`'s own parser: every family parses, the process's
    figures are there (from the server), and each rank's load."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.interop.test_services import Http

    server = Server()
    try:
        service = Http(server.port, "tenant_id")
        assert service.call("POST", "/workers", {"worker_id": 1, "model_name": "m", "endpoint": "http://w1",
                                                 "block_size": 4})[0] == 201
        assert service.call("POST", "/select_and_reserve", {"model_name": "m", "reservation_id": "r",
                                                            "token_ids": list(range(9))})[0] == 200
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["process_resident_memory_bytes"].samples[0].value > 1e6
        assert families["process_open_fds"].samples[0].value >= 3
        assert families["process_start_time_seconds"].samples[0].value > 1.7e9
        rank = {"model_name": "m", "tenant_id": "default", "worker_id": "1", "dp_rank": "0"}
        for name, value in (("selection_proto_rank_active_requests", 1.0),
                            ("selection_proto_rank_prefill_tokens", 9.0),
                            ("selection_proto_rank_decode_blocks", 2.0)):
            assert [s.value for s in families[name].samples if s.labels == rank] == [value]
    finally:
        server.stop()


def test_print_config_names_each_source_and_toml_is_strict(tmp_path: Any) -> None:
    config = tmp_path / "settings.toml"
    config.write_text('temperature = 0.5\nport = 9000\n')

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "selection_proto", "serve", *args], capture_output=True,
                              text=True, timeout=60, env={**os.environ, **env})

    result = run("--print-config", "--config", str(config), "--max-keys", "7",
                 SELECTION_PROTO_QUEUE_POLICY="lcfs", DYN_ROUTER_TTL_SECS="3")
    assert result.returncode == 0
    lines = dict(line.split(" = ", 1) for line in result.stdout.splitlines())
    assert lines["temperature"] == f"0.5  # --config {config}: temperature"
    assert lines["port"] == f"9000  # --config {config}: port"
    assert lines["max_keys"] == "7  # --max-keys"
    assert lines["queue_policy"] == '"lcfs"  # SELECTION_PROTO_QUEUE_POLICY'
    assert lines["router_ttl_secs"] == "3.0  # DYN_ROUTER_TTL_SECS"
    assert lines["host"] == '"127.0.0.1"  # default'
    for text, line in (("track_prefill_tokens = \"yes\"\n", "track_prefill_tokens: expected a boolean, not 'yes'"),
                       ("port = \"9000\"\n", "port: expected a int, not '9000'"),
                       ("frob = 1\n", "unknown setting 'frob'")):
        config.write_text(text)
        result = run("--print-config", "--config", str(config))
        assert result.returncode == 2 and line in result.stderr, result.stderr


def test_start_up_line_and_unknown_variables() -> None:
    import select

    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--host", "::1"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "SELECTION_PROTO_TEMPRATURE": "1"})
    try:
        assert proc.stderr is not None
        records = []
        while not any(r["event"] == "listening" for r in records):
            ready, _, _ = select.select([proc.stderr], [], [], 30)
            assert ready
            records.append(json.loads(proc.stderr.readline()))
        warning = next(r for r in records if r["event"] == "unknown_variable")
        assert warning["name"] == "SELECTION_PROTO_TEMPRATURE"
        listening = records[-1]
        assert listening["url"].startswith("http://[::1]:") and listening["version"] == "0.1.0"
        assert listening["settings"]["kv_events"] == "subscribe"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_a_bearer_token_guards_every_route_but_the_open_ones(tmp_path: Any) -> None:
    """`--auth-token-file`: 401 with a JSON error and the connection closed before the body is
    read; the WebSocket upgrade is guarded too; probes and scrapes stay open."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from tests.interop.test_services import Http

    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    server = Server("--auth-token-file", str(token))
    try:
        anonymous = Http(server.port, "tenant_id")
        worker = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
        status, body = anonymous.call("POST", "/workers", worker)
        assert (status, body) == (401, {"error": "missing or invalid bearer token"})
        import urllib.request

        def call(method: str, path: str, auth: str) -> int:
            request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", method=method,
                                             data=json.dumps(worker).encode() if method == "POST" else None,
                                             headers={"content-type": "application/json", "authorization": auth})
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    return int(answer.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)

        for path in ("/health", "/ready", "/metrics", "/openapi.json"):
            assert call("GET", path, "") in (200, 503), path
        assert call("GET", "/dump", "") == 401
        assert call("POST", "/workers", "Bearer wrong") == 401
        assert call("POST", "/workers", "Bearer s3cret-token") == 201
        with pytest.raises(InvalidStatus):
            connect(f"ws://127.0.0.1:{server.port}/kv_events?worker_id=1")
        with connect(f"ws://127.0.0.1:{server.port}/kv_events?worker_id=1",
                     additional_headers={"authorization": "Bearer s3cret-token"}) as ws:
            ws.ping().wait(timeout=5)
    finally:
        server.stop()
    token.write_text("\n")
    result = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--auth-token-file", str(token)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "expected one token" in result.stderr


def test_lifecycle_events_are_logged() -> None:
    from tests.interop.test_services import Http

    server = Server()
    try:
        service = Http(server.port, "tenant_id")
        assert service.call("POST", "/workers", {"worker_id": 1, "model_name": "m", "endpoint": "http://w1",
                                                 "block_size": 4})[0] == 201
        assert service.call("DELETE", "/workers/1")[0] == 200
        deadline = time.monotonic() + 10
        while not any('"worker_removed"' in line for line in server.logs):
            assert time.monotonic() < deadline, server.logs
            time.sleep(0.05)
        records = [json.loads(line) for line in server.logs]
        registered = next(r for r in records if r["event"] == "worker_registered")
        assert (registered["worker_id"], registered["lifecycle"], registered["level"]) == (1, "schedulable", "info")
    finally:
        server.stop()


def test_text_logs_for_a_terminal() -> None:
    import re
    import select

    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--log-format", "text"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        ready, _, _ = select.select([proc.stderr], [], [], 30)
        assert ready
        line = proc.stderr.readline()
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z info +listening url=http://127\.0\.0\.1:\d+ "
                        r"version=0\.1\.0 settings=\"\{", line), line
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_https_and_wss_with_a_certificate(tmp_path: Any) -> None:
    """`--tls-cert`/`--tls-key`: the same API over HTTPS and wss://; a peer that never finishes its
    handshake is dropped and the server still answers."""
    import ssl
    import urllib.request

    import trustme
    from websockets.sync.client import connect

    authority = trustme.CA()
    certificate = authority.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    certificate.cert_chain_pems[0].write_to_path(str(cert))
    certificate.private_key_pem.write_to_path(str(key))
    client = ssl.create_default_context()
    authority.configure_trust(client)
    server = Server("--tls-cert", str(cert), "--tls-key", str(key), "--request-timeout-secs", "1")
    try:
        assert server.logs[-1].find('"url":"https://127.0.0.1:') != -1
        silent = socket.create_connection(("127.0.0.1", server.port))  # never says hello
        with urllib.request.urlopen(f"https://127.0.0.1:{server.port}/health", context=client, timeout=10) as answer:
            assert json.loads(answer.read()) == {"status": "ok"}
        request = urllib.request.Request(f"https://127.0.0.1:{server.port}/workers", method="POST",
                                         data=json.dumps({"worker_id": 1, "endpoint": "http://w1",
                                                          "block_size": 4}).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, context=client, timeout=10) as answer:
            assert answer.status == 201
        with connect(f"wss://127.0.0.1:{server.port}/kv_events?worker_id=1&ack=true", ssl=client) as ws:
            ws.send(json.dumps({"worker_id": 1, "event": {"event_id": 1, "data": "cleared"}}))
            assert json.loads(ws.recv(timeout=5)) == {"ack": 1}
        time.sleep(1.5)
        assert silent.recv(1) == b""  # dropped after the handshake timeout
        silent.close()
    finally:
        server.stop()
    result = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--tls-cert", str(cert)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--tls-cert and --tls-key go together" in result.stderr


def test_the_access_log_has_every_answer() -> None:
    server = Server("--access-log")
    try:
        with server.connect() as sock:
            sock.sendall(request("GET", "/health") + request("GET", "/nope"))
            buf = bytearray()
            assert read_response(sock, buf)[0] == 200 and read_response(sock, buf)[0] == 404
        deadline = time.monotonic() + 10
        while sum('"access"' in line for line in server.logs) < 2:
            assert time.monotonic() < deadline, server.logs
            time.sleep(0.05)
        records = [json.loads(line) for line in server.logs if '"access"' in line]
        assert [(r["method"], r["path"], r["status"]) for r in records] == [("GET", "/health", 200),
                                                                           ("GET", "/nope", 404)]
        assert all(r["ms"] >= 0 for r in records)
    finally:
        server.stop()


def test_debug_logs_every_decision() -> None:
    from tests.interop.test_services import Http

    server = Server("--log-level", "debug")
    try:
        service = Http(server.port, "tenant_id")
        for wid in (1, 2):
            assert service.call("POST", "/workers", {"worker_id": wid, "model_name": "m", "endpoint": f"http://w{wid}",
                                                     "block_size": 4})[0] == 201
        chosen = service.call("POST", "/select_and_reserve", {"model_name": "m", "reservation_id": "r",
                                                              "token_ids": list(range(9))})[1]
        deadline = time.monotonic() + 10
        while not any('"selection"' in line for line in server.logs):
            assert time.monotonic() < deadline, server.logs
            time.sleep(0.05)
        record = next(json.loads(line) for line in server.logs if '"selection"' in line)
        assert record["level"] == "debug" and record["worker_id"] == chosen["worker_id"]
        assert (record["candidates"], record["booked"], record["isl_tokens"]) == (2, "r", 9)
    finally:
        server.stop()
    quiet = Server()  # at info level the core makes no decision notices at all
    try:
        assert Http(quiet.port, "tenant_id").call("POST", "/workers", {
            "worker_id": 1, "endpoint": "http://w1", "block_size": 4})[0] == 201
        assert Http(quiet.port, "tenant_id").call("POST", "/select", {"token_ids": [1, 2, 3, 4]})[0] == 200
        time.sleep(0.2)
        assert not any('"selection"' in line for line in quiet.logs)
    finally:
        quiet.stop()


def test_help_describes_every_option_with_its_default_and_variable() -> None:
    """`serve --help`: each option says what it does, its default (and choices) and its variable."""
    from selection_proto import cli

    parser = cli._build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]  # type: ignore[union-attr]
    undescribed = []
    for action in serve._actions:
        if action.dest in ("help", "print_config", "threads"):
            continue  # nothing to default: show help, print the settings, Dynamo's ignored flag
        text = " ".join((action.help or "").split())
        if "env SELECTION_PROTO_" not in text or text.startswith("default"):
            undescribed.append(action.option_strings[0])
    assert undescribed == []
    text = " ".join(serve.format_help().split())
    assert "--queue-policy VALUE order of queued selections (default fcfs; one of fcfs, lcfs, wspt; env" in text
    assert "--snapshot-interval-secs SECONDS seconds between snapshots" in text
    assert "(default 60.0; env SELECTION_PROTO_SNAPSHOT_INTERVAL_SECS)" in text
