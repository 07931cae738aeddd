"""Fuzz the running server over real sockets: hostile HTTP requests, WebSocket upgrades and frames
built from a dictionary of what has broken servers before (lone surrogates, integers beyond what
the interpreter parses, upgrade variants, framing conflicts, deep nesting), against a real
`selection-proto serve` subprocess. It stops at the first case after which the process is gone,
an internal error was counted, or a read no longer answers 200, and prints that case.

With `--heavy`, one more client cycles through the loads that once held the event loop or grew
memory without bound (docs/INVARIANTS.md): huge prompts beside huge bookings, a WebSocket event flood,
bodies stalled just short of their end. `/health` is then timed throughout: its p99 and maximum
are reported, and a probe over `--max-health-ms` (default 1,000) fails the run.

    python fuzz/server_fuzz.py [--seconds 600] [--seed N] [--mode push|subscribe] [--heavy]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import msgpack

HUGE = "9" * 5000
STRINGS = ["m", "default", "", "\\ud800", "\\udfff", "\\ud83d\\ude00", "\\ud83d", "a\\u0000b", "é", "\U0001F600",
           "x" * 300, "%", "%ED%A0%80", "../..", "\\\\", "tcp://[zz]:1", "ws://a..b:1/x", "ipc:///tmp/" + "y" * 200,
           "tcp://h:99999", "ws://h:" + HUGE[:30] + "/", "dynamo.topology/x"]
NUMBERS = ["0", "1", "-1", "4294967295", "4294967296", "18446744073709551615", "18446744073709551616",
           "-9223372036854775809", HUGE, "-" + HUGE, "1e400", "5e-324", "-0.0", "1.5", "0.1", "1e308", "NaN",
           "Infinity", "true", "null", "[]", "{}"]
FIELDS = ["worker_id", "model_name", "tenant_id", "routing_group", "endpoint", "block_size", "token_ids",
          "block_hashes", "sequence_hashes", "isl_tokens", "reservation_id", "selection_id", "data_parallel_size",
          "data_parallel_start_rank", "kv_events_endpoint", "kv_events_endpoints", "taints", "topology_domains",
          "router_temperature", "pinned_worker", "allowed_worker_ids", "priority_jump", "max_num_batched_tokens",
          "expected_output_tokens", "router_config_override", "event", "event_id", "data", "stored", "removed",
          "parent_hash", "blocks", "block_hash", "tokens_hash", "dp_rank", "cleared", "storage_tier", "explain",
          # 1.6.1's members (docs/DECISIONS.md, "Speaking Dynamo 1.6.1")
          "session_id", "session_context", "cache_salt", "advisory", "is_eagle", "mm_routing_info",
          "routing_token_ids", "block_mm_infos", "mm_objects", "mm_hash", "offsets", "decay_fraction",
          "replay_endpoint",
          # prefill/decode plans (docs/PD.md)
          "role", "local_prefill", "bootstrap_host", "bootstrap_port", "plan_id", "pd", "mode", "decider",
          "isl_threshold", "ratio_threshold", "uncached_tokens", "prompt_tokens", "kv_busy_fraction",
          "transfer_tokens_per_sec"]
PATHS = ["/health", "/ready", "/workers", "/workers/1", "/workers/" + HUGE, "/workers/%ED%A0%80", "/workers/+1",
         "/select", "/select_and_reserve", "/reservations", "/reservations/r1/prefill_complete", "/reservations/r1",
         "/reservations/%ff", "/loads", "/potential_loads", "/overlap_scores", "/kv_events", "/metrics",
         "/openapi.json", "/dump", "/nope", "//", "/workers/", "/reservations/r1/output_block",
         "/reservations/%ED%A0%80/output_block", "/reservations/" + HUGE + "/output_block",
         "/select_pd", "/select_pd_and_reserve", "/plans/p1/handoff", "/plans/p1", "/plans/%ff",
         "/plans/%ED%A0%80/handoff", "/plans/" + HUGE]
QUERY_KEYS = ["model_name", "tenant_id", "routing_group", "worker_id", "dp_rank", "framing", "ack", "resume"]
QUERY_VALUES = ["1", HUGE, "%ED%A0%80", "%ff", "%", "seq", "raw", "true", "x", "", "-1", "18446744073709551616"]
HOSTS = [b"host: x\r\n", b"", b"host: \xff\xfe\r\n", b"host: a..b\r\n", b"host: [::1]:80\r\n", b"host: x\r\nhost: y\r\n",
         b"host: " + b"h" * 300 + b"\r\n"]
UPGRADE = [b"upgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-version: 13\r\n"
           b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
           b"upgrade: websocket\r\nconnection: upgrade\r\nsec-websocket-version: 8\r\nsec-websocket-key: x\r\n",
           b"upgrade: h2c\r\nconnection: upgrade\r\n", b"upgrade: websocket\r\n"]


class Gen:
    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    def json_value(self, depth: int = 0) -> str:
        r = self.r
        roll = r.random()
        if depth > 4 or roll < 0.3:
            return r.choice(NUMBERS) if r.random() < 0.5 else '"' + r.choice(STRINGS) + '"'
        if roll < 0.4:
            n = r.choice([1, 65, 200, 3000])
            return "[" * n + "1" + "]" * n
        if roll < 0.6:
            return "[" + ",".join(self.json_value(depth + 1) for _ in range(r.randint(0, 5))) + "]"
        return self.json_object(depth + 1)

    def json_object(self, depth: int = 0) -> str:
        r = self.r
        members = []
        for _ in range(r.randint(0, 8)):
            key = r.choice(FIELDS) if r.random() < 0.85 else r.choice(STRINGS + [HUGE, "0", "1"])
            members.append(f'"{key}":{self.json_value(depth)}')
        return "{" + ",".join(members) + "}"

    def body(self) -> bytes:
        r = self.r
        roll = r.random()
        if roll < 0.1:
            return bytes(r.getrandbits(8) for _ in range(r.randint(0, 64)))
        if roll < 0.2:  # a valid worker with one hostile member
            base = {"worker_id": r.randint(0, 5), "endpoint": "http://w", "block_size": 4}
            text = json.dumps(base)[:-1] + f',"{r.choice(FIELDS)}":{self.json_value(3)}}}'
            return text.encode("utf-8", "surrogatepass")
        if roll < 0.3:  # events
            return f'[{{"worker_id":{r.choice(NUMBERS)},"event":{self.json_object(2)}}}]'.encode("utf-8", "surrogatepass")
        return (self.json_object() if r.random() < 0.8 else self.json_value()).encode("utf-8", "surrogatepass")

    def request(self) -> bytes:
        r = self.r
        method = r.choice(["GET", "POST", "POST", "PATCH", "DELETE", "HEAD", "PUT", "OPTIONS", "G\xc9T"])
        path = r.choice(PATHS)
        if r.random() < 0.4:
            path += "?" + "&".join(f"{r.choice(QUERY_KEYS)}={r.choice(QUERY_VALUES)}" for _ in range(r.randint(1, 3)))
        version = r.choice(["HTTP/1.1"] * 8 + ["HTTP/1.0", "HTTP/2.0", "HTTP/1.1x"])
        head = f"{method} {path} {version}\r\n".encode("utf-8", "surrogatepass")
        head += r.choice(HOSTS)
        body = self.body() if r.random() < 0.8 else b""
        media = r.choice([b"content-type: application/json\r\n"] * 6 + [
            b"content-type: application/msgpack\r\n", b"content-type: text/plain\r\n", b"",
            b"content-type: application/json; charset=\xff\r\n"])
        if b"msgpack" in media and r.random() < 0.7:
            body = self.as_msgpack(body)
        framing = r.random()
        if framing < 0.7:
            head += b"content-length: %d\r\n" % len(body)
        elif framing < 0.8:
            head += b"transfer-encoding: chunked\r\n"
            body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
        elif framing < 0.85:
            head += b"content-length: %d\r\ntransfer-encoding: chunked\r\n" % len(body)
        elif framing < 0.9:
            head += b"content-length: " + HUGE.encode() + b"\r\n"
        elif framing < 0.95:
            head += b"content-length: 9000000\r\n"
        head += media
        if path.startswith("/kv_events") and r.random() < 0.7:
            head += r.choice(UPGRADE)
        if r.random() < 0.1:
            head += b"expect: 100-continue\r\n"
        if r.random() < 0.05:
            head += b"x-big: " + b"a" * 17000 + b"\r\n"
        return head + b"\r\n" + body

    def as_msgpack(self, body: bytes) -> bytes:
        """A JSON body as msgpack, its u32 arrays sometimes as a bin (a length not a multiple of 4
        too); what does not parse as JSON stays as it is."""
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested past what json reads
            return body
        if isinstance(value, dict) and isinstance(value.get("token_ids"), list) and self.r.random() < 0.6:
            try:
                packed = b"".join(int(t).to_bytes(4, "little") for t in value["token_ids"])
            except (TypeError, ValueError, OverflowError):
                packed = bytes(self.r.getrandbits(8) for _ in range(self.r.randint(0, 9)))
            value["token_ids"] = packed[:len(packed) - self.r.choice([0, 0, 0, 1, 3])]
        try:
            return bytes(msgpack.packb(value))
        except (TypeError, ValueError, OverflowError, RecursionError):
            return body

    def frames(self) -> bytes:
        """Client WebSocket frames, mostly well formed, some not."""
        r = self.r
        out = b""
        for _ in range(r.randint(1, 4)):
            opcode = r.choice([0x1, 0x1, 0x2, 0x2, 0x0, 0x8, 0x9, 0xA, 0x3])
            payload = self.body() if opcode in (0x1, 0x0) else bytes(r.getrandbits(8) for _ in range(r.randint(0, 40)))
            if opcode == 0x2 and r.random() < 0.5:
                payload = (r.getrandbits(64)).to_bytes(8, "big") + payload
            fin = 0x80 if r.random() < 0.9 else 0
            n = len(payload)
            size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big") if n < 65536 else \
                bytes([0x80 | 127]) + n.to_bytes(8, "big")
            if r.random() < 0.05:
                size = bytes([size[0] & 0x7F]) + size[1:]  # unmasked
            key = bytes(r.getrandbits(8) for _ in range(4))
            masked = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
            out += bytes([fin | opcode]) + size + (key if size[0] & 0x80 else b"") + (masked if size[0] & 0x80 else payload)
        return out


def text_frame(payload: bytes) -> bytes:
    """A client's final text frame (masked with a zero key: the bytes stay as they are)."""
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big") if n < 65536 else \
        bytes([0x80 | 127]) + n.to_bytes(8, "big")
    return b"\x81" + size + b"\0\0\0\0" + payload


class Target:
    def __init__(self, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--kv-events",
                                      mode, "--request-timeout-secs", "1", "--keep-alive-timeout-secs", "1",
                                      "--session-affinity-ttl-secs", "5"],
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        self.port = int(json.loads(self.proc.stderr.readline())["url"].rsplit(":", 1)[1])
        self.logs: list[str] = []
        threading.Thread(target=lambda: self.logs.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]

    def send(self, data: bytes, then: bytes = b"") -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.settimeout(0.1)
            try:
                sock.sendall(data)
                if then:
                    time.sleep(0.02)
                    sock.sendall(then)
            except OSError:
                pass
            out = b""
            try:
                while len(out) < 1 << 20:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    out += chunk
            except OSError:
                pass
            return out

    def get(self, path: str, conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
        """A read the server must answer (status 0: it did not, within 10 s)."""
        conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            return 0, b""

    def problem(self) -> str | None:
        """Why the server is not fine, or None."""
        if self.proc.poll() is not None:
            return f"the process exited with {self.proc.returncode}"
        for path in ("/health", "/workers", "/loads", "/dump", "/metrics"):
            status, _ = self.get(path)
            if status != 200:
                return f"GET {path} answered {status}"
        metrics = self.get("/metrics")[1].decode()
        errors = [line for line in metrics.splitlines() if line.startswith("selection_proto_internal_errors_total{")]
        if errors:
            return "internal errors: " + "; ".join(errors) + "\n" + "".join(
                line for line in self.logs if '"internal_error"' in line)[:4000]
        return None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


def heavy_loads(target: Target, rng: random.Random, until: float) -> None:
    """The heavy shapes, one after another until `until`: each is a case the server must survive
    while answering everyone else."""
    def post(path: str, body: bytes) -> bytes:
        return target.send(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n" % (path.encode(), len(body)) + body)

    post("/workers", b'{"worker_id": 9, "model_name": "big", "endpoint": "http://w9", "block_size": 1}')
    n = 0
    while time.monotonic() < until:
        n += 1
        shape = rng.choice(("prompt", "flood", "stall"))
        if shape == "prompt":  # a huge prompt beside huge bookings, then the bookings freed
            size = rng.choice((100_000, 400_000, 850_000))
            for k in range(2):
                post("/reservations", json.dumps({"reservation_id": f"h{n}-{k}", "worker_id": 9, "model_name": "big",
                                                  "isl_tokens": size, "sequence_hashes": list(range(
                                                      k * size + 1, (k + 1) * size + 1))}).encode())
            post("/select", json.dumps({"model_name": "big", "token_ids": list(range(1 << 20))}).encode())
            for k in range(2):
                target.send(f"DELETE /reservations/h{n}-{k}?model_name=big HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        elif shape == "flood":  # thousands of small stored events on one WebSocket
            frames = b"".join(text_frame(json.dumps({"event_id": n * 100_000 + i, "data": {"stored": {
                "parent_hash": None, "blocks": [{"block_hash": i, "tokens_hash": i}]}}}).encode())
                for i in range(20_000))
            target.send(b"GET /kv_events?worker_id=1 HTTP/1.1\r\nhost: x\r\n" + UPGRADE[0] + b"\r\n", frames)
        else:  # bodies 10 bytes short of their 8 MiB, held a moment
            socks = []
            for _ in range(rng.randint(4, 16)):
                sock = socket.create_connection(("127.0.0.1", target.port), timeout=2)
                try:
                    sock.sendall(b"POST /workers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                 b"content-length: 8388608\r\n\r\n" + b" " * (8388608 - 10))
                except OSError:
                    pass  # refused past the buffer budget
                socks.append(sock)
            time.sleep(rng.uniform(0.1, 1.0))
            for sock in socks:
                sock.close()


def run(seconds: float, seed: int, mode: str = "push", clients: int = 4, check_every: int = 50,
        heavy: bool = False, max_health_ms: float = 1000.0) -> dict[str, Any]:
    """`clients` threads send cases at once (each from its own seeded generator); every
    `check_every` cases the server is checked. Returns the counts, or raises with the cases."""
    target = Target(mode)
    started = time.monotonic()
    counts = [0] * clients
    recent: list[tuple[bytes, bytes]] = []
    failure: list[str] = []
    health_ms: list[float] = []

    def prober() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=10)  # its own, kept alive
        while time.monotonic() - started < seconds and not failure:
            began = time.perf_counter()
            status, _ = target.get("/health", conn)
            health_ms.append(1000 * (time.perf_counter() - began))
            if status != 200 or health_ms[-1] > max_health_ms:
                failure.append(f"/health answered {status} in {health_ms[-1]:.0f} ms")
            time.sleep(0.01)

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        gen = Gen(rng)
        while time.monotonic() - started < seconds and not failure:
            request = gen.request()
            frames = gen.frames() if b"upgrade: websocket" in request and rng.random() < 0.8 else b""
            recent.append((request, frames))
            del recent[:-2 * clients]
            target.send(request, frames)
            counts[i] += 1

    try:
        # A worker for the streams and selections to find.
        target.send(b'POST /workers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 57\r\n\r\n'
                    b'{"worker_id": 1, "endpoint": "http://w1", "block_size": 4}')
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        if heavy:
            threads.append(threading.Thread(target=heavy_loads, args=(
                target, random.Random(seed), started + seconds)))
            threads.append(threading.Thread(target=prober))
        for thread in threads:
            thread.start()
        checked = 0
        while any(t.is_alive() for t in threads):
            time.sleep(0.05)
            if sum(counts) - checked >= check_every:
                checked = sum(counts)
                if (why := target.problem()) is not None:
                    failure.append(why)
        for thread in threads:
            thread.join()
        why = failure[0] if failure else target.problem()
        if why is not None:
            cases = "\n".join(f"{request[:600]!r} then {frames[:200]!r}" for request, frames in recent)
            raise AssertionError(f"after {sum(counts)} cases (seed {seed}): {why}\nthe latest cases:\n{cases}")
    finally:
        target.stop()
    out: dict[str, Any] = {"cases": sum(counts), "seconds": round(time.monotonic() - started, 1), "seed": seed,
                           "mode": mode}
    if health_ms:
        health_ms.sort()
        out.update(health_probes=len(health_ms), health_p99_ms=round(health_ms[int(len(health_ms) * 0.99)], 1),
                   health_max_ms=round(health_ms[-1], 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--mode", default="push", choices=("push", "subscribe"))
    parser.add_argument("--heavy", action="store_true", help="add the heavy shapes and time /health")
    parser.add_argument("--max-health-ms", type=float, default=1000.0)
    opts = parser.parse_args()
    seed = opts.seed if opts.seed is not None else random.randrange(1 << 32)
    print(json.dumps(run(opts.seconds, seed, opts.mode, heavy=opts.heavy, max_health_ms=opts.max_health_ms)))


if __name__ == "__main__":
    main()
