"""`selection-proto relay`: a pyzmq PUB publishing vLLM batches reaches the index through the relay."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import zmq
from test_http import Server
from test_subscriptions import device_blocks, free_port, http, vllm_batch, wait_for


def test_relay_forwards_in_order_and_reports_counters() -> None:
    zport = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{zport}")
    server = Server()
    relay = None
    try:
        http(server.port, "POST", "/workers", {"worker_id": 3, "endpoint": "http://w3", "block_size": 4})
        relay = subprocess.Popen(
            [sys.executable, "-m", "selection_proto", "relay", "--zmq", f"tcp://127.0.0.1:{zport}",
             "--to", f"ws://127.0.0.1:{server.port}/kv_events", "--worker-id", "3"],
            stderr=subprocess.PIPE, text=True)
        seq = iter(range(1, 10_000))

        def publish() -> None:
            pub.send_multipart([b"kv", next(seq).to_bytes(8, "big"), vllm_batch([31, 32], list(range(1, 9)))])
            pub.send_multipart([b"bad"])  # not three frames: counted, never sent

        assert wait_for(lambda: device_blocks(server.port) == {3: 2}, step=publish)
        time.sleep(0.5)
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(timeout=15) == 0
        assert relay.stderr is not None
        records = [json.loads(line) for line in relay.stderr.read().splitlines()]
        final = [r for r in records if r["event"] == "relay_stopped"][-1]
        assert final["forwarded"] >= 1 and final["invalid_frames"] >= 1
        assert final["dropped_overflow"] == 0
    finally:
        if relay is not None and relay.poll() is None:
            relay.kill()
        assert server.stop() == 0
        pub.close(linger=0)


def test_relay_usage_errors() -> None:
    result = subprocess.run([sys.executable, "-m", "selection_proto", "relay", "--zmq", "inproc://x", "--to",
                             "ws://h/kv_events", "--worker-id", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "selection-proto: error: --zmq: expected a tcp:// or ipc:// endpoint, not 'inproc://x'"
