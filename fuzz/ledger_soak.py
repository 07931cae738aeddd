"""A soak of replicas sharing a ledger, with faults (docs/REPLICATION.md):

    python fuzz/ledger_soak.py [--seconds 60] [--replicas 3] [--clients 16] [--faults both|ledger|replicas]
                               [--reuse 0.5] [--lease 15] [--seed 0] [--no-faults]

Real `selection-proto serve --ledger` processes on one real redis-server (AOF `always`). Clients
book, complete prefill and free on random replicas; a fault thread SIGKILLs and restarts a
replica, or the ledger, every couple of seconds. Then the faults stop, every client frees what
it still holds (on any replica that answers), and every replica must show every load at zero,
with the ledger holding no booking, within a lease (`--lease`): a killed replica's unwritten
frees (at most one write of its journal, docs/REPLICATION.md) end with their lease.

A held booking whose first free answers 404 is freed again 2 s later, on a random replica: a 200
then says the booking had been kept, so the 404 was wrong (`kept_but_404`, each printed with the
faults before it). With `--faults ledger` no booking can be lost, so every one is a bug."""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from ledger_server import LedgerServer  # noqa: E402

WORKER = {"model_name": "m", "endpoint": "http://w", "block_size": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(port: int, method: str, path: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    data = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head_bytes, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head_bytes.split()[1])
    if b"application/json" in head_bytes.lower():
        return status, json.loads(payload) if payload else None
    return status, payload.decode()


class Replica:
    def __init__(self, url: str, lease: float) -> None:
        self.url = url
        self.lease = lease
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "serve", "--port", str(self.port),
                                      "--kv-events", "push", "--ledger", self.url, "--log-level", "warning",
                                      "--active-request-expiry-secs", str(self.lease)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if "\nselection_proto_ledger_connected 1.0\n" in call(self.port, "GET", "/metrics")[1]:
                    return
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lease", type=float, default=15.0, help="active_request_expiry_secs")
    parser.add_argument("--no-faults", action="store_true",
                        help="no kills: every booking answered 2xx must be counted exactly, none lost")
    parser.add_argument("--reuse", type=float, default=0.5, help="share of bookings that reuse a freed id")
    parser.add_argument("--faults", choices=("both", "ledger", "replicas"), default="both",
                        help="what the fault thread kills (ledger: no booking may be lost, so every "
                             "first free of a held booking answered 404 is a wrong answer)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp())
    ledger = LedgerServer(folder).start()
    group = [Replica(ledger.url, args.lease) for _ in range(args.replicas)]
    for replica in group:
        replica.start()
    for worker_id in range(4):
        assert call(group[0].port, "POST", "/workers", {**WORKER, "worker_id": worker_id})[0] == 201
    time.sleep(0.5)
    stop = threading.Event()
    held: dict[str, None] = {}  # booked and not yet freed, as the clients know
    lock = threading.Lock()
    counts = {"booked": 0, "freed": 0, "prefilled": 0, "errors": 0, "replica_kills": 0, "ledger_kills": 0,
              "retried_frees": 0, "retry_not_404": 0, "reused_ids": 0, "first_free_404": 0,
              "ledger_slow_starts": 0}
    # Held bookings whose first free answered 404: freed again 2 s later (within the lease), a 200
    # then says the booking was kept (a wrong 404), a 404 that it was lost (with a killed
    # replica's journal) or had ended; a 503 or a refused connection is tried again.
    first_404: list[tuple[str, float]] = []
    kept: list[dict[str, Any]] = []
    faults_at: list[tuple[float, str]] = []  # when each fault began, and what it was
    reusable: dict[int, list[str]] = {}  # client -> ids it freed, to book again (docs/REPLICATION.md)
    reused: set[str] = set()  # ids booked more than once

    def client(index: int) -> None:
        local = random.Random(index)
        n = 0
        while not stop.is_set():
            port = local.choice(group).port
            try:
                with lock:
                    mine = [rid for rid in held if rid.startswith(f"c{index}-")]
                if mine and (len(mine) >= 8 or local.random() < 0.5):  # a few live bookings each
                    rid = local.choice(mine)
                    if local.random() < 0.3:
                        status, _ = call(port, "POST", f"/reservations/{rid}/prefill_complete")
                        counts["prefilled"] += status == 200
                    else:
                        status, _ = call(port, "DELETE", f"/reservations/{rid}")
                        if status in (200, 404):
                            with lock:
                                held.pop(rid, None)
                                if status == 404:
                                    first_404.append((rid, time.monotonic(), port))
                            counts["freed"] += 1
                            counts["first_free_404"] += status == 404
                            if status == 200:  # (a 404's id is freed again at the end, not reused)
                                reusable.setdefault(index, []).append(rid)
                            if status == 200 and local.random() < 0.5:  # a client's retry, anywhere
                                again, _ = call(local.choice(group).port, "DELETE", f"/reservations/{rid}")
                                counts["retried_frees"] += 1
                                counts["retry_not_404"] += again not in (404, 503)
                else:
                    old = reusable.get(index)
                    if old and local.random() < args.reuse:  # an id used again after its free
                        rid = old.pop(local.randrange(len(old)))
                        counts["reused_ids"] += 1
                        reused.add(rid)
                    else:
                        rid = f"c{index}-{n}"
                        n += 1
                    status, _ = call(port, "POST", "/select_and_reserve",
                                     {"model_name": "m", "token_ids": list(range(local.randrange(4, 64))),
                                      "reservation_id": rid})
                    if status == 200:
                        with lock:
                            held[rid] = None
                        counts["booked"] += 1
            except (OSError, ValueError, IndexError):
                counts["errors"] += 1  # a replica being killed: the client goes on elsewhere
                time.sleep(0.05)

    def faults() -> None:
        while not args.no_faults and not stop.wait(rng.uniform(1.0, 3.0)):
            if args.faults == "replicas" or (args.faults == "both" and rng.random() < 0.7):
                victim = rng.choice(group)
                faults_at.append((time.monotonic(), "replica"))
                victim.kill()
                counts["replica_kills"] += 1
                victim.start()
            else:
                faults_at.append((time.monotonic(), "ledger"))
                ledger.kill()
                counts["ledger_kills"] += 1
                time.sleep(rng.uniform(0.1, 1.0))
                while True:
                    try:
                        ledger.start()
                        break
                    except RuntimeError:  # not up within its 10 s on a busy machine: again
                        counts["ledger_slow_starts"] += 1
                faults_at.append((time.monotonic(), "ledger_up"))

    checks = random.Random(args.seed + 1)

    def check() -> None:
        checked = 0
        while checked < len(first_404) or not stop.is_set():
            if checked == len(first_404):
                time.sleep(0.1)
                continue
            rid, at, answered_on = first_404[checked]
            time.sleep(max(0.0, at + 2.0 - time.monotonic()))
            status, port = None, 0
            while status not in (200, 404) and time.monotonic() < at + args.lease - 1:
                port = checks.choice(group).port
                try:
                    status = call(port, "DELETE", f"/reservations/{rid}")[0]
                except (OSError, ValueError, IndexError):
                    status = None
                if status not in (200, 404):
                    time.sleep(0.3)
            if status == 200:
                before = [(round(at - when, 2), kind) for when, kind in faults_at if when <= at][-2:]
                kept.append({"id": rid, "reused": rid in reused, "faults_before": before,
                             "answered_404_on": answered_on, "freed_on": port})
            checked += 1

    checker = threading.Thread(target=check)
    checker.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    threads.append(threading.Thread(target=faults))
    for thread in threads:
        thread.start()
    time.sleep(args.seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    time.sleep(1.0)
    if args.no_faults:  # every booking answered and not freed is counted, on every replica
        for r in group:
            active = sum(w["active_requests"] for key in call(r.port, "GET", "/loads")[1] for w in key["loads"])
            if active != len(held):
                print(json.dumps({"result": "failed", "active": active, "held": len(held), **counts}))
                return 1
    # Free what the clients still hold; a 404 means the booking was lost with a killed replica's
    # unwritten journal (its answer was given: the documented advisory loss) or already freed.
    statuses: list[int] = []

    def free(rid: str) -> None:
        statuses.append(call(group[0].port, "DELETE", f"/reservations/{rid}")[0])

    finals = [threading.Thread(target=free, args=(rid,)) for rid in list(held)]
    for thread in finals:
        thread.start()
    for thread in finals:
        thread.join(30)
    lost = statuses.count(404)
    checker.join()
    counts["kept_but_404"] = len(kept)
    if args.no_faults and (lost or counts["retry_not_404"]):
        print(json.dumps({"result": "failed", "lost_at_end": lost, **counts}))
        return 1
    settle_started = time.monotonic()
    deadline = settle_started + args.lease + 15
    while True:
        loads = [sorted((w["worker_id"], w["active_requests"], w["potential_prefill_tokens"])
                        for key in call(r.port, "GET", "/loads")[1] for w in key["loads"]) for r in group]
        left = ledger.client().hlen("sp:{default}:res")
        if all(load == loads[0] for load in loads) and all(w[1] == 0 and w[2] == 0 for w in loads[0]) and not left:
            break
        if time.monotonic() > deadline:
            print(json.dumps({"result": "failed", "loads": loads, "ledger_bookings": left, **counts}))
            return 1
        time.sleep(0.2)
    events = [line for r in group for line in call(r.port, "GET", "/metrics")[1].splitlines()
              if line.startswith("selection_proto_ledger_events_total")]
    print("\n".join(events))
    for wrong in kept:
        print(json.dumps({"kept_but_404": wrong}))
    print(json.dumps({"result": "ok", "seconds": args.seconds, "still_held_at_end": len(held),
                      "lost_at_end": lost, "zero_after_secs": round(time.monotonic() - settle_started, 1),
                      **counts}))
    for replica in group:
        replica.stop()
    ledger.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
