"""The admission queue's cost per free (docs/PERFORMANCE.md, "The admission queue"): two busy
workers, N selections queued, each free dispatches one onto the freed worker and the rest wait.

    PYTHONPATH=<tree> .venv/bin/python bench/flow_queue.py
"""
import json
import random
import time

from selection_proto import SelectionService, Settings

J = [("content-type", "application/json")]
def run(queued: int) -> float:
    s = SelectionService(Settings(kv_events="push", queue_threshold=1e-6, queue_max_pending=100_000), random.Random(0))
    def h(m, p, b=None, now=0.0):
        return s.handle(m, p, "", J, json.dumps(b).encode() if b is not None else b"", now=now)
    for w in (1, 2):
        h("POST", "/workers", {"worker_id": w, "model_name": "m", "block_size": 4, "endpoint": "http://e", "max_num_batched_tokens": 64})
        h("POST", "/reservations", {"model_name": "m", "reservation_id": f"hold{w}", "worker_id": w, "token_ids": list(range(16))})
    for i in range(queued):
        h("POST", "/select_and_reserve", {"model_name": "m", "token_ids": [i % 50000, 1, 2, 3, 4, 5, 6, 7], "reservation_id": f"q{i}"})
    # each round: free the booking on worker 1, which dispatches one queued request onto it
    current = "hold1"
    started = time.perf_counter()
    rounds = 200
    for _ in range(rounds):
        h("DELETE", f"/reservations/{current}", now=1.0)
        while (o := s.next_output()) is not None:
            if hasattr(o, "response"):
                current = json.loads(o.response.body)["reservation_id"]
    return (time.perf_counter() - started) / rounds * 1e6


if __name__ == "__main__":
    for n in (10, 1000, 10000):
        print(n, f"{run(n):.1f} us per free")
