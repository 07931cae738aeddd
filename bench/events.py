"""KV events applied per second: in-process (JSON RouterEvents and engine msgpack batches, 1- and
16-block stores) and over a real WebSocket; the reference's RadixTree.apply_event in-process.

    python bench/events.py [--reference-python PY]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack  # noqa: E402

from selection_proto import SelectionService, Settings, WorkerRequest  # noqa: E402
from selection_proto.core.cache.events import decode_json_events  # noqa: E402

N = 4000
REFERENCE = """
import json, sys, time
from dynamo.llm import RadixTree
out = {}
for width in (1, 16):
    events = [json.dumps({"event_id": i, "dp_rank": 0, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": i * 100 + j, "tokens_hash": i * 100 + j} for j in range(width)]}}}).encode()
        for i in range(1, N_PLUS_ONE)]
    best = 0.0
    for _ in range(3):
        tree = RadixTree()
        start = time.perf_counter()
        for e in events:
            tree.apply_event(1, e)
        best = max(best, len(events) / (time.perf_counter() - start))
    out[f"json_store{width}"] = best
print(json.dumps(out))
""".replace("N_PLUS_ONE", str(N + 1))


def service() -> SelectionService:
    s = SelectionService(Settings(kv_events="push"), random.Random(0))
    s.upsert_worker(WorkerRequest(worker_id=1, model_name="default", endpoint="e", block_size=4), now=0.0)
    return s


def json_events(width: int) -> list[dict[str, object]]:
    return [{"worker_id": 1, "event": {"event_id": i, "dp_rank": 0, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": i * 100 + j, "tokens_hash": i * 100 + j} for j in range(width)]}}}} for i in range(1, N + 1)]


def engine_batches(width: int) -> list[bytes]:
    return [msgpack.packb([0.0, [["BlockStored", [i * 100 + j for j in range(width)], None,
                                  list(range(i, i + 4 * width)), 4, None, "GPU", None, None]], 0])
            for i in range(1, N + 1)]


def rate(fn: object, items: list[object]) -> float:
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        fn(items)  # type: ignore[operator]
        best = max(best, len(items) / (time.perf_counter() - start))
    return best


def in_process() -> dict[str, float]:
    out = {}
    for width in (1, 16):
        events = json_events(width)
        texts = [json.dumps(e) for e in events]

        def apply_json(items: list[str]) -> None:
            s = service()
            for text in items:
                s.handle("POST", "/kv_events", "", [("content-type", "application/json")], text.encode(), now=1.0)

        out[f"json_store{width}"] = rate(apply_json, texts)  # type: ignore[arg-type]

        def apply_typed(items: list[dict[str, object]]) -> None:
            s = service()
            for event in items:
                s.apply_kv_events(decode_json_events(event), now=1.0)

        out[f"typed_store{width}"] = rate(apply_typed, events)  # type: ignore[arg-type]
        batches = engine_batches(width)

        def apply_engine(items: list[bytes]) -> None:
            s = service()
            for payload in items:
                s.apply_engine_batch(payload, worker_id=1, now=1.0)

        out[f"engine_store{width}"] = rate(apply_engine, batches)  # type: ignore[arg-type]
    return out


def over_websocket() -> dict[str, float]:
    from websockets.sync.client import connect

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from test_http import Server, read_response, request

    out = {}
    server = Server()
    try:
        with server.connect() as sock:
            sock.sendall(request("POST", "/workers", {"worker_id": 1, "endpoint": "e", "block_size": 4}))
            read_response(sock, bytearray())
        for width in (1, 16):
            batches = engine_batches(width)
            with connect(f"ws://127.0.0.1:{server.port}/kv_events?worker_id=1&ack=true") as ws:
                start = time.perf_counter()
                for payload in batches:
                    ws.send(payload)
                last = 0
                while last < len(batches):
                    last = json.loads(ws.recv(timeout=60))["ack"]
                out[f"ws_engine_store{width}"] = len(batches) / (time.perf_counter() - start)
    finally:
        server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-python", default=os.environ.get("REFERENCE_PYTHON"))
    args = parser.parse_args()
    ours = {**in_process(), **over_websocket()}
    ref: dict[str, float] = {}
    if args.reference_python:
        result = subprocess.run([args.reference_python, "-c", REFERENCE], capture_output=True, text=True, check=True,
                                env={**os.environ, "RUST_LOG": "error"})
        ref = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"{'figure':<22}{'ours events/s':>15}{'reference':>12}{'ratio':>8}")
    for name, value in ours.items():
        r = ref.get(name)
        print(f"{name:<22}{value:>15,.0f}{(f'{r:,.0f}' if r else '-'):>12}{(f'{value / r:.2f}' if r else '-'):>8}")


if __name__ == "__main__":
    main()
