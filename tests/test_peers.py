"""Starting warm from a peer (`--indexer-peers`, docs/DECISIONS.md), with real servers: the first peer whose
`/dump` restores is used, unreachable, hostile and silent peers are skipped, and the service starts
empty when none answers."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

from tests.interop.test_services import Http
from tests.test_http import Server


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return Http(port, "tenant_id").call(method, path, body)

WORKER = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1:8000", "block_size": 4}
EVENTS = [{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
    {"block_hash": 11, "tokens_hash": 111}, {"block_hash": 12, "tokens_hash": 112}]}}}}]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_peer(answer: bytes | None) -> tuple[int, threading.Event]:
    """A peer that answers `answer` to anything (None: accepts and never answers)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        if answer is not None:
            conn.sendall(answer)
            conn.close()
        stop.wait(30)
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1]), stop


def overlap(server: Server) -> Any:
    return call(server.port, "POST", "/overlap_scores", {"model_name": "m", "block_hashes": [111, 112],
                                                          "sequence_hashes": [1, 2], "isl_tokens": 8})[1]


def test_the_first_peer_that_restores_is_used() -> None:
    source = Server()
    garbage, stop_garbage = fake_peer(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n[1,2]")
    broken, stop_broken = fake_peer(b"HTTP/1.1 500 Oops\r\ncontent-length: 0\r\n\r\n")
    try:
        assert call(source.port, "POST", "/workers", WORKER)[0] == 201
        assert call(source.port, "POST", "/kv_events", EVENTS)[0] == 200
        peers = [f"http://127.0.0.1:{p}" for p in (closed_port(), garbage, broken, source.port)]
        warm = Server("--indexer-peers", ",".join(peers), "--indexer-peer-timeout-secs", "5")
        try:
            status, ready = call(warm.port, "GET", "/ready")
            assert status == 200 and ready["recovered_from"] == peers[-1]
            # The catalog is restored; the verdict is evidence gathered live, not part of a dump.
            records = lambda port: [{k: v for k, v in r.items() if k != "kv_routing"}  # noqa: E731
                                    for r in call(port, "GET", "/workers")[1]]
            assert records(warm.port) == records(source.port)
            assert overlap(warm)["workers"][0]["device_blocks"] == 2
            failed = [json.loads(line) for line in warm.logs if "peer_recovery_failed" in line]
            assert [f["peer"] for f in failed] == peers[:3]
            assert "HTTP 500" in failed[2]["detail"] and "invalid dump" in failed[1]["detail"]
        finally:
            warm.stop()
    finally:
        source.stop()
        stop_garbage.set()
        stop_broken.set()


def test_a_silent_peer_times_out_and_the_service_starts_empty() -> None:
    silent, stop = fake_peer(None)
    try:
        server = Server("--indexer-peers", f"http://127.0.0.1:{silent}", "--indexer-peer-timeout-secs", "0.5")
        try:
            status, ready = call(server.port, "GET", "/ready")
            assert status == 503 and "recovered_from" not in ready
            assert any("no_reachable_peers" in line for line in server.logs)
        finally:
            server.stop()
    finally:
        stop.set()
