"""The booking ledger's costs (docs/REPLICATION.md), side by side in one run:

    python bench/ledger.py [--pairs 20000] [--samples 2000] [--rounds 20]

1. In process, `select_and_reserve` + `free` pairs per second through `handle`, without a ledger
   and with one (advisory: the journal only; what the transport does is in 2-4).
2. One replica on a real redis-server: the time to answer `select_and_reserve` in advisory and
   in strict admission (strict waits for the ledger's confirmation), p50 and p99.
3. Two replicas: how long after A answers a booking B's loads show it, p50 and p99.
4. Three replicas, bursts of one booking each on the same view: the booking skew across four
   workers (max - min active requests) after each round, advisory against strict.

The server is Debian's redis-server, else the one tests/ledger_server.py finds."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from ledger_server import LedgerServer  # noqa: E402
from replicas import WORKER, replicas, settled  # noqa: E402

from selection_proto import SelectionService, Settings  # noqa: E402
from selection_proto.core.base.responses import Pending  # noqa: E402
from selection_proto.core.fleet.journal import LedgerSettings  # noqa: E402

PROMPT = {"model_name": "m", "token_ids": list(range(1024))}
HEADERS = [("content-type", "application/json")]


def _service(ledger: bool) -> SelectionService:
    service = SelectionService(Settings(kv_events="push"), random.Random(0))
    if ledger:
        service.share(LedgerSettings(), "bench").connected(True, 0.0)
    for worker_id in range(8):
        body = json.dumps({**WORKER, "worker_id": worker_id}).encode()
        assert service.handle("POST", "/workers", "", HEADERS, body, now=1.0).status == 201
    return service


def in_process_pairs(count: int) -> dict[str, float]:
    """Pairs per second, each configuration timed alternately three times (median)."""
    rates: dict[str, list[float]] = {"no ledger": [], "ledger (advisory)": []}
    for _ in range(3):
        for name in rates:
            service = _service(name != "no ledger")
            journal = service.ledger.journal if service.ledger is not None else None
            bodies = [json.dumps({**PROMPT, "reservation_id": f"r{i}"}).encode() for i in range(count)]
            started = time.perf_counter()
            for i, body in enumerate(bodies):
                answer = service.handle("POST", "/select_and_reserve", "", HEADERS, body, now=2.0)
                assert not isinstance(answer, Pending) and answer.status == 200
                service.handle("DELETE", f"/reservations/r{i}", "", HEADERS, b"", now=2.0)
                if journal is not None and len(journal.ops) >= 64:
                    journal.take(64)  # what the writer does with each batch
            rates[name].append(count / (time.perf_counter() - started))
    return {name: statistics.median(r) for name, r in rates.items()}


def journal_cost(count: int) -> float:
    """µs to journal one 1,024-token booking (what advisory admission adds to a request)."""
    service = _service(True)
    assert service.ledger is not None
    journal = service.ledger.journal
    body = json.dumps({**PROMPT, "reservation_id": "j"}).encode()
    service.handle("POST", "/select_and_reserve", "", HEADERS, body, now=2.0)
    pool = next(iter(service.pools.values()))
    booking = pool.tracker.bookings["j"]
    best = float("inf")
    for _ in range(5):
        journal.ops.clear()
        started = time.perf_counter()
        for _ in range(count):
            journal.booked(pool.key, booking)
        best = min(best, (time.perf_counter() - started) / count)
    return best * 1e6


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] * 1e6, ordered[int(len(ordered) * 0.99)] * 1e6


async def answer_times(url: str, samples: int) -> dict[str, tuple[float, float]]:
    out = {}
    for admission in ("advisory", "strict"):
        times = []
        settings = LedgerSettings(admission=admission)  # type: ignore[arg-type]
        async with replicas(1, url, f"answer-{admission}", settings) as (a,):
            for worker_id in range(4):
                await a.ok("POST", "/workers", {**WORKER, "worker_id": worker_id}, status=201)
            await settled([a])
            for i in range(samples):
                started = time.perf_counter()
                status, _ = await a.call("POST", "/select_and_reserve", {**PROMPT, "reservation_id": f"s{i}"})
                times.append(time.perf_counter() - started)
                assert status == 200
                await a.call("DELETE", f"/reservations/s{i}")
                await settled([a])
        out[admission] = _percentiles(times)
    return out


async def visibility(url: str, samples: int) -> tuple[float, float]:
    times = []
    async with replicas(2, url, "visibility") as (a, b):
        for worker_id in range(4):
            await a.ok("POST", "/workers", {**WORKER, "worker_id": worker_id}, status=201)
        await settled([a, b])
        for i in range(samples):
            rid = f"v{i}"
            started = time.perf_counter()
            await a.ok("POST", "/select_and_reserve", {**PROMPT, "reservation_id": rid})
            await b.wait(lambda rid=rid: any(rid in p.tracker.bookings for p in b.service.pools.values()),
                         timeout=10)
            times.append(time.perf_counter() - started)
            await a.call("DELETE", f"/reservations/{rid}")
            await settled([a, b])
    return _percentiles(times)


async def skew(url: str, rounds: int) -> dict[str, list[int]]:
    out = {}
    for admission in ("advisory", "strict"):
        settings = LedgerSettings(admission=admission)  # type: ignore[arg-type]
        spreads = []
        async with replicas(3, url, f"skew-{admission}", settings, prefill_load_scale=1.0) as group:
            for worker_id in range(4):
                await group[0].ok("POST", "/workers", {**WORKER, "worker_id": worker_id}, status=201)
            await settled(group)
            for round_ in range(rounds):
                answers = [r.send("POST", "/select_and_reserve", {**PROMPT, "reservation_id": f"{r.ledger.origin}-{round_}"})
                           for r in group]
                for replica, answer in zip(group, answers, strict=True):
                    if isinstance(answer, int):
                        await replica.answer(answer)
                await settled(group)
                active = [load[0] for load in group[0].loads().values()]
                spreads.append(max(active) - min(active))
        out[admission] = spreads
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=20_000)
    parser.add_argument("--samples", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, 1,024-token prompts, 8 workers in process")
    rates = in_process_pairs(args.pairs)
    base = rates["no ledger"]
    for name, rate in rates.items():
        print(f"  in process, {name:<18} {rate:>9,.0f} pairs/s  {1e6 / rate:6.1f} µs/pair"
              f"  (+{1e6 / rate - 1e6 / base:.1f} µs)")
    print(f"  journaling one booking (encode, rank key, queue): {journal_cost(args.pairs):.1f} µs")
    with tempfile.TemporaryDirectory() as folder:
        server = LedgerServer(Path(folder), persistent=False).start()
        try:
            answers = anyio.run(answer_times, server.url, args.samples)
            for admission, (p50, p99) in answers.items():
                print(f"  select_and_reserve answer, {admission:<8} p50 {p50:7.0f} µs  p99 {p99:7.0f} µs")
            p50, p99 = anyio.run(visibility, server.url, args.samples)
            print(f"  a booking visible on a peer           p50 {p50:7.0f} µs  p99 {p99:7.0f} µs")
            spreads: dict[str, Any] = anyio.run(skew, server.url, args.rounds)
            for admission, values in spreads.items():
                print(f"  burst skew (max-min active), {admission:<8} mean {statistics.mean(values):.2f}"
                      f"  max {max(values)}  over {len(values)} rounds of 3 replicas")
        finally:
            server.kill()


if __name__ == "__main__":
    main()
