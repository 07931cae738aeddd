"""Hardening, round two (docs/INVARIANTS.md): no client holds the loop, buffered bytes have a budget. Over
real sockets against a real `serve` process; each test asserts the server answers afterwards."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from test_hostile import assert_healthy, get, post
from test_http import Server, read_response

MIB = 1 << 20
BODY = 8 * MIB  # the largest body a request may have


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process `pid` has used."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rejections(server: Server) -> float:
    text = get(server, "/metrics")[1].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('selection_proto_limit_rejections_total{limit="buffer_bytes"}'))


def stalled_body(server: Server) -> socket.socket:
    """A connection that sends the head of an 8 MiB body and all of it but 10 bytes, then stalls."""
    sock = server.connect()
    sock.sendall(b"POST /workers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % BODY)
    try:
        sock.sendall(b" " * (BODY - 10))
    except OSError:
        pass  # refused and closed mid-body
    return sock


def refused(sock: socket.socket) -> int | None:
    """The status the server answered on a stalled connection, if it answered."""
    sock.settimeout(0.5)
    try:
        status, _, _ = read_response(sock, bytearray())
    except (OSError, ValueError, AssertionError):
        return None
    return status


def test_stalled_bodies_stop_at_the_buffer_budget_and_the_server_answers_on() -> None:
    server = Server("--max-buffer-bytes", str(4 * BODY), "--request-timeout-secs", "30")
    try:
        before = rss_bytes(server.proc.pid)
        socks = [stalled_body(server) for _ in range(12)]
        time.sleep(0.5)
        grown = rss_bytes(server.proc.pid) - before
        assert grown < 4 * BODY + 60 * MIB, grown  # 12 x 8 MiB were sent; the budget holds 4
        assert get(server, "/health")[0] == 200
        # At most four bodies fit at once: every other connection was refused (503, or closed
        # under the client's feet while it was still sending), and counted.
        deadline = time.monotonic() + 10
        while rejections(server) < 8:
            assert time.monotonic() < deadline, rejections(server)
            time.sleep(0.1)
        statuses = [refused(s) for s in socks]
        assert set(statuses) <= {503, None} and statuses.count(503) >= 4, statuses
        for sock in socks:
            sock.close()
        time.sleep(0.3)
        # The budget came back: a body as large as allowed is taken again.
        status, _ = post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 4,'
                                             b' "endpoint": "http://w"}' + b" " * (BODY - 100))
        assert status == 201
        assert_healthy(server)
    finally:
        server.stop()


def ws_frame(payload: bytes, *, fin: bool, opcode: int) -> bytes:
    """A masked client frame (RFC 6455 §5.2)."""
    mask = os.urandom(4)
    head = bytes([(0x80 if fin else 0) | opcode, 0x80 | 127]) + struct.pack("!Q", len(payload)) + mask
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload[:64])) + payload[64:]  # only a prefix matters
    return head + masked


def test_unfinished_websocket_messages_stop_at_the_buffer_budget() -> None:
    server = Server("--max-buffer-bytes", str(2 * BODY))
    socks = []
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 4, '
                                        b'"endpoint": "http://w"}')[0] == 201
        before = rss_bytes(server.proc.pid)
        closes = 0
        for _ in range(8):
            sock = server.connect()
            sock.sendall(b"GET /kv_events?worker_id=1 HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\n"
                         b"connection: Upgrade\r\nsec-websocket-version: 13\r\n"
                         b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 101")
            try:
                sock.sendall(ws_frame(b"\x00" * (6 * MIB), fin=False, opcode=2))
            except OSError:
                pass
            socks.append(sock)
        deadline = time.monotonic() + 10
        while rejections(server) < 6:  # two 6 MiB messages fit in 16 MiB; the others were closed
            assert time.monotonic() < deadline, rejections(server)
            time.sleep(0.1)
        for sock in socks:
            sock.settimeout(0.5)
            try:
                data = sock.recv(256)
            except OSError:
                continue
            closes += b"\x03\xf5" in data[:8]  # close code 1013
        assert closes >= 1, closes
        assert rss_bytes(server.proc.pid) - before < 2 * BODY + 80 * MIB
        assert_healthy(server)
    finally:
        for sock in socks:
            sock.close()
        server.stop()


def health_latencies(server: Server, while_running: threading.Thread | None = None, count: int = 40) -> list[float]:
    """`/health` round trips, one after another, for as long as `while_running` runs (else `count`
    of them: the idle baseline), sorted."""
    seconds = []
    while while_running.is_alive() if while_running is not None else len(seconds) < count:
        started = time.perf_counter()
        assert get(server, "/health")[0] == 200
        seconds.append(time.perf_counter() - started)
        time.sleep(0.01)
    return sorted(seconds)


def loop_cpu_seconds(pid: int) -> float:
    """CPU time the process's main thread (its event loop) has used: what a /health probe waited
    for, read from outside and independent of how many other processes share the cores."""
    with open(f"/proc/{pid}/task/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def health_waits(server: Server, while_running: threading.Thread) -> tuple[list[float], list[float]]:
    """`/health` round trips on one keep-alive connection (as a load balancer's checks come)
    while `while_running` runs, and for each the CPU time the server's loop spent meanwhile (the
    stall itself, where wall time also counts the machine's other work); both sorted."""
    seconds, cpu, buf = [], [], bytearray()
    with server.connect() as sock:
        while while_running.is_alive():
            used, started = loop_cpu_seconds(server.proc.pid), time.perf_counter()
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert read_response(sock, buf)[0] == 200
            seconds.append(time.perf_counter() - started)
            cpu.append(loop_cpu_seconds(server.proc.pid) - used)
            time.sleep(0.01)
    return sorted(seconds), sorted(cpu)


def assert_its_turn(seconds: list[float], idle: list[float], p99: float | None, worst: float,
                    p50: float | None = None) -> None:
    """`/health` kept its turn while the server worked: its p50, p99 and worst round trips under the
    goals (bench/ measures the figures themselves), plus three times what the same probes took on
    the idle server moments before, so that a machine busy with other work does not fail them.
    Under coverage's tracer (the server's process is traced too) the goals count twice: tracing
    slows the flood's work more than an idle probe's."""
    def at(values: list[float], share: float) -> float:
        return values[min(len(values) - 1, int(len(values) * share))]

    traced = 2.0 if sys.gettrace() is not None else 1.0
    p50, p99, worst = (None if goal is None else goal * traced for goal in (p50, p99, worst))
    assert worst is not None

    if p50 is not None:
        assert at(seconds, 0.5) < p50 + 3 * at(idle, 0.5), (seconds[len(seconds) // 2], idle[len(idle) // 2])
    if p99 is not None:
        assert at(seconds, 0.99) < p99 + 3 * at(idle, 0.99), (seconds[-5:], idle[-5:])
    assert seconds[-1] < worst + 3 * idle[-1], (seconds[-5:], idle[-5:])


def assert_loop_turn(seconds: list[float], cpu: list[float], idle: list[float], p99: float | None,
                     worst: float) -> None:
    """`health_waits`' figures under the goals: the loop's CPU time while a probe waited, however
    busy the machine is; the round trips as `assert_its_turn` has them when the machine is quiet
    (on a loaded one they count the other processes' turns too)."""
    if p99 is not None:
        assert cpu[min(len(cpu) - 1, int(len(cpu) * 0.99))] < p99, (cpu[-5:], seconds[-5:])
    assert cpu[-1] < worst, (cpu[-5:], seconds[-5:])
    if os.getloadavg()[0] < (os.cpu_count() or 1):
        assert_its_turn(seconds, idle, p99, worst)


def store_blocks(server: Server, count: int, per_request: int = 50_000) -> None:
    """`count` single-block stored events for worker 1, each its own prefix (the costliest dump)."""
    for first in range(0, count, per_request):
        events = [{"worker_id": 1, "event": {"event_id": i + 1, "data": {"stored": {
            "parent_hash": None, "blocks": [{"block_hash": i + 1, "tokens_hash": i + 1}]}}}}
            for i in range(first, min(count, first + per_request))]
        status, report = post(server, "/kv_events", json.dumps(events).encode())
        assert status == 200 and report["failed"] == 0, report


def test_a_large_dump_is_written_by_a_child_and_health_answers_meanwhile() -> None:
    server = Server()
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 4, '
                                        b'"endpoint": "http://w"}')[0] == 201
        store_blocks(server, 150_000)  # about a second of encoding (the test's reads are in a thread)
        idle = health_latencies(server)
        dumped: list[bytes] = []
        url = f"http://127.0.0.1:{server.port}/dump"
        reader = threading.Thread(target=lambda: dumped.append(urllib.request.urlopen(url, timeout=60).read()))
        reader.start()
        seconds = health_latencies(server, reader)
        reader.join()
        document = json.loads(dumped[0])
        assert len(document["events"]) == 150_000 and document["workers"][0]["worker_id"] == 1
        assert len(seconds) >= 3, seconds  # the dump took a while, and /health was served meanwhile
        assert_its_turn(seconds, idle, None, 0.25)
        assert_healthy(server)
    finally:
        server.stop()


def test_a_huge_select_beside_huge_bookings_leaves_health_its_turn() -> None:
    """A worker of block size 1 holding bookings of 850,000 sequence hashes,
    then selections of 1,048,576 token ids; the prompt is hashed and counted in a worker thread."""
    server = Server("--max-state-bytes", str(8 << 30))
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 1, '
                                        b'"endpoint": "http://w"}')[0] == 201
        for n in range(3):
            booking = {"reservation_id": f"b{n}", "worker_id": 1, "model_name": "m", "isl_tokens": 850_000,
                       "sequence_hashes": list(range(n * 850_000 + 1, (n + 1) * 850_000 + 1))}
            assert post(server, "/reservations", json.dumps(booking).encode())[0] == 201
        body = json.dumps({"model_name": "m", "token_ids": list(range(1 << 20)), "explain": True}).encode()
        idle = health_latencies(server)
        answers: list[dict[str, Any]] = []

        def select() -> None:
            for _ in range(3):
                status, answer = post(server, "/select", body)
                assert status == 200
                answers.append(answer)

        selector = threading.Thread(target=select)
        selector.start()
        seconds, cpu = health_waits(server, selector)
        selector.join()
        assert len(answers) == 3 and answers[0]["worker_id"] == 1
        assert_loop_turn(seconds, cpu, idle, 0.1, 0.25)
        assert_healthy(server)
    finally:
        server.stop()


def upgraded(server: Server, target: str) -> socket.socket:
    """A connection made a WebSocket on `target` (its 101 read)."""
    sock = server.connect()
    sock.sendall(f"GET {target} HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                 "sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def small_text_frame(payload: bytes) -> bytes:
    """A masked client text frame of under 126 bytes (a zero mask: the payload reads as sent)."""
    assert len(payload) < 126
    return bytes([0x81, 0x80 | len(payload)]) + b"\0\0\0\0" + payload


FLOOD_EVENTS = 60_000
CLEARED_EVENTS = [json.dumps({"event_id": i, "data": "cleared"}).encode() for i in range(1, FLOOD_EVENTS + 1)]


def assert_a_flood_leaves_health_its_turn(server: Server, flood: Callable[[], None], events: int = FLOOD_EVENTS) -> None:
    """`flood` (run in a thread) sends the server `events` `cleared` events and returns once it has
    applied them: /health keeps its turn meanwhile, and every event is applied.

    Judged against the same probes on the idle server just before and after, with the flood's
    probes counted in the server's own time: their wall time times the share of a CPU the server
    got while flooded (1 on a quiet machine, 0.13-0.46 beside five other sessions on two cores,
    where a turn's 2 ms of work takes 2 to 8 times as long). The worst probes there are the
    process waiting for a CPU (1 s of wall time with 2 ms of CPU used in the turn), so the p99
    and worst goals (docs/INVARIANTS.md: 100 and 250 ms, and p50 50 ms) are bench/stalls.py's on
    a quiet machine (--scenarios idle,ws_flood_cleared). The flood should come from a raw socket
    fed from C (`sendall`): this process's GIL then does not slow the probes."""
    done: list[bool] = []
    idle = health_latencies(server)
    flooder = threading.Thread(target=lambda: (flood(), done.append(True)))
    started, cpu_before = time.perf_counter(), cpu_seconds(server.proc.pid)
    flooder.start()
    flooded = health_latencies(server, flooder)
    flooder.join()
    share = min(1.0, (cpu_seconds(server.proc.pid) - cpu_before) / (time.perf_counter() - started))
    assert done
    idle = sorted(idle + health_latencies(server))
    in_server_time = [share * wall for wall in flooded]
    traced = 2.0 if sys.gettrace() is not None else 1.0  # (assert_its_turn says why)

    def at(values: list[float], rank: float) -> float:
        return values[min(len(values) - 1, int(len(values) * rank))]

    figures = {"share": share, "probes": len(flooded), "flooded p50/p90/max": [at(flooded, 0.5), at(flooded, 0.9),
               flooded[-1]], "in server time p50/p90": [at(in_server_time, 0.5), at(in_server_time, 0.9)],
               "idle p50/p90/max": [at(idle, 0.5), at(idle, 0.9), idle[-1]]}
    assert len(flooded) >= 20, figures
    assert at(in_server_time, 0.5) < at(idle, 0.5) + 0.025 * traced, figures
    assert at(in_server_time, 0.9) < at(idle, 0.9) + 0.05 * traced, figures
    assert cleared_applied(server) == [events]
    assert_healthy(server)


def cleared_applied(server: Server) -> list[float]:
    """The `cleared` events the server has applied, as its metric reads (one line per stream kind)."""
    return [float(line.rsplit(" ", 1)[1]) for line in get(server, "/metrics")[1].decode().splitlines()
            if line.startswith("selection_proto_kv_events_total{") and 'kind="cleared",result="ok"' in line]


def test_a_websocket_event_flood_leaves_other_clients_their_turn() -> None:
    """One stream sending `cleared` events, one per message, as fast as the socket takes them: the
    most messages per byte read (a turn bounded in bytes alone held /health at a p50 of 66 ms).
    Measured as `assert_a_flood_leaves_health_its_turn` does, a stream's turn bounded in time
    gives a p50 of 4-9 ms and a p90 of 11-17 ms; one bounded at 8 KiB read a p50 of 36-46 ms
    and one reading 256 KiB at a time (the loop held for most of the flood) 530-600 ms."""
    server = Server()
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 4, '
                                        b'"endpoint": "http://w"}')[0] == 201
        frames = b"".join(small_text_frame(event) for event in CLEARED_EVENTS)
        with upgraded(server, "/kv_events?worker_id=1") as sock:
            sock.settimeout(120)  # for all of `sendall`, however busy the machine

            def flood() -> None:
                sock.sendall(frames)
                sock.shutdown(socket.SHUT_WR)  # the server applies what it read, then closes
                while sock.recv(65536):
                    pass

            assert_a_flood_leaves_health_its_turn(server, flood)
    finally:
        server.stop()


def subscribed_engine(server: Server, listener: socket.socket) -> socket.socket:
    """A fake engine on `listener`: worker 1 registered with it as its `ws://` KV-event endpoint,
    the server's subscription accepted (the 101 sent), and the listener closed, so that the
    subscription is not made again after the engine closes it."""
    import base64
    import hashlib

    endpoint = f"ws://127.0.0.1:{listener.getsockname()[1]}/events"
    assert post(server, "/workers", json.dumps({"worker_id": 1, "model_name": "m", "block_size": 4,
                                                "endpoint": "http://w", "kv_events_endpoint": endpoint}).encode())[0] == 201
    engine, _ = listener.accept()
    listener.close()
    head = b""
    while b"\r\n\r\n" not in head:
        head += engine.recv(4096)
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    engine.sendall(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                   b"sec-websocket-accept: " + accept + b"\r\n\r\n")
    return engine


def test_an_engine_flooding_a_websocket_subscription_leaves_other_clients_their_turn() -> None:
    """The same flood the other way: the server subscribed to an engine's `ws://` KV-event stream,
    and the engine sending `cleared` events, one per (unmasked) message, as fast as the socket takes
    them. A subscription's turn used to be a whole 64 KiB read (1,450 events, tens of ms); it is
    now a push stream's (transports/pump.py, TURN_SECS)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    server = Server(mode="subscribe")
    try:
        engine = subscribed_engine(server, listener)
        frames = b"".join(bytes([0x81, len(event)]) + event for event in CLEARED_EVENTS)
        close = bytes([0x88, 2]) + (1000).to_bytes(2, "big")

        def flood() -> None:
            engine.settimeout(120)  # for all of `sendall`, however busy the machine
            engine.sendall(frames + close)  # the server applies what it read, answers the close, closes
            while engine.recv(65536):
                pass

        with engine:
            assert_a_flood_leaves_health_its_turn(server, flood)
    finally:
        listener.close()
        server.stop()


def final_frame(opcode: int, payload: bytes, *, masked: bool) -> bytes:
    """One final frame; a client's `masked` with a zero key, so that its payload reads as sent."""
    n = len(payload)
    length = bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big") if n < 65536 else \
        bytes([127]) + n.to_bytes(8, "big")
    if masked:
        return bytes([0x80 | opcode, 0x80 | length[0]]) + length[1:] + b"\0\0\0\0" + payload
    return bytes([0x80 | opcode]) + length + payload


LARGE_EVENTS = 60_000
FIRST_HASH = 10**9  # (long hashes: the message is 7.7 MB, under the 8 MiB a message may have)


@pytest.mark.parametrize("direction", ["push", "subscription"])
def test_one_8_mb_websocket_message_leaves_other_clients_their_turn(direction: str) -> None:
    """One message of 60,000 stored events (7.7 MB), then a small one removing the first block,
    then a close, all sent at once: pushed into `/kv_events`, or by an engine the server subscribed
    to over `ws://`. Each is decoded in a worker thread and applied in slices (`pump.apply_large`),
    so the loop's CPU during any `/health` probe stays under round two's 250 ms; every event is
    applied, in order (the block removed after it was stored), though the close came right after.
    Applied whole on the loop, the subscription's message held a probe for 1.3 s or more of loop
    CPU (docs/INVARIANTS.md); held for a worker thread, the push stream's was lost to the close."""
    events = [{"event_id": i + 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": FIRST_HASH + i, "tokens_hash": FIRST_HASH + i}]}}} for i in range(LARGE_EVENTS)]
    large = json.dumps(events).encode()
    removed = json.dumps([{"event_id": LARGE_EVENTS + 1, "data": {"removed": {"block_hashes": [FIRST_HASH]}}}])
    masked = direction == "push"
    wire = b"".join(final_frame(opcode, payload, masked=masked) for opcode, payload in [
        (0x1, large), (0x1, removed.encode()), (0x8, (1000).to_bytes(2, "big"))])
    assert 7 * MIB < len(large) < 8 * MIB
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    server = Server(mode="subscribe" if direction == "subscription" else "push")
    try:
        if direction == "push":
            assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 4, '
                                            b'"endpoint": "http://w"}')[0] == 201
            peer = upgraded(server, "/kv_events?worker_id=1")
        else:
            peer = subscribed_engine(server, listener)
        idle = health_latencies(server)

        def send() -> None:
            peer.settimeout(120)  # for all of `sendall`, however busy the machine
            peer.sendall(wire)  # the server applies both messages, answers the close, closes
            while peer.recv(65536):
                pass

        with peer:
            sender = threading.Thread(target=send)
            sender.start()
            seconds, cpu = health_waits(server, sender)
            sender.join()
        stored = [block["block_hash"] for event in json.loads(get(server, "/dump")[1])["events"]
                  for block in event["event"]["data"]["stored"]["blocks"]]
        assert sorted(stored) == list(range(FIRST_HASH + 1, FIRST_HASH + LARGE_EVENTS))
        assert_loop_turn(seconds, cpu, idle, None, 0.25)
        assert_healthy(server)
    finally:
        listener.close()
        server.stop()


ZMQ_PUBLISHER = """
import sys, msgpack, zmq
pub = zmq.Context().socket(zmq.XPUB)
pub.setsockopt(zmq.SNDHWM, 0)  # every batch kept for the subscriber: none dropped
print(pub.bind_to_random_port("tcp://127.0.0.1"), flush=True)
pub.recv()  # the server's SUB socket has joined
print("joined", flush=True)
events, per_batch = int(sys.argv[1]), int(sys.argv[2])
batch = msgpack.packb([0.0, [["AllBlocksCleared"]] * per_batch, 0])
sys.stdin.readline()
for seq in range(1, events // per_batch + 1):
    pub.send_multipart([b"", seq.to_bytes(8, "big"), batch])
print("sent", flush=True)
sys.stdin.readline()
"""


def test_an_engine_flooding_a_zmq_subscription_leaves_other_clients_their_turn() -> None:
    """An engine (another process) publishing batches of 50 `AllBlocksCleared` events as fast as
    ZMQ takes them. The server's poller hands its loop up to 256 messages at once; they used to be
    applied whole (or in 8 KiB of payload), now in a push stream's turns (transports/pump.py,
    TURN_SECS), a turn ending between batches."""
    pytest.importorskip("zmq")
    events = 200_000  # cheaper than a WebSocket's: as many would be over in under a second
    publisher = subprocess.Popen([sys.executable, "-c", ZMQ_PUBLISHER, str(events), "50"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert publisher.stdin is not None and publisher.stdout is not None
    server = Server(mode="subscribe")
    try:
        endpoint = f"tcp://127.0.0.1:{publisher.stdout.readline().strip()}"
        assert post(server, "/workers", json.dumps({"worker_id": 1, "model_name": "m", "block_size": 4,
                                                    "endpoint": "http://w", "kv_events_endpoint": endpoint}).encode())[0] == 201
        assert publisher.stdout.readline().strip() == "joined"

        def flood() -> None:
            assert publisher.stdin is not None and publisher.stdout is not None
            publisher.stdin.write("go\n")
            publisher.stdin.flush()
            assert publisher.stdout.readline().strip() == "sent"
            deadline = time.monotonic() + 120  # however busy the machine
            while cleared_applied(server) != [events] and time.monotonic() < deadline:
                time.sleep(0.1)

        assert_a_flood_leaves_health_its_turn(server, flood, events)
    finally:
        server.stop()
        publisher.kill()
        publisher.wait()


def test_stdio_answers_as_fast_with_hundreds_of_zmq_subscriptions() -> None:
    """Each ZMQ subscription used to hold a worker thread of its own (and anyio's default thread
    limiter, which stdio's writes wait on): past ~40 of them, each answer waited ~100 ms."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "subscribe"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None

    def call(rid: int, method: str, **params: object) -> dict[str, object]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params}).encode()
                         + b"\n")
        proc.stdin.flush()
        answer: dict[str, object] = json.loads(proc.stdout.readline())
        assert answer["id"] == rid, answer
        return answer

    def healths(first: int) -> list[float]:
        seconds = []
        for rid in range(first, first + 60):
            started = time.perf_counter()
            assert call(rid, "health")["result"] == {"status": "ok"}
            seconds.append(time.perf_counter() - started)
        return sorted(seconds)

    try:
        idle = healths(10_000)
        with socket.socket() as probe:  # a port nobody listens on: ZMQ retries connecting quietly
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        for wid in range(300):
            answer = call(wid, "workers.create", worker_id=wid, model_name="m", endpoint="http://w",
                          block_size=4, kv_events_endpoint=f"tcp://127.0.0.1:{port}")
            assert "result" in answer, answer
        time.sleep(0.5)
        seconds = healths(1000)  # p50 under 10 ms and the worst under 100 ms, as idle allows
        assert seconds[30] < 0.01 + 3 * idle[30] and seconds[-1] < 0.1 + 3 * idle[-1], (seconds[-5:], idle[-5:])
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0


def test_subscriptions_and_connections_fit_the_descriptor_limit() -> None:
    """Under `ulimit -n 256` with 64 connections allowed, subscriptions are capped so that both fit
    (with room for accepts): a worker asking for more is refused at registration, and the process
    answers on while the subscriptions it took hang on peers that never answer."""
    with socket.socket() as listener:  # accepts (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        port = listener.getsockname()[1]
        server = Server("--max-connections", "64", mode="subscribe", open_files=256)
        try:
            assert any('"max_subscriptions_lowered"' in line and '"to":128' in line for line in server.logs)

            def worker(wid: int, size: int) -> bytes:
                return json.dumps({"worker_id": wid, "model_name": "m", "endpoint": "http://w", "block_size": 4,
                                   "data_parallel_size": size, "kv_events_endpoints": {
                                       str(r): f"ws://127.0.0.1:{port}/e{r}" for r in range(size)}}).encode()

            status, body = post(server, "/workers", worker(1, 1024))
            assert (status, body["error"]) == (409, "subscription limit reached: at most 128 outbound "
                                                    "KV-event subscriptions"), body
            idle = health_latencies(server)  # before the subscriptions hang on the silent peer
            assert post(server, "/workers", worker(2, 120))[0] == 201
            assert_its_turn(health_latencies(server, count=20), idle, None, 0.25)
            assert_healthy(server)
            assert not any('"accept_failed"' in line for line in server.logs)
        finally:
            server.stop()


def test_hostile_worker_speeds_and_eagle_flags_are_refused_and_the_server_answers_on() -> None:
    """The new members of a worker record (`is_eagle`, `prefill_tokens_per_sec`) over a real
    socket: a 5,000-digit number, a lone surrogate, the wrong types; each a 422, nothing stored."""
    server = Server()
    try:
        head = b'{"worker_id": 1, "model_name": "m", "block_size": 4, "endpoint": "http://w", '
        for member in (b'"prefill_tokens_per_sec": 1' + b"0" * 5000, b'"prefill_tokens_per_sec": 1e999',
                       b'"prefill_tokens_per_sec": "\\ud800"', b'"prefill_tokens_per_sec": [1]',
                       b'"is_eagle": 1', b'"is_eagle": "true"', b'"is_eagle": {"a": true}'):
            status, body = post(server, "/workers", head + member + b"}")
            assert status in (400, 422), (member[:40], body)
        assert json.loads(get(server, "/workers")[1]) == []
        assert post(server, "/workers", head + b'"prefill_tokens_per_sec": 2500.5, "is_eagle": false}')[0] == 201
        assert_healthy(server)
    finally:
        server.stop()


def test_a_huge_openai_body_through_the_picker_leaves_health_its_turn() -> None:
    """The picker parsed, tokenized and hashed a body on the event loop (a 2 MiB text
    completion held `/health` 1.8-2.5 s, a 220,000-message chat 4-5 s); now in a worker thread, as
    HTTP bodies are. (A million-block booking: `test_a_million_block_booking_and_its_free_leave_health_its_turn`.)"""
    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
    from test_ext_proc import body, completion, headers

    server = Server("--ext-proc-port", "0", "--max-state-bytes", str(8 << 30), mode="approximate")
    try:
        target = server.ext_proc_url().removeprefix("grpc://")
        assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 16, '
                                        b'"endpoint": "http://127.0.0.1:9"}')[0] == 201
        idle = health_latencies(server)
        text = completion("a few words of text, " * 100_000)  # 2.1 MB of text
        chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"m{i}"}
                                                      for i in range(200_000)]}).encode()  # 7.6 MB
        tokens = completion(list(range(1 << 17)))  # 131,072 token ids (their booking is loop work)
        answers: list[Any] = []

        def route() -> None:
            with grpc.insecure_channel(target) as channel:
                stub = ExternalProcessorStub(channel)
                for payload in (text, chat, tokens):
                    pieces = [payload[i:i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]
                    messages = [headers(), *(body(p, end=i == len(pieces) - 1) for i, p in enumerate(pieces))]
                    answers.append(next(stub.Process(iter(messages), timeout=120)))

        router = threading.Thread(target=route)
        router.start()
        seconds = health_latencies(server, router)
        router.join()
        assert len(answers) == 3 and all(a.HasField("request_headers") for a in answers), answers
        # Under 0.5 s (it was 1.8-5 s): sending a 7.6 MB body on in 62 KB gRPC messages, and the
        # booking, are still loop work (docs/GATEWAY.md).
        assert_its_turn(seconds, idle, None, 0.5)
        assert_healthy(server)
    finally:
        server.stop()


def test_a_million_block_prediction_leaves_health_its_turn_while_it_lives() -> None:
    """Approximate mode, a booking of 1,048,576 tokens at block size 1: its load and predicted
    blocks (seconds of work) are counted after its answer, a piece at a time, /health served
    between pieces; a call that reads them waits for the rest. Then /health answers at its idle
    pace again: the server no longer reads the whole million-block batch after every request."""
    server = Server("--kv-events", "approximate", "--max-state-bytes", str(8 << 30))
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 1, '
                                        b'"endpoint": "http://w"}')[0] == 201
        idle = health_latencies(server)
        body = json.dumps({"model_name": "m", "token_ids": list(range(1 << 20)), "reservation_id": "r"}).encode()
        assert post(server, "/select_and_reserve", body)[0] == 200
        # (How long /health waits meanwhile is measured in bench/stalls.py, book_1m_approx.)
        status, loads = get(server, "/loads")  # waits for the pieces still to run
        assert status == 200 and json.loads(loads)[0]["loads"][0]["potential_decode_blocks"] == 1 << 20
        assert_its_turn(health_latencies(server, count=40), idle, 0.05, 0.1)
        assert post(server, "/select", json.dumps({"model_name": "m", "token_ids": list(range(4096))}).encode(),
                    )[1]["cached_tokens"] == 4096  # the prediction lives
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_million_block_prediction_expires_leaving_health_its_turn() -> None:
    """Approximate mode, a prompt of 1,048,576 blocks predicted for 4 s: at its expiry the blocks
    leave the index a slice a tick, /health served between slices (the whole million in one tick
    held the loop 1.2 s of CPU and more; a slice 10-22 ms, docs/INVARIANTS.md)."""
    server = Server("--kv-events", "approximate", "--router-ttl-secs", "4", "--max-state-bytes", str(8 << 30))
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 1, '
                                        b'"endpoint": "http://w"}')[0] == 201
        idle = health_latencies(server)
        body = json.dumps({"model_name": "m", "token_ids": list(range(1 << 20)), "reservation_id": "r"}).encode()
        probe = json.dumps({"model_name": "m", "token_ids": list(range(4096))}).encode()
        assert post(server, "/select_and_reserve", body)[0] == 200
        assert get(server, "/loads")[0] == 200  # the booking's pieces have run
        assert post(server, "/select", probe)[1]["cached_tokens"] == 4096  # predicted, not yet expired
        expired = threading.Event()

        def until_expired() -> None:  # the prompt's head leaves last (tail first)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not expired.is_set():
                if post(server, "/select", probe)[1]["cached_tokens"] == 0:
                    expired.set()
                time.sleep(0.5)

        watcher = threading.Thread(target=until_expired)
        watcher.start()
        seconds, cpu = health_waits(server, watcher)
        watcher.join()
        assert expired.is_set()
        assert len(seconds) >= 20, seconds
        assert_loop_turn(seconds, cpu, idle, None, 0.15)
        assert server.proc.poll() is None
    finally:
        server.stop()


# A client of its own process (its JSON work must not hold the prober's GIL): books a prompt of
# 1,048,576 tokens (its first token id from argv[2]), reads the answer, frees it half a second
# later; then the next (bench/stalls.py, book_1m_*).
BOOKER = r"""
import http.client, json, sys, time
port, firsts = int(sys.argv[1]), [int(n) for n in sys.argv[2].split(",")]
bodies = [json.dumps({"model_name": "m", "token_ids": list(range(first, first + (1 << 20))),
                      "reservation_id": f"r{n}"}).encode() for n, first in enumerate(firsts)]
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
for n, body in enumerate(bodies):
    conn.request("POST", "/select_and_reserve", body, {"content-type": "application/json"})
    answer = conn.getresponse()
    hashes = json.loads(answer.read())["sequence_hashes"]
    assert answer.status == 200 and len(hashes) == 1 << 20, answer.status
    time.sleep(0.5)
    conn.request("DELETE", f"/reservations/r{n}")
    freed = conn.getresponse()
    assert freed.status == 200 and freed.read()
    time.sleep(0.5)
print("booked", flush=True)
"""


# Approximate mode: a third prompt grows the index's lookup table and the predictions' expiry
# times past 2.8 million entries, where one dict would double; the first again searches its edge.
# Its bound is the goal itself (250 ms of loop CPU a probe): its worst probe measured 0.05-0.09 s
# on some days and 0.13-0.18 s on others, at the same commit (docs/INVARIANTS.md).
@pytest.mark.parametrize(("mode", "firsts", "worst"), [("push", "1,2", 0.15), ("approximate", "1,2,3,1", 0.25)])
def test_a_million_block_booking_and_its_free_leave_health_its_turn(mode: str, firsts: str, worst: float) -> None:
    """A prompt of 1,048,576 tokens booked on a worker of block size 1 and freed, then another, by
    another process: /health waited for all of a booking's deferred pieces (0.4-3.4 s), and its
    answer's million hashes were built on the loop (push: 0.22-0.33 s of loop CPU per probe at
    worst, approximate 1.0 s and more; then 0.03-0.06 s and 0.24-0.28 s, approximate mode's
    pieces held by the index's lookup table and the predictions' expiry times rehashing as they
    grew past a million entries; now in shards that double one at a time, 0.05-0.09 s,
    docs/INVARIANTS.md "Round three")."""
    server = Server("--max-state-bytes", str(8 << 30), mode=mode)
    try:
        assert post(server, "/workers", b'{"worker_id": 1, "model_name": "m", "block_size": 1, '
                                        b'"endpoint": "http://w"}')[0] == 201
        idle = health_latencies(server)
        booker = subprocess.Popen([sys.executable, "-c", BOOKER, str(server.port), firsts], stdout=subprocess.PIPE, text=True)
        assert booker.stdout is not None
        watcher = threading.Thread(target=booker.wait)
        watcher.start()
        seconds, cpu = health_waits(server, watcher)
        watcher.join()
        assert booker.returncode == 0 and booker.stdout.read() == "booked\n"
        assert len(seconds) >= 20, seconds  # /health was served all along
        assert_loop_turn(seconds, cpu, idle, None, worst)
        assert json.loads(get(server, "/loads")[1])[0]["loads"][0]["potential_decode_blocks"] == 0
        assert server.proc.poll() is None
    finally:
        server.stop()
