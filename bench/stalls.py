"""Does one heavy request stall everyone? `/health` latency on its own keep-alive connection while
another connection sends, over and over, one of the heaviest requests a client may send
(docs/INVARIANTS.md, "No single request stalls everyone"; goal: p99 under 50 ms).

    python bench/stalls.py [--scenarios idle,picker_tokenize,picker_chat,select_nan,book_1m_push,book_1m_approx,
                            ws_events,ws_flood,ws_flood_cleared,picker_echo,delete_bookings,ready,select_1m,select_booked,
                            post_events,snapshot,free_bodies,trickle_scrape]
        [--seconds 5] [--bookings 100000] [--workers 100000] [--blocks 200000]

Each scenario starts its own `selection-proto serve --kv-events push` and prepares its state
first (bookings through pipelined `POST /reservations`, workers through `--restore`). Besides
the round trips, `cpu` is the CPU time the server's main thread spent while a probe waited (read
from /proc, 10 ms ticks): the stall itself, which other processes on a busy machine do not
inflate; `load` is the 1-minute load average after the scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


class Conn:
    """One keep-alive HTTP/1.1 connection with a minimal response reader."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, method: str, path: str, body: bytes = b"", extra: str = "") -> None:
        self.sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          f"content-length: {len(body)}\r\n{extra}\r\n".encode() + body)

    def read(self) -> tuple[int, bytes]:
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = bytearray(rest)  # amortized growth: `bytes +=` copied 44 MB answers quadratically,
        while len(body) < length:  # holding this process's GIL from the /health prober's thread
            body += self._recv()
        self.buf = bytes(body[length:])
        return int(head.split()[1]), bytes(body[:length])

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed")
        return chunk

    def call(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        self.send(method, path, body)
        return self.read()


WATCH = False  # --watch: the server runs under bench/loop_watch.py, whose reports are printed
SERVER_PID = 0  # the last server started: its main thread's CPU time is read around each probe


def loop_cpu_seconds(pid: int) -> float:
    """CPU time the process's main thread (its event loop) has used (tests/test_hardening.py)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    runner = [os.path.join(HERE, "loop_watch.py")] if WATCH else ["-m", "selection_proto"]
    proc = subprocess.Popen([sys.executable, *runner, "serve", "--port", "0", "--kv-events", "push",
                             "--max-state-bytes", str(64 * 1024**3), *args],
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    global SERVER_PID
    SERVER_PID = proc.pid
    record = json.loads(proc.stderr.readline())
    def drain() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            if WATCH and not line.startswith("{"):
                print(line, end="", file=sys.stderr)

    threading.Thread(target=drain, daemon=True).start()
    return proc, int(record["url"].rsplit(":", 1)[1])


def worker(wid: int, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"worker_id": wid, "model_name": model, "endpoint": f"http://w{wid}:8000", "block_size": 16, **extra}


def measure(port: int, heavy: Callable[[Conn], None], seconds: float) -> dict[str, float]:
    """Run `heavy` in a loop on one connection while another times `/health`."""
    stop = threading.Event()
    heavy_times: list[float] = []

    def run_heavy() -> None:
        conn = Conn(port)
        while not stop.is_set():
            t = time.perf_counter()
            heavy(conn)
            heavy_times.append(time.perf_counter() - t)

    probes: list[float] = []
    thread = threading.Thread(target=run_heavy)
    thread.start()
    probe = Conn(port)
    time.sleep(0.2)
    deadline = time.monotonic() + seconds
    cpu: list[float] = []  # the server loop's CPU time while each probe waited: what a busy machine does not inflate
    while time.monotonic() < deadline:
        used, t = loop_cpu_seconds(SERVER_PID), time.perf_counter()
        status, _ = probe.call("GET", "/health")
        assert status == 200
        probes.append(time.perf_counter() - t)
        cpu.append(loop_cpu_seconds(SERVER_PID) - used)
        time.sleep(0.002)
    stop.set()
    thread.join()
    probes.sort()
    cpu.sort()
    return {"heavy_requests": len(heavy_times), "heavy_median_ms": 1000 * statistics.median(heavy_times),
            "health_probes": len(probes), "health_p50_ms": 1000 * probes[len(probes) // 2],
            "health_p99_ms": 1000 * probes[int(len(probes) * 0.99)], "health_max_ms": 1000 * probes[-1],
            "loop_cpu_p99_ms": 1000 * cpu[int(len(cpu) * 0.99)], "loop_cpu_max_ms": 1000 * cpu[-1]}


def upgrade(conn: Conn, target: str) -> None:
    """Make `conn` a WebSocket on `target`, once (what follows the 101 stays in `conn.buf`)."""
    if hasattr(conn, "ws"):
        return
    conn.send("GET", target, extra="upgrade: websocket\r\nconnection: Upgrade\r\n"
              "sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n")
    while b"\r\n\r\n" not in conn.buf:
        conn.buf += conn._recv()
    conn.buf = conn.buf.partition(b"\r\n\r\n")[2]
    conn.ws = True  # type: ignore[attr-defined]


def ws_frame(payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        head = bytes([0x81, 0x80 | n])
    elif n < 65536:
        head = bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x81, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


def scenario_ws_events(opts: argparse.Namespace) -> dict[str, float]:
    """One 8 MB WebSocket text message of 60,000 stored events, then its ack."""
    proc, port = start([])
    try:
        Conn(port).call("POST", "/workers", json.dumps(worker(1)).encode())

        def messages(base: int) -> tuple[bytes, bytes]:
            events = [{"event_id": base + i, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": base + i, "tokens_hash": base + i}]}}} for i in range(60_000)]
            removed = [{"event_id": base + 60_000 + k, "data": {"removed": {"block_hashes": [
                base + i for i in range(k * 100, k * 100 + 100)]}}} for k in range(600)]
            return (ws_frame(json.dumps(events, separators=(",", ":")).encode()),
                    ws_frame(json.dumps(removed).encode()))

        # Built before the probes start (as book_1m_*'s bodies): not in the prober's process meanwhile.
        built = [messages(n * 100_000) for n in range(1, 2 * int(opts.seconds) + 3)]
        counter = iter(range(1, 1 << 40))

        def heavy(conn: Conn) -> None:
            upgrade(conn, "/kv_events?worker_id=1&ack=true")
            n = next(counter)
            stored, removed = built[n - 1] if n <= len(built) else messages(n * 100_000)
            conn.sock.sendall(stored)
            while b"ack" not in conn.buf:
                conn.buf += conn._recv()
            conn.buf = b""
            conn.sock.sendall(removed)
            while b"ack" not in conn.buf:
                conn.buf += conn._recv()
            conn.buf = b""

        return measure(port, heavy, opts.seconds)
    finally:
        proc.terminate()
        proc.wait()


def scenario_ws_flood(opts: argparse.Namespace) -> dict[str, float]:
    """One stream sending small events, one per message, as fast as the socket takes
    them (a heavy request is 10,000 of them; 300,000 in the run docs/INVARIANTS.md gives)."""
    return _ws_flood(opts, lambda i: {"event_id": i, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": i, "tokens_hash": i}]}}})


def scenario_ws_flood_cleared(opts: argparse.Namespace) -> dict[str, float]:
    """`ws_flood` with `cleared` events: the smallest message, so the most events per byte read."""
    return _ws_flood(opts, lambda i: {"event_id": i, "data": "cleared"})


def _ws_flood(opts: argparse.Namespace, event: Callable[[int], dict[str, Any]]) -> dict[str, float]:
    proc, port = start([])
    try:
        Conn(port).call("POST", "/workers", json.dumps(worker(1)).encode())
        counter = iter(range(1 << 40))

        def heavy(conn: Conn) -> None:
            upgrade(conn, "/kv_events?worker_id=1")
            first = next(counter) * 10_000 + 1
            conn.sock.sendall(b"".join(ws_frame(json.dumps(event(i)).encode()) for i in range(first, first + 10_000)))

        return measure(port, heavy, opts.seconds)
    finally:
        proc.terminate()
        proc.wait()


def scenario_picker_echo(opts: argparse.Namespace) -> dict[str, float]:
    """ext_proc streams of a 7.7 MB text completion each (parsed and turned into text tokens in a
    thread; the body echoed back to the client in 62,000-byte pieces from the loop)."""
    return _picker({"model": "m", "prompt": "hello world " * 640_000}, opts, tokenizer=False)


def scenario_picker_tokenize(opts: argparse.Namespace) -> dict[str, float]:
    """A 4 MiB completion through the picker, tokenized by the model's tokenizer."""
    return _picker({"model": "m", "prompt": "hello world how are you ? " * 160_000}, opts, tokenizer=True)


def scenario_picker_chat(opts: argparse.Namespace) -> dict[str, float]:
    """A 220,000-message chat through the picker, rendered by the model's chat template and tokenized."""
    return _picker({"model": "m", "messages": [{"role": "user", "content": "hello"}] * 220_000}, opts,
                   tokenizer=True)


def _small_tokenizer_folder() -> str:
    """tests/test_ext_proc.py's word-level tokenizer and chat template, written to a folder."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from test_ext_proc import small_tokenizer

    text, config = small_tokenizer()
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "tokenizer.json"), "w") as fh:
        fh.write(text)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh)
    return folder


def _picker(request: dict[str, Any], opts: argparse.Namespace, tokenizer: bool) -> dict[str, float]:
    import grpc
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        grpc_port = probe.getsockname()[1]
    extra = ["--tokenizer", f"m={_small_tokenizer_folder()}"] if tokenizer else []
    proc, port = start(["--ext-proc-port", str(grpc_port), "--kv-events", "approximate", *extra])
    try:
        Conn(port).call("POST", "/workers", json.dumps(worker(1, endpoint="http://127.0.0.1:9")).encode())
        body = json.dumps(request).encode()
        messages = [ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=[
            HeaderValue(key=":path", raw_value=b"/v1/completions"), HeaderValue(key=":method", raw_value=b"POST")]))),
            ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True))]
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
            ("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)])
        stub = ExternalProcessorStub(channel)
        time.sleep(0.5)  # the picker listens a moment after the HTTP port

        def heavy(conn: Conn) -> None:
            for _ in stub.Process(iter(messages), timeout=60):
                pass

        try:
            return measure(port, heavy, opts.seconds)
        finally:
            channel.close()
    finally:
        proc.terminate()
        proc.wait()


def scenario_idle(opts: argparse.Namespace) -> dict[str, float]:
    """The baseline: nothing heavy, the other connection sleeps."""
    proc, port = start([])
    try:
        return measure(port, lambda conn: time.sleep(0.05), opts.seconds)
    finally:
        proc.terminate()
        proc.wait()


def scenario_free_bodies(opts: argparse.Namespace) -> dict[str, float]:
    """`DELETE /reservations/{id}` of an unknown id, with the largest body a free takes (16 KiB,
    docs/DECISIONS.md, "Bounds"; it was 8 MiB) ending in a NaN, which the standard library parses."""
    proc, port = start([])
    try:
        body = b'{"cached_tokens": 1, "pad": "' + b"x" * (16 * 1024 - 50) + b'", "n": NaN}'

        def heavy(conn: Conn) -> None:
            assert conn.call("DELETE", "/reservations/nowhere", body)[0] == 404

        return measure(port, heavy, opts.seconds)
    finally:
        proc.terminate()
        proc.wait()




def scenario_trickle_scrape(opts: argparse.Namespace) -> dict[str, float]:
    """16 workers whose `metrics_endpoint` answers in 1-byte chunks as fast as it can (a process of
    its own, so that its threads do not slow this one's probe), scraped every second (each scrape
    ends at its 2 s deadline or its size cap)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from test_door import TRICKLER  # one trickling engine for the test and the bench

    trickler = subprocess.Popen([sys.executable, "-c", TRICKLER], stdout=subprocess.PIPE, text=True)
    assert trickler.stdout is not None
    endpoint = f"http://127.0.0.1:{int(trickler.stdout.readline())}/metrics"
    proc, port = start(["--engine-metrics-interval-secs", "1"])
    try:
        conn = Conn(port)
        for wid in range(1, 17):
            assert conn.call("POST", "/workers", json.dumps(worker(wid, metrics_endpoint=endpoint)).encode())[0] == 201
        return measure(port, lambda conn: time.sleep(0.05), opts.seconds)
    finally:
        trickler.kill()
        trickler.wait()
        proc.terminate()
        proc.wait()


def scenario_post_events(opts: argparse.Namespace) -> dict[str, float]:
    """The same 8 MB of events as one `POST /kv_events` (not sliced: see docs/INVARIANTS.md)."""
    proc, port = start([])
    try:
        Conn(port).call("POST", "/workers", json.dumps(worker(1)).encode())
        counter = iter(range(1, 1 << 40))

        def heavy(conn: Conn) -> None:
            base = next(counter) * 100_000
            events = [{"worker_id": 1, "event": {"event_id": base + i, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": base + i, "tokens_hash": base + i}]}}}} for i in range(55_000)]
            assert conn.call("POST", "/kv_events", json.dumps(events, separators=(",", ":")).encode())[0] == 200

        return measure(port, heavy, opts.seconds)
    finally:
        proc.terminate()
        proc.wait()


def scenario_delete_bookings(opts: argparse.Namespace) -> dict[str, float]:
    """`DELETE /workers/1` of a 1,024-rank worker holding --bookings bookings (re-registered and
    re-booked between rounds; only the DELETE is in the heavy loop's timing)."""
    proc, port = start(["--max-reservations-per-key", str(opts.bookings + 10)])
    try:
        setup = Conn(port)
        state = {"round": 0}

        def book() -> None:
            setup.call("POST", "/workers", json.dumps(worker(1, data_parallel_size=1024)).encode())
            r = state["round"]
            state["round"] += 1
            batch = 2000
            for first in range(0, opts.bookings, batch):
                for i in range(first, min(first + batch, opts.bookings)):
                    setup.send("POST", "/reservations", json.dumps({
                        "model_name": "m", "reservation_id": f"r{r}-{i}", "worker_id": 1, "dp_rank": i % 1024,
                        "block_hashes": [i, i + 1], "sequence_hashes": [i, i + 1], "isl_tokens": 32}).encode())
                for _ in range(first, min(first + batch, opts.bookings)):
                    assert setup.read()[0] == 201

        book()
        times: list[float] = []

        def heavy(conn: Conn) -> None:
            t = time.perf_counter()
            assert conn.call("DELETE", "/workers/1")[0] == 200
            times.append(time.perf_counter() - t)
            book()

        out = measure(port, heavy, opts.seconds)
        out["delete_median_ms"] = 1000 * statistics.median(times)
        return out
    finally:
        proc.terminate()
        proc.wait()


def scenario_ready(opts: argparse.Namespace) -> dict[str, float]:
    """`GET /ready` with --workers records (restored from a dump at start)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"format": "selection-proto-dump/1", "keys": [], "events": [],
                   "workers": [worker(i, f"m{i // 1000}") for i in range(opts.workers)]}, fh)
    proc, port = start(["--restore", fh.name, "--max-keys", str(opts.workers // 1000 + 10)])
    try:
        def heavy(conn: Conn) -> None:
            assert conn.call("GET", "/ready")[0] == 200

        return measure(port, heavy, opts.seconds)
    finally:
        proc.terminate()
        proc.wait()
        os.unlink(fh.name)


def _select_million(setup: Callable[[Conn], None]) -> Callable[[argparse.Namespace], dict[str, float]]:
    """A scenario: `setup` on a fresh server, then `POST /select` of 1,048,576 token ids over and over."""
    def scenario(opts: argparse.Namespace) -> dict[str, float]:
        proc, port = start([])
        try:
            setup(Conn(port))
            body = json.dumps({"model_name": "m", "token_ids": list(range(1_048_576))}, separators=(",", ":")).encode()

            def heavy(conn: Conn) -> None:
                assert conn.call("POST", "/select", body)[0] == 200

            return measure(port, heavy, opts.seconds)
        finally:
            proc.terminate()
            proc.wait()

    return scenario


def _eight_workers(conn: Conn) -> None:
    """The default max_prompt_tokens' worth of prompt, 8 workers."""
    for wid in range(8):
        conn.call("POST", "/workers", json.dumps(worker(wid)).encode())


def _nine_huge_bookings(conn: Conn) -> None:
    """A worker of `block_size` 1 holding nine bookings of 850,000 sequence hashes (docs/INVARIANTS.md)."""
    conn.call("POST", "/workers", json.dumps(worker(1, block_size=1)).encode())
    for n in range(9):
        booking = {"reservation_id": f"b{n}", "worker_id": 1, "model_name": "m", "isl_tokens": 850_000,
                   "sequence_hashes": list(range(n * 850_000 + 1, (n + 1) * 850_000 + 1))}
        assert conn.call("POST", "/reservations", json.dumps(booking).encode())[0] == 201


scenario_select_1m = _select_million(_eight_workers)


def scenario_select_nan(opts: argparse.Namespace) -> dict[str, float]:
    """`POST /select` of 1,048,576 token ids ending in `NaN`: not JSON, so orjson refuses it and the
    error's text comes from another reader."""
    proc, port = start([])
    try:
        _eight_workers(Conn(port))
        body = (b'{"model_name":"m","token_ids":[' + ",".join(map(str, range(1_048_575))).encode()
                + b',NaN]}')

        def heavy(conn: Conn) -> None:
            assert conn.call("POST", "/select", body)[0] == 400

        return measure(port, heavy, opts.seconds)
    finally:
        proc.terminate()
        proc.wait()


def _book_million(mode: str) -> Callable[[argparse.Namespace], dict[str, float]]:
    """A scenario: book one 1,048,576-token prompt on a worker of block size 1, and free it half a
    second later (its request "runs"), over and over."""
    def scenario(opts: argparse.Namespace) -> dict[str, float]:
        proc, port = start(["--kv-events", mode])
        try:
            Conn(port).call("POST", "/workers", json.dumps(worker(1, block_size=1)).encode())
            # Built before the probes start: encoding 1,048,576 ids holds this process's GIL for
            # 0.1-0.5 s, which the /health prober's thread would count against the server.
            bodies = [json.dumps({"model_name": "m", "token_ids": list(range(n, n + 1_048_576)),
                                  "reservation_id": f"r{n}"}, separators=(",", ":")).encode()
                      for n in range(1, int(opts.seconds) + 3)]
            count = [0]

            def heavy(conn: Conn) -> None:
                count[0] += 1
                n = (count[0] - 1) % len(bodies) + 1  # (a body used again was freed before)
                rid, body = f"r{n}", bodies[n - 1]
                status, answer = conn.call("POST", "/select_and_reserve", body)
                assert status == 200, answer[:200]
                time.sleep(0.5)
                assert conn.call("DELETE", f"/reservations/{rid}")[0] == 200
                time.sleep(0.5)

            return measure(port, heavy, opts.seconds)
        finally:
            proc.terminate()
            proc.wait()

    return scenario


scenario_book_1m_push = _book_million("push")
scenario_book_1m_approx = _book_million("approximate")
scenario_select_booked = _select_million(_nine_huge_bookings)


def scenario_snapshot(opts: argparse.Namespace) -> dict[str, float]:
    """Periodic snapshots (`--snapshot`, every second) of --blocks indexed blocks, restored at
    start from that same file; the heavy part is waiting for the next one to be written."""
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "state.json")
    with open(path, "w") as fh:
        json.dump({"format": "selection-proto-dump/1", "keys": [], "workers": [worker(1)], "events": [
            {"worker_id": 1, "event": {"event_id": i, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": i, "tokens_hash": i}]}}}} for i in range(opts.blocks)]}, fh)
    proc, port = start(["--snapshot", path, "--snapshot-interval-secs", "1"])
    try:
        def heavy(conn: Conn) -> None:
            before = os.stat(path).st_mtime_ns
            while os.stat(path).st_mtime_ns == before:
                time.sleep(0.05)

        return measure(port, heavy, opts.seconds)
    finally:
        proc.terminate()
        proc.wait()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


SCENARIOS = {"picker_tokenize": scenario_picker_tokenize, "picker_chat": scenario_picker_chat, "select_nan": scenario_select_nan, "book_1m_push": scenario_book_1m_push,
             "book_1m_approx": scenario_book_1m_approx, "ws_events": scenario_ws_events, "ws_flood": scenario_ws_flood, "ws_flood_cleared": scenario_ws_flood_cleared, "picker_echo": scenario_picker_echo, "delete_bookings": scenario_delete_bookings,
             "ready": scenario_ready, "select_1m": scenario_select_1m,
             "select_booked": scenario_select_booked, "post_events": scenario_post_events,
             "snapshot": scenario_snapshot, "idle": scenario_idle, "free_bodies": scenario_free_bodies,
             "trickle_scrape": scenario_trickle_scrape}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--bookings", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=100_000)
    parser.add_argument("--blocks", type=int, default=200_000)
    parser.add_argument("--watch", action="store_true", help="print where the server's loop is held (bench/loop_watch.py)")
    opts = parser.parse_args()
    global WATCH
    WATCH = opts.watch
    print(f"{'scenario':<16} {'heavy n':>7} {'heavy ms':>9} {'probes':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}"
          f" {'cpu p99':>7} {'cpu max':>7}  load")
    for name in opts.scenarios.split(","):
        r = SCENARIOS[name](opts)
        print(f"{name:<16} {r['heavy_requests']:>7.0f} {r['heavy_median_ms']:>9.1f} {r['health_probes']:>7.0f} "
              f"{r['health_p50_ms']:>7.1f} {r['health_p99_ms']:>7.1f} {r['health_max_ms']:>7.1f}"
              f" {r['loop_cpu_p99_ms']:>7.0f} {r['loop_cpu_max_ms']:>7.0f}  {os.getloadavg()[0]:.1f}"
              + (f"   (DELETE alone: {r['delete_median_ms']:.1f} ms)" if "delete_median_ms" in r else ""),
              flush=True)


if __name__ == "__main__":
    main()
