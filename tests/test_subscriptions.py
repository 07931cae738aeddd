"""Outbound subscriptions over real sockets: a pyzmq PUB publishing vLLM batches, and a WebSocket
engine endpoint served by the `websockets` package; both reach the index with no relay."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from test_http import Server, read_response, request
from websockets.sync.server import serve as ws_serve

B = [14643705804678351452, 16777012769546811212]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_batch(hashes: list[int], tokens: list[int], parent: int | None = None) -> bytes:
    return msgpack.packb([time.time(), [["BlockStored", hashes, parent, tokens, 4, None, "GPU", None, None]], 0])


def http(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request(method, path, body))
        status, _, payload = read_response(sock, bytearray())
        return status, json.loads(payload)


def wait_for(check: Callable[[], bool], seconds: float = 10.0, step: Callable[[], None] | None = None) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if step is not None:
            step()
        if check():
            return True
        time.sleep(0.1)
    return False


def device_blocks(port: int) -> dict[int, int]:
    _, answer = http(port, "POST", "/overlap_scores", {"token_ids": list(range(1, 9))})
    return {row["worker_id"]: row["device_blocks"] for row in answer["workers"]}


def test_zmq_publisher_feeds_the_index_directly() -> None:
    zport = free_port()
    context = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{zport}")
    server = Server(mode="subscribe")
    try:
        status, record = http(server.port, "POST", "/workers", {
            "worker_id": 1, "endpoint": "http://w1", "block_size": 4,
            "kv_events_endpoint": f"tcp://127.0.0.1:{zport}"})
        assert status == 201 and record["lifecycle"] == "schedulable"
        seq = iter(range(1, 1000))

        def publish() -> None:  # PUB/SUB drops messages until the subscriber has joined
            pub.send_multipart([b"", next(seq).to_bytes(8, "big"), vllm_batch([11, 12], list(range(1, 9)))])

        assert wait_for(lambda: device_blocks(server.port) == {1: 2}, step=publish)
        pub.send_multipart([b"only-two-frames", b"x"])
        assert wait_for(lambda: "bad_zmq_frames" in http_text(server.port, "/metrics"))
        status, _ = http(server.port, "DELETE", "/workers/1")
        assert status == 200
    finally:
        assert server.stop() == 0
        pub.close(linger=0)


def http_text(port: int, path: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request("GET", path))
        return read_response(sock, bytearray())[2].decode()


def subscribed_to(handler: Any, **options: Any) -> tuple[Any, Server]:
    """A WebSocket engine serving `handler` on loopback, and a server with worker 1 subscribed to it."""
    wport = free_port()
    engine = ws_serve(handler, "127.0.0.1", wport, **options)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    server = Server(mode="subscribe")
    http(server.port, "POST", "/workers", {"worker_id": 1, "endpoint": "http://w1", "block_size": 4,
                                          "kv_events_endpoint": f"ws://127.0.0.1:{wport}/events"})
    return engine, server


def test_websocket_engine_endpoint_with_reconnect() -> None:
    connections: list[int] = []

    def handler(ws: Any) -> None:
        connections.append(1)
        if len(connections) == 1:
            ws.send(json.dumps([{"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": 101, "tokens_hash": B[0]}]}}}]))
            time.sleep(0.3)
            return  # the engine drops the connection: the service reconnects with backoff
        ws.send(vllm_batch([102], [5, 6, 7, 8], parent=101))
        try:
            ws.recv(timeout=30)
        except Exception:  # noqa: BLE001 - the service closes the subscription at the end
            pass

    engine, server = subscribed_to(handler)
    try:
        assert wait_for(lambda: device_blocks(server.port) == {1: 2})
        assert len(connections) == 2
        _, answer = http(server.port, "POST", "/overlap_scores", {"token_ids": list(range(1, 9))})
        fresh = answer["freshness"][0]
        assert fresh["open_streams"] == 1 and fresh["stale"] is True  # a reconnect without proof
        assert 'selection_proto_kv_subscription_failures_total{scheme="ws",reason="closed"}' in http_text(
            server.port, "/metrics")
    finally:
        assert server.stop() == 0
        engine.shutdown()


def counter(port: int, family: str, label: str) -> float:
    """The sum of `family`'s samples whose labels include `label`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in http_text(port, "/metrics").splitlines()
               if line.startswith(family + "{") and label in line)


def test_large_websocket_messages_apply_in_order_and_bad_ones_drop_as_small_ones_do() -> None:
    """An engine's messages over 256 KiB are decoded in a worker thread and applied in slices, as a
    push stream's are: in order between small ones (the block removed after the large message
    stored it stays removed), and a malformed large one dropped and counted as a malformed small
    one is, the subscription kept."""
    connections: list[int] = []

    def stored(first: int, count: int) -> str:
        return json.dumps([{"event_id": first + i, "data": {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": first + i, "tokens_hash": first + i}]}}} for i in range(count)])

    malformed_large = "[" + '{"event_id": 1},' * 20_000 + "1]"
    large = stored(1, 6000)
    assert min(len(malformed_large), len(large)) > 256 * 1024

    def handler(ws: Any) -> None:
        connections.append(1)
        for message in ["[1]", malformed_large, large, json.dumps([
                {"event_id": 6001, "data": {"removed": {"block_hashes": [1]}}}]), stored(6002, 1)]:
            ws.send(message)
        try:
            ws.recv(timeout=30)
        except Exception:  # noqa: BLE001 - the service closes the subscription at the end
            pass

    engine, server = subscribed_to(handler, max_size=None)
    try:
        expected = [*range(2, 6001), 6002]

        def stored_blocks() -> list[int]:
            dump = http(server.port, "GET", "/dump")[1]
            return sorted(block["block_hash"] for event in dump["events"]
                          for block in event["event"]["data"]["stored"]["blocks"])

        assert wait_for(lambda: stored_blocks() == expected, 30), stored_blocks()[:5]
        dropped = "selection_proto_kv_events_dropped_total"
        assert counter(server.port, dropped, 'reason="invalid_message"') == 2
        assert counter(server.port, dropped, "") == 2
        assert counter(server.port, "selection_proto_internal_errors_total", "") == 0
        assert counter(server.port, "selection_proto_kv_subscription_failures_total", "") == 0
        assert connections == [1]
    finally:
        assert server.stop() == 0
        engine.shutdown()


def test_unreachable_endpoints_are_retried_and_counted() -> None:
    dead = free_port()
    server = Server(mode="subscribe")
    try:
        status, record = http(server.port, "POST", "/workers", {
            "worker_id": 1, "endpoint": "http://w1", "block_size": 4, "kv_events_endpoint": f"ws://127.0.0.1:{dead}/"})
        assert record["lifecycle"] == "schedulable"  # a failed connection does not change the lifecycle
        assert wait_for(lambda: 'reason="connect"} 2.0' in http_text(server.port, "/metrics")
                        or 'reason="connect"} 3.0' in http_text(server.port, "/metrics"), seconds=5)
        assert http(server.port, "POST", "/select", {"token_ids": [1, 2, 3, 4]})[0] == 200
        # /ready stays ready (the worker is schedulable) and says which subscription fails.
        status, ready = http(server.port, "GET", "/ready")
        assert status == 200 and ready["details"] == [
            f"worker 1 dp_rank 0: no KV-event subscription to ws://127.0.0.1:{dead}/"]
    finally:
        assert server.stop() == 0
