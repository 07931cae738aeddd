"""Fault and load tests over real loopback sockets, bounded in count and time. After each: every
acknowledged booking and event is accounted for, /loads is consistent, and the server answers."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import msgpack
from test_http import Server, read_response, request
from websockets.sync.client import connect


def http(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    with server.connect() as sock:
        sock.sendall(request(method, path, body))
        status, _, payload = read_response(sock, bytearray())
        return status, json.loads(payload)


def register(server: Server, workers: int = 4) -> None:
    for wid in range(1, workers + 1):
        assert http(server, "POST", "/workers", {"worker_id": wid, "endpoint": f"http://w{wid}",
                                                 "block_size": 4})[0] == 201


def test_disconnects_mid_request_change_nothing() -> None:
    s = Server()
    try:
        body = json.dumps({"worker_id": 7, "endpoint": "e", "block_size": 4}).encode()
        for cut in (10, 40):  # inside the headers, then inside the body
            whole = request("POST", "/workers", {"worker_id": 7, "endpoint": "e", "block_size": 4})
            with s.connect() as sock:
                sock.sendall(whole[: len(whole) - len(body) + cut - 40] if cut == 10 else whole[:-5])
            time.sleep(0.1)
        assert http(s, "GET", "/workers") == (200, [])
        assert http(s, "GET", "/health")[0] == 200
    finally:
        assert s.stop() == 0


def test_slowloris_does_not_stall_others() -> None:
    s = Server("--request-timeout-secs", "1")
    slow = [s.connect() for _ in range(20)]
    try:
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(3):
            start = time.monotonic()
            assert http(s, "GET", "/health")[0] == 200
            assert time.monotonic() - start < 0.5
            for sock in slow:
                sock.sendall(b"x")  # one more byte of a header that never ends
            time.sleep(0.2)
        time.sleep(1.0)
        for sock in slow:
            sock.settimeout(3)
            data = sock.recv(4096)
            assert data.startswith(b"HTTP/1.1 408") or data == b""
    finally:
        for sock in slow:
            sock.close()
        assert s.stop() == 0


def test_publisher_reconnects_with_a_gap() -> None:
    s = Server()
    try:
        register(s, 1)
        url = f"ws://127.0.0.1:{s.port}/kv_events?worker_id=1&framing=seq&ack=true"

        def batch(h: int, tokens: list[int], parent: int | None) -> bytes:
            return msgpack.packb([0, [["BlockStored", [h], parent, tokens, 4, None, None, None, None]], 0])

        with connect(url) as ws:
            ws.send((1).to_bytes(8, "big") + batch(1, [1, 2, 3, 4], None))
            ws.send((2).to_bytes(8, "big") + batch(2, [5, 6, 7, 8], 1))
            assert json.loads(ws.recv(timeout=5)) == {"ack": 1}
            assert json.loads(ws.recv(timeout=5)) == {"ack": 2}
            ws.socket.sendall(bytes([0x82, 0x80 | 50]) + b"\x00\x00\x00\x00" + b"\x00" * 10)
            ws.socket.shutdown(socket.SHUT_RDWR)
        with connect(url) as ws:
            ws.send((5).to_bytes(8, "big") + batch(3, [9, 10, 11, 12], 2))
            assert json.loads(ws.recv(timeout=5)) == {"ack": 1}
        _, answer = http(s, "POST", "/overlap_scores", {"token_ids": list(range(1, 13))})
        assert answer["workers"][0]["device_blocks"] == 3
        fresh = answer["freshness"][0]
        assert (fresh["event_gaps"], fresh["missing_events"], fresh["stale"]) == (1, 2, True)
    finally:
        assert s.stop() == 0


def test_stdio_peer_closing_mid_request() -> None:
    proc = subprocess.run([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "push"],
                          input=b'{"jsonrpc":"2.0","id":1,"method":"health"}\n{"jsonrpc":"2.0","id":2,"meth',
                          capture_output=True, timeout=60)
    assert proc.returncode == 0
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert answers[0] == {"jsonrpc": "2.0", "id": 1, "result": {"status": "ok"}}
    assert answers[1]["error"]["code"] == -32700  # the cut line is still answered, as a parse error


async def _client(port: int, rounds: int, n: int, statuses: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    buf = b""

    async def call(method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        nonlocal buf
        writer.write(request(method, path, body))
        await writer.drain()
        while b"\r\n\r\n" not in buf:
            buf += await reader.read(65536)
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0].split(b":")[1])
        while len(rest) < length:
            rest += await reader.read(65536)
        buf = rest[length:]
        status = int(head.split()[1])
        statuses.append(status)
        return status, rest[:length]

    for r in range(rounds):
        status, body = await call("POST", "/select_and_reserve", {"token_ids": list(range(r, r + 16)),
                                                                  "reservation_id": f"c{n}-r{r}"})
        if status == 200:
            rid = json.loads(body)["reservation_id"]
            await call("POST", f"/reservations/{rid}/prefill_complete")
            await call("DELETE", f"/reservations/{rid}")
    writer.close()


def test_load_64_clients_while_events_stream() -> None:
    s = Server()
    try:
        register(s, 4)
        statuses: list[int] = []
        stop = False

        def publish() -> int:
            sent = 0
            with connect(f"ws://127.0.0.1:{s.port}/kv_events?worker_id=1") as ws:
                while not stop and sent < 2000:
                    ws.send(json.dumps({"event_id": sent + 1, "data": {"stored": {"parent_hash": None, "blocks": [
                        {"block_hash": sent + 1, "tokens_hash": sent + 7}]}}}))
                    sent += 1
                    time.sleep(0.002)
            return sent

        async def main() -> int:
            publisher = asyncio.get_running_loop().run_in_executor(None, publish)
            await asyncio.wait_for(asyncio.gather(*(_client(s.port, 15, n, statuses) for n in range(64))),
                                   timeout=240)
            nonlocal stop
            stop = True
            return await publisher

        sent = asyncio.run(main())
        assert len(statuses) == 64 * 15 * 3 and set(statuses) == {200}
        _, loads = http(s, "GET", "/loads")
        assert all(load["active_requests"] == 0 and load["potential_prefill_tokens"] == 0
                   and load["potential_decode_blocks"] == 0 for load in loads[0]["loads"])
        _, answer = http(s, "POST", "/overlap_scores", {"token_ids": [1, 2, 3, 4]})
        assert answer["freshness"][0]["last_event_id"] == sent
    finally:
        assert s.stop() == 0


def test_sigterm_under_load_answers_or_closes_cleanly() -> None:
    s = Server()
    register(s, 2)
    results: list[str] = []

    async def hammer(n: int) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            for _ in range(200):
                writer.write(request("POST", "/select", {"token_ids": [n, 1, 2, 3]}))
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                length = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0]
                             .split(b":")[1])
                await reader.readexactly(length)
                results.append(head.split()[1].decode())
                if b"connection: close" in head.lower():
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            results.append("closed")

    async def main() -> None:
        tasks = [asyncio.create_task(hammer(n)) for n in range(16)]
        await asyncio.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)

    asyncio.run(main())
    assert s.proc.wait(timeout=20) == 0
    assert set(results) <= {"200", "503", "closed"} and "200" in results


def test_a_client_that_never_reads_is_aborted() -> None:
    s = Server("--request-timeout-secs", "1")
    try:
        stuck = s.connect()
        burst = request("GET", "/openapi.json") * 2000  # 40 MB of answers, far beyond any buffer
        stuck.setblocking(False)
        try:
            stuck.sendall(burst)
        except BlockingIOError:
            pass
        time.sleep(3)  # never read: the server's send stalls, and it gives up after 1 s
        with s.connect() as sock:
            sock.sendall(request("GET", "/metrics"))
            text = read_response(sock, bytearray())[2].decode()
        assert 'selection_proto_connections{kind="http"} 1.0' in text  # only this one is left
        stuck.close()
    finally:
        assert s.stop() == 0
