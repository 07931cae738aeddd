"""Replicas as real `selection-proto serve --ledger` processes on one real redis-server: a replica
killed with SIGKILL and started again, readiness while the ledger is away, many clients spread
over replicas, and `--processes` on one port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from ledger_server import LedgerServer
from test_http import Server, read_response, request
from test_snapshots import call
from test_subscriptions import device_blocks, free_port, http, vllm_batch
from test_subscriptions import wait_for as subscriptions_wait

from selection_proto import block_hashes
from selection_proto.cli import main

WORKER = {"model_name": "m", "endpoint": "http://w", "block_size": 4}
PROMPT = {"model_name": "m", "token_ids": list(range(16))}


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, logs: list[str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out" + "".join(logs or ())
        time.sleep(0.02)


def loads(server: Server) -> list[tuple[int, int, int]]:
    """(worker, active requests, prefill tokens) of model m."""
    status, body = call(server, "GET", "/loads")
    assert status == 200
    return [(w["worker_id"], w["active_requests"], w["potential_prefill_tokens"])
            for key in body for w in key["loads"]]


def test_a_replica_killed_and_started_again_loses_and_double_counts_nothing(ledger: LedgerServer) -> None:
    a, b = Server("--ledger", ledger.url), Server("--ledger", ledger.url)
    again = None
    try:
        for worker_id in (1, 2):
            assert call(a, "POST", "/workers", {**WORKER, "worker_id": worker_id})[0] == 201
        wait_for(lambda: len(call(b, "GET", "/workers")[1]) == 2)
        for i in range(10):
            status, _ = call(a, "POST", "/reservations", {**PROMPT, "worker_id": 1 + i % 2, "reservation_id": f"r{i}"})
            assert status == 201
        wait_for(lambda: loads(b) == [(1, 5, 80), (2, 5, 80)])
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(5)
        assert loads(b) == [(1, 5, 80), (2, 5, 80)]
        again = Server("--ledger", ledger.url)
        wait_for(lambda: call(again, "GET", "/ready")[0] == 200)
        assert loads(again) == loads(b) == [(1, 5, 80), (2, 5, 80)]
        for i in range(10):  # through the other replica, half of them
            assert call(b if i % 2 else again, "DELETE", f"/reservations/r{i}")[0] == 200
        wait_for(lambda: loads(again) == loads(b) == [(1, 0, 0), (2, 0, 0)])
    finally:
        for server in (a, b, again):
            if server is not None:
                server.stop()


def test_ready_waits_for_the_ledger_and_bookings_wait_in_closed_mode(tmp_path: Path) -> None:
    ledger = LedgerServer(tmp_path)
    url = ledger.url  # nothing listens there yet
    s = Server("--ledger", url, "--ledger-failure", "closed")
    try:
        status, body = call(s, "GET", "/ready")
        assert status == 503 and body["details"] == ["ledger: syncing"]
        status, body = call(s, "POST", "/workers", {**WORKER, "worker_id": 1})
        assert (status, body) == (503, {"error": "ledger unavailable: catalog writes need the ledger"})
        assert call(s, "GET", "/health")[0] == 200
        ledger.start()
        wait_for(lambda: "\nselection_proto_ledger_connected 1.0\n" in call(s, "GET", "/metrics")[1])
        status, body = call(s, "POST", "/workers", {**WORKER, "worker_id": 1})
        assert status == 201, (body, s.logs)
        wait_for(lambda: call(s, "GET", "/ready")[0] == 200)
        ledger.stop()
        wait_for(lambda: call(s, "GET", "/ready")[0] == 503)
        status, body = call(s, "POST", "/select_and_reserve", PROMPT)
        assert (status, body) == (503, {"error": "ledger unavailable"})
        assert call(s, "GET", "/ready")[1]["details"] == ["ledger: disconnected"]
    finally:
        s.stop()
        ledger.kill()
    assert any('"ledger_unavailable"' in line for line in s.logs)


def test_sixty_four_clients_over_two_replicas_leave_every_load_at_zero(ledger: LedgerServer) -> None:
    a, b = Server("--ledger", ledger.url), Server("--ledger", ledger.url)
    try:
        for worker_id in (1, 2, 3):
            assert call(a, "POST", "/workers", {**WORKER, "worker_id": worker_id})[0] == 201
        wait_for(lambda: len(call(b, "GET", "/workers")[1]) == 3)
        # B may list the workers from A's /dump while it still warms, before it has joined the
        # ledger (frees of ids it does not hold answer 503 then): wait until both are ready.
        wait_for(lambda: call(a, "GET", "/ready")[0] == call(b, "GET", "/ready")[0] == 200)
        failures: list[Any] = []

        def client(index: int) -> None:
            try:
                for round_ in range(5):
                    rid = f"c{index}-{round_}"
                    book, free = (a, b) if (index + round_) % 2 else (b, a)  # booked on one, freed on the other
                    with book.connect() as sock:
                        sock.sendall(request("POST", "/select_and_reserve", {**PROMPT, "reservation_id": rid}))
                        status, _, _ = read_response(sock, bytearray())
                    assert status == 200
                    with free.connect() as sock:
                        sock.sendall(request("DELETE", f"/reservations/{rid}"))
                        status, _, body = read_response(sock, bytearray())
                    assert status == 200, body
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert failures == [], [line for line in a.logs + b.logs if "ledger" in line]
        zero = [(1, 0, 0), (2, 0, 0), (3, 0, 0)]
        wait_for(lambda: loads(a) == loads(b) == zero)
        assert ledger.client().hlen("sp:{default}:res") == 0
    finally:
        a.stop()
        b.stop()


def supervised(ledger: LedgerServer, **popen: Any) -> tuple[subprocess.Popen[str], list[str]]:
    """`serve --processes 2` on a free port, once both processes reached the ledger; its log lines."""
    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--kv-events", "push",
                             "--ledger", ledger.url, "--processes", "2"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, **popen)
    logs: list[str] = []

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            logs.append(line)

    threading.Thread(target=drain, daemon=True).start()
    wait_for(lambda: sum('"event":"ledger_connected"' in line for line in logs) == 2, 30, logs)
    return proc, logs


def test_processes_share_one_port_and_one_ledger(ledger: LedgerServer) -> None:
    proc, logs = supervised(ledger, start_new_session=True)
    try:
        ports = {re.search(r":(\d+)\"", line).group(1) for line in logs if '"event":"listening"' in line}  # type: ignore[union-attr]
        assert len(ports) == 1
        server = Server.__new__(Server)
        server.port = int(ports.pop())
        assert call(server, "POST", "/workers", {**WORKER, "worker_id": 1})[0] == 201
        wait_for(lambda: all(len(call(server, "GET", "/workers")[1]) == 1 for _ in range(10)))
        origins = set()
        for i in range(40):  # new connections land on either process
            status, body = call(server, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": f"p{i}"})
            assert status == 200, body
        wait_for(lambda: ledger.client().hlen("sp:{default}:res") == 40)
        for _, fields in ledger.client().xrange("sp:{default}:feed"):
            if fields[b"k"] == b"add":
                origins.add(fields[b"o"])
        assert len(origins) == 2  # both processes booked
        for i in range(40):
            assert call(server, "DELETE", f"/reservations/p{i}")[0] == 200
        wait_for(lambda: ledger.client().hlen("sp:{default}:res") == 0)
        for _ in range(6):  # whichever process answers, it agrees
            assert loads(server) == [(1, 0, 0)]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        assert proc.wait(20) == 0  # passed on once, not forced by a second one
    assert sum('"event":"stopped"' in line for line in logs) == 2


def test_processes_need_a_ledger() -> None:
    done = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--processes", "2"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--processes above 1 needs --ledger" in done.stderr
    done = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--ledger", "http://x"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--ledger: expected redis://" in done.stderr


def blocks(server: Server) -> dict[int, int]:
    """Device blocks per worker of the test prompt; none while the replica has no worker yet."""
    status, _ = call(server, "GET", "/ready")
    return device_blocks(server.port) if status == 200 else {}


def test_every_replica_subscribes_to_the_engines_the_shared_catalog_names(ledger: LedgerServer) -> None:
    zport = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{zport}")
    a = Server("--ledger", ledger.url, mode="subscribe")
    b = Server("--ledger", ledger.url, mode="subscribe")
    try:
        wait_for(lambda: all(call(s, "GET", "/readyz")[0] == 200 for s in (a, b)))
        wait_for(lambda: "\nselection_proto_ledger_connected 1.0\n" in call(a, "GET", "/metrics")[1])
        status, _ = http(a.port, "POST", "/workers", {"worker_id": 1, "endpoint": "http://w1", "block_size": 4,
                                                      "kv_events_endpoint": f"tcp://127.0.0.1:{zport}"})
        assert status == 201
        seq = iter(range(1, 1000))

        def publish() -> None:  # PUB/SUB drops messages until each subscriber has joined
            pub.send_multipart([b"", next(seq).to_bytes(8, "big"), vllm_batch([11, 12], list(range(1, 9)))])

        assert subscriptions_wait(lambda: blocks(a) == blocks(b) == {1: 2}, step=publish)
        assert http(b.port, "DELETE", "/workers/1")[0] == 200  # and they follow a delete made on B
        wait_for(lambda: [w["lifecycle"] for w in call(a, "GET", "/workers")[1]] == ["unschedulable"])
    finally:
        a.stop()
        b.stop()
        pub.close(linger=0)


def test_one_relay_feeds_every_replica(ledger: LedgerServer) -> None:
    zport = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{zport}")
    a, b = Server("--ledger", ledger.url), Server("--ledger", ledger.url)
    relay = None
    try:
        wait_for(lambda: "\nselection_proto_ledger_connected 1.0\n" in call(a, "GET", "/metrics")[1])
        assert http(a.port, "POST", "/workers", {"worker_id": 3, "endpoint": "http://w3", "block_size": 4})[0] == 201
        wait_for(lambda: len(call(b, "GET", "/workers")[1]) == 1)
        relay = subprocess.Popen(
            [sys.executable, "-m", "selection_proto", "relay", "--zmq", f"tcp://127.0.0.1:{zport}",
             "--to", f"ws://127.0.0.1:{a.port}/kv_events", "--to", f"ws://127.0.0.1:{b.port}/kv_events",
             "--worker-id", "3"], stderr=subprocess.PIPE, text=True)
        seq = iter(range(1, 10_000))

        def publish() -> None:
            pub.send_multipart([b"kv", next(seq).to_bytes(8, "big"), vllm_batch([31, 32], list(range(1, 9)))])

        assert subscriptions_wait(lambda: blocks(a) == blocks(b) == {3: 2}, step=publish)
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(timeout=15) == 0
        assert relay.stderr is not None
        stopped = [json.loads(line) for line in relay.stderr.read().splitlines() if '"relay_stopped"' in line]
        assert sorted(r["to"].split(":")[2].split("/")[0] for r in stopped) == sorted([str(a.port), str(b.port)])
        assert all(r["forwarded"] >= 1 and r["dropped_overflow"] == 0 for r in stopped)
    finally:
        if relay is not None and relay.poll() is None:
            relay.kill()
        a.stop()
        b.stop()
        pub.close(linger=0)


def test_a_starting_replica_fills_its_index_from_a_registered_peer(ledger: LedgerServer) -> None:
    a = Server("--ledger", ledger.url)
    b = None
    try:
        wait_for(lambda: "\nselection_proto_ledger_connected 1.0\n" in call(a, "GET", "/metrics")[1])
        assert http(a.port, "POST", "/workers", {"worker_id": 1, "endpoint": "http://w1", "block_size": 4})[0] == 201
        stored = [{"worker_id": 1, "event": {"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": 11, "tokens_hash": block_hashes(list(range(1, 5)), 4)[0]},
            {"block_hash": 12, "tokens_hash": block_hashes(list(range(1, 9)), 4)[1]}]}}}}]
        assert http(a.port, "POST", "/kv_events", stored)[0] == 200
        assert device_blocks(a.port) == {1: 2}
        wait_for(lambda: ledger.client().hlen("sp:{default}:replicas") == 1)
        b = Server("--ledger", ledger.url)
        wait_for(lambda: call(b, "GET", "/ready")[1].get("recovered_from") == f"http://127.0.0.1:{a.port}")
        assert device_blocks(b.port) == {1: 2}
        assert [w["worker_id"] for w in call(b, "GET", "/workers")[1]] == [1]
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert ledger.client().hlen("sp:{default}:replicas") == 0  # each unregistered at its stop


def test_a_trio_replica_and_an_asyncio_replica_share_bookings(ledger: LedgerServer) -> None:
    a, b = Server("--ledger", ledger.url, "--backend", "trio"), Server("--ledger", ledger.url)
    try:
        wait_for(lambda: "\nselection_proto_ledger_connected 1.0\n" in call(a, "GET", "/metrics")[1])
        assert call(a, "POST", "/workers", {**WORKER, "worker_id": 1})[0] == 201
        wait_for(lambda: len(call(b, "GET", "/workers")[1]) == 1)
        assert call(b, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": "t"})[0] == 200
        wait_for(lambda: loads(a) == [(1, 1, 16)])
        assert call(a, "DELETE", "/reservations/t")[0] == 200
        wait_for(lambda: loads(b) == [(1, 0, 0)])
    finally:
        a.stop()
        b.stop()


def test_processes_stop_with_their_supervisor(ledger: LedgerServer) -> None:
    proc, logs = supervised(ledger)
    try:
        children = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(children) == 2
        proc.send_signal(signal.SIGKILL)  # no forwarding now: each process notices on its own
        proc.wait(5)

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

        wait_for(lambda: all(gone(pid) for pid in children), 15, logs)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sum('"event":"supervisor_gone"' in line for line in logs) == 2


@pytest.mark.parametrize(("args", "error"), [
    (["--processes", "0"], "--processes: must be between 1 and 64, not 0"),
    (["--ledger", "redis://x", "--processes", "2", "--snapshot", "s.json"],
     "--snapshot with --processes above 1: the ledger holds the shared state"),
    (["--ledger", "redis://x", "--admission", "eager"],
     "--admission: invalid choice 'eager' (choose from advisory, strict)"),
    (["--ledger", "redis://x", "--ledger-failure", "maybe"],
     "--ledger-failure: invalid choice 'maybe' (choose from open, closed)"),
    (["--ledger", "redis://x", "--ledger-batch", "0"], "--ledger-batch: must be a positive integer, not 0"),
    (["--ledger", "redis://x", "--ledger-free-grace-secs", "nan"],
     "--ledger-free-grace-secs: must be above 0 and at most 600, not nan"),
    (["--ledger", "redis://x", "--ledger-scope", "a{b}"],
     "--ledger-scope: expected 1-128 printable characters without braces, not 'a{b}'"),
    (["--ledger", "redis://x", "--advertise-url", "ftp://x"], "--advertise-url: expected an http:// URL, not 'ftp://x'"),
])
def test_ledger_settings_are_checked_before_anything_starts(args: list[str], error: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *args], env={}) == 2
    assert capsys.readouterr().err.strip() == f"selection-proto: error: {error}"


def test_a_process_that_dies_is_started_again(ledger: LedgerServer) -> None:
    proc, logs = supervised(ledger)
    try:
        first = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        os.kill(first[0], signal.SIGKILL)
        wait_for(lambda: sum('"event":"ledger_connected"' in line for line in logs) == 3, 30, logs)
        again = [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(again) == 2 and first[0] not in again and first[1] in again
        assert any('"event":"process_exited"' in line and '"code":-9' in line for line in logs)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_ready_says_index_warming_while_a_peer_is_asked(ledger: LedgerServer) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts and never answers
    peer = f"http://127.0.0.1:{silent.getsockname()[1]}"
    s = Server("--ledger", ledger.url, "--indexer-peers", peer, "--indexer-peer-timeout-secs", "2")
    try:
        status, body = call(s, "GET", "/ready")
        assert (status, body["details"]) == (503, ["index: warming", "ledger: syncing"])
        status, body = call(s, "POST", "/workers", {**WORKER, "worker_id": 1})
        assert (status, body["error"]) == (503, "ledger unavailable: catalog writes need the ledger")
        wait_for(lambda: "\nselection_proto_ledger_connected 1.0\n" in call(s, "GET", "/metrics")[1])
        assert "details" not in call(s, "GET", "/ready")[1]  # 503 still: no worker yet
    finally:
        s.stop()
        silent.close()
    assert any('"peer_recovery_failed"' in line for line in s.logs)


def test_a_replica_on_a_ledger_survives_hostile_requests_and_keeps_its_ledger(ledger: LedgerServer) -> None:
    """Ids that go to the ledger as they are (written-through frees, bookings): over-long, odd
    bytes, a lone surrogate; garbage on the socket. The replica answers, and stays connected."""
    s = Server("--ledger", ledger.url)
    try:
        wait_for(lambda: "\nselection_proto_ledger_connected 1.0\n" in call(s, "GET", "/metrics")[1])
        assert call(s, "POST", "/workers", {**WORKER, "worker_id": 1})[0] == 201
        started = time.monotonic()  # never bookable (over max_id_length): not written through, no wait
        assert call(s, "DELETE", "/reservations/" + "x" * 5000)[0] == 404
        assert time.monotonic() - started < 1.0 and ledger.client().zcard("sp:{default}:tomb") == 0
        assert call(s, "DELETE", "/reservations/%00%ff%7B%7D")[0] in (400, 404)
        with s.connect() as sock:
            sock.sendall(b'POST /select_and_reserve HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n'
                         b'content-length: 54\r\n\r\n{"model_name":"m","token_ids":[1],"reservation_id":"\\ud800"}')
            status, _, _ = read_response(sock, bytearray())
            assert status in (400, 422)
        with s.connect() as sock:
            sock.sendall(b"\x00\xff garbage \r\n\r\n" * 100)
        assert call(s, "POST", "/select_and_reserve", {**PROMPT, "reservation_id": "ok"})[0] == 200
        assert call(s, "GET", "/health")[0] == 200
        assert "\nselection_proto_ledger_connected 1.0\n" in call(s, "GET", "/metrics")[1]
        wait_for(lambda: ledger.client().hexists("sp:{default}:res", "ok"))
    finally:
        s.stop()


def test_processes_take_connections_once_they_can_serve_them(ledger: LedgerServer) -> None:
    """The moment the shared port first accepts, every process that takes a connection
    has joined the ledger: 16 registrations on fresh connections all succeed."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", str(port), "--kv-events",
                             "push", "--ledger", ledger.url, "--processes", "2"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    logs: list[str] = []
    threading.Thread(target=lambda: logs.extend(proc.stderr or ()), daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while True:  # the first connect that succeeds
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.01)
        statuses = []
        for worker_id in range(1, 17):  # each on a connection of its own: any process may take it
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # a loaded machine's start
                sock.sendall(request("POST", "/workers", {**WORKER, "worker_id": worker_id}))
                status, _, body = read_response(sock, bytearray())
                statuses.append((status, body if status != 201 else b""))
        assert statuses == [(201, b"")] * 16, logs
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(20) == 0


def test_processes_share_the_pickers_port_too(ledger: LedgerServer) -> None:
    """With `--ext-proc-port`, every process serves the one picker port (it was bound
    without port sharing: all but one process exited, and were started again for ever)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", "0", "--kv-events",
                             "approximate", "--ledger", ledger.url, "--processes", "2", "--ext-proc-port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    logs: list[str] = []
    threading.Thread(target=lambda: logs.extend(proc.stderr or ()), daemon=True).start()
    try:
        wait_for(lambda: sum('"event":"ext_proc_listening"' in line for line in logs) == 2, 60, logs)
        urls = {json.loads(line)["url"] for line in logs if '"event":"ext_proc_listening"' in line}
        assert len(urls) == 1, urls
        time.sleep(2.5)  # a process that could not bind would have exited and been restarted by now
        assert not any('"event":"process_exited"' in line for line in logs), logs
        with grpc.insecure_channel(urls.pop().removeprefix("grpc://")) as channel:
            for _ in range(4):
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(20) == 0


def test_a_replica_whose_shared_state_settings_differ_refuses_to_join_and_others_are_named(
        ledger: LedgerServer) -> None:
    """Replicas on one ledger with different leases or catalog limits drifted apart (one aged out
    or refused what another kept): such a replica now refuses to join, at start, with one line
    naming the settings. A difference only in a replica's own answers joins, named and counted."""
    a = Server("--ledger", ledger.url)
    b = Server("--ledger", ledger.url, "--max-reservations-per-key", "10", "--router-policy", "ttft")
    c = None
    try:
        for joined in (a, b):  # registered: a replica connects only once admitted
            wait_for(lambda s=joined: any('"ledger_connected"' in line for line in s.logs), 20, joined.logs)
        c = Server("--ledger", ledger.url, "--active-request-expiry-secs", "60", "--max-workers-per-key", "8")
        assert c.proc.wait(20) == 1
        errors = [line for line in c.logs if line.startswith("selection-proto: error:")]
        assert len(errors) == 1, c.logs
        assert re.fullmatch(r"selection-proto: error: refusing to join ledger scope default: settings differ "
                            r"from replica \S+: lease_ms=60000 \(theirs \d+\), max_workers_per_key=8 "
                            r"\(theirs \d+\)\n", errors[0]), errors[0]
        # b differs only in what it answers itself: it joined, and each names the other
        wait_for(lambda: any('"ledger_settings_differ"' in line for line in b.logs), 20, b.logs)
        warning = json.loads(next(line for line in b.logs if '"ledger_settings_differ"' in line))
        assert warning["differ"] == ["max_reservations_per_key", "router_policy"]
        wait_for(lambda: any('"ledger_settings_differ"' in line for line in a.logs), 20, a.logs)
        assert 'selection_proto_ledger_events_total{event="settings_differ"} 1.0' in call(a, "GET", "/metrics")[1]
        # the refused replica left nothing behind: the two that joined still share one catalog
        assert call(a, "POST", "/workers", {**WORKER, "worker_id": 1})[0] == 201
        wait_for(lambda: len(call(b, "GET", "/workers")[1]) == 1)
    finally:
        for server in (a, b, c):
            if server is not None:
                server.stop()
