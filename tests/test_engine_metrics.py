"""Engines' own metrics (docs/VERDICT.md): a worker's `metrics_endpoint` read from vLLM's and SGLang's
Prometheus text, kept per worker and shown in `/loads`; scraped by `serve` from real sockets, a
silent or hostile endpoint costing only its own scrape. Against a real vLLM engine:
tests/test_real_engines.py."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from conftest import Client
from test_http import Server, api_call

from selection_proto import SelectionService, Settings
from selection_proto.core.cache.engine_metrics import MAX_WORKERS, EngineMetrics, parse

VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 400.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 100.0
vllm:prefix_cache_hits_created 1.7e9
vllm:other{label="a } \\" brace"} 9
"""


def test_vllm_and_sglang_texts_are_read() -> None:
    sample = parse(VLLM)
    assert sample == {"running_requests": 3.0, "waiting_requests": 1.0, "kv_usage": 0.5,
                      "prefix_cache_queries": 400.0, "prefix_cache_hits": 100.0, "prefix_cache_hit_rate": 0.25}
    sglang = parse(b'sglang:num_running_reqs{model_name="m"} 2\nsglang:num_queue_reqs{model_name="m"} 5\n'
                   b'sglang:token_usage{model_name="m"} 0.5\nsglang:cache_hit_rate{model_name="m"} 0.8\n')
    assert sglang == {"running_requests": 2.0, "waiting_requests": 5.0, "kv_usage": 0.5, "prefix_cache_hit_rate": 0.8}


def test_what_is_not_a_finite_number_is_left_out() -> None:
    text = (b"vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\nvllm:kv_cache_usage_perc x\n"
            b"vllm:prefix_cache_hits_total 1e400\n\xff\xfe garbage {{{\n" + b"9" * 5000 + b"\n"
            b'vllm:num_requests_waiting{a="\\ud800"} 2\n')
    assert parse(text) == {"waiting_requests": 2.0}
    assert parse(b"") == {}


def test_samples_are_kept_per_worker_and_bounded() -> None:
    engines = EngineMetrics()
    engines.record(1, parse(VLLM), None, now=10.0)
    engines.record(1, None, "no answer within 2 s", now=20.0)  # the last sample stays, with the error
    view = engines.view(1, now=25.0)
    assert view is not None and view["error"] == "no answer within 2 s" and view["age_secs"] == 5.0
    assert view["running_requests"] == 3.0 and engines.view(2, now=25.0) is None
    for worker_id in range(MAX_WORKERS + 10):
        engines.record(worker_id, None, "x", now=30.0)
    assert len(engines._latest) == MAX_WORKERS and engines.view(0, now=30.0) is None


def test_the_endpoint_is_checked_and_loads_show_what_was_scraped() -> None:
    client = Client(SelectionService(Settings(kv_events="off")))
    worker = {"worker_id": 1, "model_name": "m", "block_size": 4, "endpoint": "http://e1"}
    for bad in ("https://e1:9/metrics", "e1:9", "http://:9/x", "http://e1:x/", "http://e1:70000/", "http://e1:0/",
                "http://e\u00e91:9/", "http://e1:9/\n", "http://e1:9/" + "a" * 2048):
        status, message = client.error("POST", "/workers", {**worker, "metrics_endpoint": bad})
        assert status == 422 and "metrics_endpoint: must be an http://host[:port]/path URL" in message, bad
    assert client.ok("POST", "/workers", {**worker, "metrics_endpoint": "http://e1/metrics"}, status=201)
    record = client.ok("POST", "/workers", {**worker, "metrics_endpoint": "http://e1:9/metrics"}, status=201)
    assert record["metrics_endpoint"] == "http://e1:9/metrics"
    assert client.service.catalog.metrics_endpoints() == [(1, "http://e1:9/metrics")]
    assert "engines" not in client.ok("GET", "/loads")[0]  # nothing scraped yet: 1.6.1's shape
    client.service.engine_scraped(1, parse(VLLM), None, now=client.now)
    engines = client.ok("GET", "/loads")[0]["engines"]
    assert engines == [{"worker_id": 1, "age_secs": 0.0, "error": None, "running_requests": 3.0,
                        "waiting_requests": 1.0, "kv_usage": 0.5, "prefix_cache_hits": 100.0,
                        "prefix_cache_queries": 400.0, "prefix_cache_hit_rate": 0.25}]
    client.ok("PATCH", "/workers/1", {"metrics_endpoint": "http://e1:10/metrics"})
    assert client.service.catalog.metrics_endpoints() == [(1, "http://e1:10/metrics")]


class Endpoint:
    """A metrics endpoint on a loopback port: `mode` is what it does with a GET."""

    def __init__(self, mode: str) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                endpoint.hits += 1
                if endpoint.mode == "silent":
                    time.sleep(30)  # never answers within the scrape's time
                    return
                if endpoint.mode == "reset":  # an engine killed mid-answer: half a body, then a TCP reset
                    self.send_response(200)
                    self.send_header("content-length", str(len(VLLM)))
                    self.end_headers()
                    self.wfile.write(VLLM[:100])
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    return
                body = VLLM if endpoint.mode == "vllm" else b"#" * (5 << 20)
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.mode, self.hits = mode, 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def scraping() -> Iterator[Server]:
    server = Server("--engine-metrics-interval-secs", "0.2", mode="off")
    yield server
    server.stop()


call = api_call


def test_serve_scrapes_each_endpoint_and_a_hostile_one_costs_only_itself(scraping: Server) -> None:
    endpoints = {1: Endpoint("vllm"), 2: Endpoint("silent"), 3: Endpoint("huge"), 5: Endpoint("reset")}
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]  # nothing listens here once closed
    urls = {**{w: f"http://127.0.0.1:{e.port}/metrics" for w, e in endpoints.items()},
            4: f"http://127.0.0.1:{refused}/metrics"}
    for worker_id, url in urls.items():
        assert call(scraping.port, "POST", "/workers", {"worker_id": worker_id, "model_name": "m", "block_size": 4,
                                                        "endpoint": "http://e", "metrics_endpoint": url})[0] == 201
    deadline = time.monotonic() + 20
    while True:
        engines = {e["worker_id"]: e for e in call(scraping.port, "GET", "/loads")[1][0].get("engines", [])}
        if len(engines) == 5 and endpoints[1].hits >= 3 and endpoints[5].hits >= 3:
            break
        assert time.monotonic() < deadline, engines
        started = time.monotonic()
        assert call(scraping.port, "GET", "/health") == (200, {"status": "ok"})
        assert time.monotonic() - started < 1.0  # a silent endpoint holds nothing but its own scrape
        time.sleep(0.1)
    assert engines[1]["error"] is None and engines[1]["prefix_cache_hit_rate"] == 0.25
    assert engines[2]["error"] == "no answer within 2 s" and engines[2]["running_requests"] is None
    assert engines[3]["error"] == f"the answer is larger than {1 << 20} bytes"
    assert engines[4]["error"]  # refused
    assert engines[5]["error"] == "the connection was reset"
    assert call(scraping.port, "GET", "/health") == (200, {"status": "ok"})


def test_a_scrape_interval_that_is_not_positive_is_refused_at_start() -> None:
    import subprocess
    import sys

    for value in ("0", "-1", "nan"):
        done = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--port", "0",
                               "--engine-metrics-interval-secs", value], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "--engine-metrics-interval-secs: must be a finite number greater than 0" \
            in done.stderr, done.stderr


def test_hostile_observations_over_a_socket_are_ignored_and_the_server_answers_on() -> None:
    """The verdict's input path: `cached_tokens` with `prefill_complete` and the free, sent over a
    real socket. A member of the wrong shape is ignored, said in `warnings` and counted (it was a
    422 that kept a free's booking until it expired: a free must free); a body that does not parse
    (a 5,000-digit integer, a lone surrogate, 1e999) is ignored as 1.6.1 ignores these bodies.
    Either way nothing is observed, the prefill mark and the free land, and `/health` answers."""
    server = Server(mode="push")
    try:
        port = server.port
        assert call(port, "POST", "/workers", {"worker_id": 1, "model_name": "m", "block_size": 4,
                                               "endpoint": "http://e"})[0] == 201

        def book() -> None:
            assert call(port, "POST", "/select_and_reserve", {"model_name": "m", "token_ids": list(range(12)),
                                                              "reservation_id": "r"})[0] == 200

        def send(method: str, path: str, raw: bytes) -> tuple[int, Any]:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(raw)}\r\nconnection: close\r\n\r\n".encode() + raw)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            return int(answer.split(b" ", 2)[1]), json.loads(answer.partition(b"\r\n\r\n")[2])

        def active() -> int:
            return int(call(port, "GET", "/loads")[1][0]["loads"][0]["active_requests"])

        book()
        bad_shape = [b'{"cached_tokens": -1}', b'{"cached_tokens": 5.0}', b'{"cached_tokens": true}',
                     b'{"cached_tokens": "5"}', b'{"cached_tokens": [[[[1]]]]}']
        unparsed = [b'{"cached_tokens": ' + b"9" * 5000 + b"}", b'{"cached_tokens": "\\ud800"}',
                    b'{"cached_tokens": 1e999}']
        for raw in bad_shape + unparsed:
            status, body = send("POST", "/reservations/r/prefill_complete", raw)
            assert status == 200 and body["status"] == "ok", (raw[:40], body)
            assert (raw in bad_shape) == ("warnings" in body), (raw[:40], body)
            if raw in bad_shape:
                assert body["warnings"][0].startswith("cached_tokens ignored: "), body
        assert active() == 1  # the booking stands: a prefill mark does not free
        for raw in bad_shape:
            status, body = send("DELETE", "/reservations/r", raw)
            assert status == 200 and body["status"] == "ok" and body["warnings"], (raw[:40], body)
            assert active() == 0  # freed all the same
            assert send("DELETE", "/reservations/r", b"")[0] == 404
            book()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            metrics = b""
            while chunk := sock.recv(65536):
                metrics += chunk
        assert f'selection_proto_ignored_values_total{{member="cached_tokens"}} {2 * len(bad_shape)}' \
            in metrics.decode()
        assert call(port, "GET", "/workers/1")[1]["kv_routing"]["observations"] == 0
        assert send("DELETE", "/reservations/r", b'{"cached_tokens": 0}') == (200, {"status": "ok"})
        assert call(port, "GET", "/workers/1")[1]["kv_routing"]["observations"] == 1
        assert call(port, "GET", "/health") == (200, {"status": "ok"})
    finally:
        server.stop()
