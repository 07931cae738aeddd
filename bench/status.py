"""The status page's cost at fleet scale (docs/STATUS.md, "Cost at 1,000 workers"): in process, a
fleet of N workers of R ranks with bookings, KV events and decisions; then what one second of the
live feed costs the event loop: building what the snapshots are cut from, cutting one viewer's
snapshot (no filter, a filter, a worker's detail) and encoding it, and each snapshot's size.

    python bench/status.py [--workers 1000] [--ranks 1 8 128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selection_proto import SelectionService, Settings, WorkerRequest  # noqa: E402
from selection_proto.core.base.hashing import block_hashes  # noqa: E402
from selection_proto.core.base.types import SelectAndReserveRequest  # noqa: E402
from selection_proto.core.status import View  # noqa: E402
from selection_proto.core.status_answers import status_event, status_fleet  # noqa: E402

BLOCK_SIZE = 16


def fleet(workers: int, ranks: int) -> SelectionService:
    service = SelectionService(Settings(kv_events="push", max_state_bytes=16 << 30, shadow_policy="ttft"),
                               random.Random(0))
    for w in range(workers):
        service.upsert_worker(WorkerRequest(worker_id=w, model_name=f"m{w % 4}", endpoint=f"http://10.0.{w // 250}.{w % 250}:8000",
                                            block_size=BLOCK_SIZE, data_parallel_size=ranks), now=0.0)
    rng = random.Random(1)
    for n in range(2 * workers):  # bookings everywhere: some rank of most workers is `no_events` later
        tokens = [rng.randrange(50_000) for _ in range(256)]
        service.select_and_reserve(SelectAndReserveRequest(model_name=f"m{n % 4}", token_ids=tokens,
                                                           reservation_id=f"r{n}"), now=1.0)
    for w in range(0, workers, 2):  # half the workers' engines publish
        hashes = block_hashes([w] * 64, BLOCK_SIZE)
        event = {"worker_id": w, "event": {"event_id": 1, "dp_rank": 0, "data": {"stored": {"parent_hash": None,
                 "blocks": [{"block_hash": 10_000 * w + i, "tokens_hash": h} for i, h in enumerate(hashes)]}}}}
        service.handle("POST", "/kv_events", "", [("content-type", "application/json")],
                       json.dumps([event]).encode(), now=2.0)
    return service


def timed(fn: object, repeat: int = 5) -> float:
    """The median seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 128])
    args = parser.parse_args()
    print(f"{'fleet':<22}{'build':>10}{'cut+encode':>12}{'snapshot':>11}{'filtered':>10}{'detail':>10}")
    now = 200.0  # past the verdict's window: the bookings' workers without events are no_events
    for ranks in args.ranks:
        service = fleet(args.workers, ranks)
        built = status_fleet(service, now)
        build = timed(lambda s=service: status_fleet(s, now))
        cut = timed(lambda s=service, f=built: status_event(s, f, View(), now), 20)
        sizes = [len(status_event(service, built, view, now))
                 for view in (View(), View("no_events"), View(detail=args.workers - 1))]
        name = f"{args.workers:,} x {ranks} rank{'s' if ranks > 1 else ''}"
        print(f"{name:<22}{build * 1000:>8.1f}ms{cut * 1000:>10.2f}ms{sizes[0] / 1024:>9.1f}KiB"
              f"{sizes[1] / 1024:>8.1f}KiB{sizes[2] / 1024:>8.1f}KiB")


if __name__ == "__main__":
    main()
