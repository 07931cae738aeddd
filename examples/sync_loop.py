"""The core in a plain synchronous loop: explicit time, a seeded generator, no event loop at all."""

from __future__ import annotations

import json
import random

from selection_proto import (
    SelectAndReserveRequest,
    SelectionService,
    Settings,
    WorkerRequest,
    block_hashes,
)


def main() -> None:
    service = SelectionService(Settings(kv_events="push"), random.Random(7))
    now = 0.0
    for wid in (1, 2):
        service.upsert_worker(WorkerRequest(worker_id=wid, model_name="m", endpoint=f"http://w{wid}",
                                            block_size=4), now=now)
    prompt = list(range(1, 13))
    # Worker 2 reports that it holds the first two blocks of the prompt.
    events = [{"worker_id": 2, "event": {"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 1000 + i, "tokens_hash": h} for i, h in enumerate(block_hashes(prompt[:8], 4))]}}}}]
    status, _, body = service.handle("POST", "/kv_events", "", [("content-type", "application/json")],
                                     json.dumps(events).encode(), now=now)
    assert status == 200, body
    for step in range(3):
        now += 1.0
        answer = service.select_and_reserve(
            SelectAndReserveRequest(model_name="m", token_ids=prompt, reservation_id=f"req-{step}"), now=now)
        print(f"req-{step} -> worker {answer.worker_id} (cached {answer.cached_tokens} tokens)")
        service.prefill_complete(f"req-{step}", now=now)
        service.free(f"req-{step}", now=now)
        service.tick(now)


if __name__ == "__main__":
    main()
