"""A new subscription's replay of a long engine history (docs/GATEWAY.md, "Replay at start"): how
long a fresh `serve --kv-events subscribe` takes to apply it, what it lost, and `/health`'s worst
meanwhile against its idle worst.

    python bench/replay.py [--batches 10000] [--blocks 2] [--clear-at SEQ]

The engine is tests/test_engine_replay.py's stand-in: a ZMQ PUB and a ROUTER replay socket framed
as vLLM frames them, keeping every batch (vLLM keeps its last 10,000).
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack  # noqa: E402

from tests.test_engine_replay import Engine, metric  # noqa: E402
from tests.test_http import Server, api_call  # noqa: E402

BLOCKS = 'selection_proto_index_blocks{model_name="m",tenant_id="default",tier="device"}'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=2, help="blocks stored per batch")
    parser.add_argument("--clear-at", type=int, default=-1, help="a batch that is an AllBlocksCleared")
    opts = parser.parse_args()

    def payload(seq: int) -> bytes:
        if seq == opts.clear_at:
            return msgpack.packb([time.time(), [["AllBlocksCleared"]], 0])
        hashes = [seq * 100 + i for i in range(opts.blocks)]
        return msgpack.packb([time.time(), [["BlockStored", hashes, None, list(range(32 * opts.blocks)), 32,
                                             None, "GPU", None, None]], 0])

    engine = Engine(keep=opts.batches + 1)
    for seq in range(opts.batches):
        engine.buffer.append((seq, payload(seq)))
    server = Server(mode="subscribe")
    worst, stop = [0.0], threading.Event()

    def probe() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        while not stop.is_set():
            started = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            worst[0] = max(worst[0], time.perf_counter() - started)
            time.sleep(0.005)

    try:
        api_call(server.port, "POST", "/workers", {
            "worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 32,
            "kv_events_endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint})
        threading.Thread(target=probe, daemon=True).start()
        time.sleep(1.0)
        idle, worst[0] = worst[0], 0.0
        live = payload(opts.batches)
        engine.buffer.append((opts.batches, live))
        kept = opts.batches + 1 - (opts.clear_at + 1 if opts.clear_at >= 0 else 0)
        started = time.perf_counter()
        while metric(server.port, BLOCKS) < kept * opts.blocks and time.perf_counter() - started < 60:
            engine.pub.send_multipart([b"", opts.batches.to_bytes(8, "big"), live])  # until it lands
            time.sleep(0.05)
        took = time.perf_counter() - started
        stop.set()
        lost = metric(server.port, 'selection_proto_kv_replay_total{result="unrecovered"}')
        print(f"{opts.batches + 1} batches of {opts.blocks} blocks (clear at {opts.clear_at}): applied in "
              f"{took:.2f} s, {lost:.0f} lost; /health worst {worst[0] * 1000:.0f} ms (idle {idle * 1000:.0f} ms)")
    finally:
        stop.set()
        server.stop()
        engine.close()


if __name__ == "__main__":
    main()
