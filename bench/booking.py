"""One huge booking in process: a million token ids on a block-size-1 worker, booked with
`select_and_reserve` in each `kv_events` mode, then expired by `tick` (seconds each, on the
caller's thread: what a server's event loop would spend).

    python bench/booking.py
"""

from __future__ import annotations

import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selection_proto import SelectionService, Settings, WorkerRequest  # noqa: E402
from selection_proto.core.base.types import SelectAndReserveRequest  # noqa: E402


def main() -> None:
    for mode in ("push", "approximate"):
        service = SelectionService(Settings(kv_events=mode, max_state_bytes=8 << 30), random.Random(0))
        service.upsert_worker(WorkerRequest(worker_id=1, model_name="m", block_size=1, endpoint="http://e"), now=0)
        request = SelectAndReserveRequest(model_name="m", token_ids=list(range(1 << 20)), reservation_id="r")
        started = time.perf_counter()
        service.select_and_reserve(request, now=1.0)
        booked = time.perf_counter() - started
        started = time.perf_counter()
        service.tick(1000.0)  # past the booking's expiry and, in approximate mode, the prediction's
        print(f"{mode:12} book {booked:5.2f} s   expire {time.perf_counter() - started:5.2f} s")


if __name__ == "__main__":
    main()
