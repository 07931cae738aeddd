"""How long one full cyclic-GC pass stops the process when the index is large.

    python bench/gc_pause.py [--blocks 1000000]

Builds the index through `handle` (one-block stores, 1,000 per request), then times
`gc.collect()` twice and counts the objects the collector tracks (docs/INVARIANTS.md), then
times a dump with the collector on and `GET /dump` (docs/PERFORMANCE.md)."""

from __future__ import annotations

import argparse
import gc
import random
import time

from selection_proto import SelectionService, Settings
from selection_proto.core.base import jsonio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    opts = parser.parse_args()
    service = SelectionService(Settings(kv_events="push", max_state_bytes=1 << 40), random.Random(0))
    json_type = [("content-type", "application/json")]
    service.handle("POST", "/workers", "", json_type,
                   jsonio.dumps({"worker_id": 1, "endpoint": "http://w1", "block_size": 16}), now=1.0)
    started = time.perf_counter()
    for first in range(0, opts.blocks, 1000):
        events = [{"worker_id": 1, "event": {"event_id": first + i + 1, "data": {"stored": {
            "parent_hash": None, "blocks": [{"block_hash": first + i, "tokens_hash": first + i}]}}}}
            for i in range(min(1000, opts.blocks - first))]
        assert service.handle("POST", "/kv_events", "", json_type, jsonio.dumps(events), now=2.0).status == 200
    print(f"{opts.blocks:,} blocks indexed in {time.perf_counter() - started:.1f} s; "
          f"the collector tracks {len(gc.get_objects()):,} objects")
    for _ in range(2):
        started = time.perf_counter()
        gc.collect()
        print(f"one full gc.collect(): {(time.perf_counter() - started) * 1000:.0f} ms")
    started = time.perf_counter()
    service.dump()
    print(f"service.dump() with the collector on: {(time.perf_counter() - started) * 1000:.0f} ms")
    started = time.perf_counter()
    status = service.handle("GET", "/dump", "", [], b"", now=3.0).status
    print(f"GET /dump through handle (collector paused while it builds): "
          f"{(time.perf_counter() - started) * 1000:.0f} ms, status {status}")


if __name__ == "__main__":
    main()
