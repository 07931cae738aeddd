"""Surviving a restart of one instance: `--snapshot` written by a forked child and at shutdown,
restored at start; `/readyz` and `--drain-delay-secs` for load balancers (docs/DECISIONS.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from test_http import Server, read_response, request

from selection_proto import block_hashes

WORKER = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
PROMPT = {"model_name": "m", "token_ids": [5, 6, 7, 8]}


def call(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    with server.connect() as sock:
        sock.sendall(request(method, path, body))
        status, headers, payload = read_response(sock, bytearray())
    is_json = headers.get("content-type", "").startswith("application/json")
    return status, json.loads(payload) if is_json else payload.decode()


def events(first: int, count: int, prompt: bool = False) -> list[dict[str, Any]]:
    """`count` one-block stores; with `prompt`, the first is the block of PROMPT's tokens."""
    tokens_hash = block_hashes(PROMPT["token_ids"], 4)[0]
    return [{"worker_id": 1, "event": {"event_id": first + i, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": 1000 + first + i,
                                         "tokens_hash": tokens_hash if prompt and i == 0 else 7 + first + i}]}}}}
        for i in range(count)]


def test_a_periodic_snapshot_and_the_last_one_bring_a_restart_back(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    s = Server("--snapshot", str(path), "--snapshot-interval-secs", "1")
    try:
        assert call(s, "POST", "/workers", WORKER)[0] == 201
        assert call(s, "POST", "/kv_events", events(1, 50, prompt=True))[0] == 200
        scores = call(s, "POST", "/overlap_scores", PROMPT)[1]
        deadline = time.monotonic() + 20
        while not any('"snapshot written"' in line for line in s.logs) and time.monotonic() < deadline:
            time.sleep(0.1)
        periodic = json.loads(path.read_bytes())
        assert [w["worker_id"] for w in periodic["workers"]] == [1]
        metrics = call(s, "GET", "/metrics")[1]
        assert 'selection_proto_snapshots_total{result="ok"}' in metrics
        assert call(s, "POST", "/kv_events", events(51, 10))[0] == 200  # only the last snapshot has these
        dump = call(s, "GET", "/dump")[1]
    finally:
        assert s.stop() == 0
    assert json.loads(path.read_bytes())["events"] == dump["events"]
    assert len(dump["events"]) == 60
    assert not list(tmp_path.glob("*.tmp-*"))  # each was written beside, then renamed over

    again = Server("--snapshot", str(path), "--snapshot-interval-secs", "0")
    try:
        assert [w["worker_id"] for w in call(again, "GET", "/workers")[1]] == [1]
        assert call(again, "GET", "/dump")[1]["events"] == dump["events"]
        blocks = [(w["worker_id"], w["device_blocks"]) for w in scores["workers"]]
        assert blocks == [(1, 1)]  # the prompt's block, on worker 1
        assert [(w["worker_id"], w["device_blocks"])
                for w in call(again, "POST", "/overlap_scores", PROMPT)[1]["workers"]] == blocks
    finally:
        again.stop()


def test_a_snapshot_that_cannot_be_read_stops_the_start(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--port", "0", *args],
                              capture_output=True, text=True, timeout=60)

    bad = tmp_path / "state.json"
    bad.write_text('{"format": "selection-proto-dump/1", "workers": [')
    result = run("--snapshot", str(bad))
    assert result.returncode == 2 and f"--snapshot {bad}: invalid JSON" in result.stderr
    result = run("--snapshot", str(bad), "--restore", str(bad))
    assert result.returncode == 2 and "--restore and --snapshot go separately" in result.stderr
    for flag, value in (("--snapshot-interval-secs", "-1"), ("--drain-delay-secs", "nan")):
        result = run("--snapshot", str(tmp_path / "new.json"), flag, value)
        assert result.returncode == 2 and f"{flag}: must be a finite number of at least 0" in result.stderr
    unwritable = tmp_path / "missing-folder" / "state.json"
    s = Server("--snapshot", str(unwritable), "--snapshot-interval-secs", "0.5")
    try:
        deadline = time.monotonic() + 20
        while not any('"snapshot failed"' in line for line in s.logs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert call(s, "GET", "/health")[0] == 200  # a failed snapshot is reported, never fatal
        assert 'selection_proto_snapshots_total{result="failed"}' in call(s, "GET", "/metrics")[1]
    finally:
        assert s.stop() == 0


def test_readyz_is_ok_without_workers_and_the_drain_delay_keeps_serving() -> None:
    s = Server("--drain-delay-secs", "1.5")
    try:
        assert call(s, "GET", "/ready")[0] == 503  # no worker yet: the fleet's readiness
        assert call(s, "GET", "/readyz") == (200, {"status": "ok"})  # the process's
        assert call(s, "POST", "/workers", WORKER)[0] == 201
        assert call(s, "GET", "/ready")[0] == 200
        os.kill(s.proc.pid, signal.SIGTERM)
        time.sleep(0.4)
        assert s.proc.poll() is None
        assert call(s, "GET", "/readyz") == (503, {"error": "selection service is shutting down"})
        assert call(s, "GET", "/ready")[0] == 503
        status, answer = call(s, "POST", "/select", PROMPT)
        assert status == 200 and answer["worker_id"] == 1, answer  # still serving, marked not ready
        assert s.proc.wait(timeout=15) == 0
        assert any('"event":"draining"' in line for line in s.logs)
    finally:
        s.stop()


def test_a_connection_closes_at_once_while_a_snapshot_is_being_written(tmp_path: Path) -> None:
    """The forked child closes what it inherited: a connection the server closes ends for its
    client then, not when the child's dump of a large index is done."""
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"format": "selection-proto-dump/1", "keys": [], "workers": [WORKER],
                                "events": events(1, 300_000)}))
    s = Server("--snapshot", str(path), "--snapshot-interval-secs", "1")
    try:
        with s.connect() as sock:
            sock.sendall(request("GET", "/health"))
            read_response(sock, bytearray())
            children = Path(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children")
            deadline = time.monotonic() + 30  # until a snapshot child forked after this connection
            while not children.read_text().split() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert children.read_text().split(), "no snapshot child appeared"
            sock.sendall(request("GET", "/health", headers="connection: close\r\n"))
            started = time.monotonic()
            status, _, _ = read_response(sock, bytearray())
            sock.settimeout(10)
            assert status == 200 and sock.recv(10) == b""
            assert time.monotonic() - started < 0.5
    finally:
        assert s.stop() == 0


def test_a_restored_snapshot_is_kept_and_peers_are_not_asked(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"format": "selection-proto-dump/1", "keys": [], "workers": [WORKER],
                                "events": events(1, 3)}))
    s = Server("--snapshot", str(path), "--indexer-peers", "http://127.0.0.1:9/")
    try:
        assert [w["worker_id"] for w in call(s, "GET", "/workers")[1]] == [1]
        assert any('"peers_not_asked"' in line for line in s.logs)
        assert not any("peer_recovery_failed" in line or "no_reachable_peers" in line for line in s.logs)
    finally:
        assert s.stop() == 0
