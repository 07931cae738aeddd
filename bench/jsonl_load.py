"""JSON-lines calls per second: `selection-proto stdio` as a subprocess, N pipelined `select` calls.

    python bench/jsonl_load.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import BLOCK_SIZE, WORKERS, prompts  # noqa: E402


def _write(pipe: object, data: bytes) -> None:
    pipe.write(data)  # type: ignore[attr-defined]
    pipe.flush()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    for tokens in (1024, 16384):
        proc = subprocess.Popen([sys.executable, "-m", "selection_proto", "stdio", "--kv-events", "push",
                                 "--log-level", "warning"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        setup = b"".join(json.dumps({"jsonrpc": "2.0", "id": f"w{w}", "method": "workers.create", "params": {
            "worker_id": w, "model_name": "m", "endpoint": f"http://w{w}", "block_size": BLOCK_SIZE}}).encode() + b"\n"
            for w in range(WORKERS))
        proc.stdin.write(setup)
        proc.stdin.flush()
        for _ in range(WORKERS):
            proc.stdout.readline()
        calls = args.calls if tokens == 1024 else args.calls // 8
        prompt = prompts(tokens, 1)[0]
        lines = [json.dumps({"jsonrpc": "2.0", "id": i, "method": "select",
                             "params": {"model_name": "m", "token_ids": prompt}}).encode() + b"\n"
                 for i in range(calls)]
        start = time.perf_counter()
        writer = threading.Thread(target=_write, args=(proc.stdin, b"".join(lines)))
        writer.start()
        for _ in range(calls):
            assert b'"result"' in proc.stdout.readline()
        elapsed = time.perf_counter() - start
        writer.join()
        proc.stdin.close()
        proc.wait(timeout=60)
        print(f"{tokens:>6} tokens: {calls / elapsed:,.0f} select calls/s over JSON lines ({calls} calls)")


if __name__ == "__main__":
    main()
