"""The routing table of docs/ROUTING.md: `selection-proto simulate` over several slices of the
Mooncake trace, loads and fleet sizes, for both router policies in process, Dynamo 1.6.1 over
HTTP (`--service`, when `--reference-python` is given) and the baselines.

    python bench/routing.py [--reference-python .venv-reference/bin/python] [--requests 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRACE = os.path.join(ROOT, "..", "shared", "traces", "conversation_trace.jsonl.gz")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-python", default=None)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--trace", default=TRACE)
    args = parser.parse_args()
    reference = None
    if args.reference_python:
        port = free_port()
        reference = subprocess.Popen([args.reference_python, "-m", "dynamo.select_service", "--port", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "RUST_LOG": "error", "DYN_LOG": "error"})
        wait_for(port)
    cases = [(skip, load, engines) for skip in (0, 4000, 8000) for load, engines in ((0.8, 8),)]
    cases += [(4000, load, 8) for load in (0.5, 1.0)] + [(4000, 0.8, engines) for engines in (4, 16)]
    print("| slice | load | engines | setting | TTFT mean | p50 | p90 | p99 | hit rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for skip, load, engines in cases:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                command = [sys.executable, "-m", "selection_proto", "simulate", args.trace, "--skip", str(skip),
                           "--requests", str(args.requests), "--load", str(load), "--engines", str(engines),
                           "--compare", "router_policy=dynamo", "--compare", "router_policy=ttft", "--json", out.name]
                if reference is not None:
                    command += ["--service", f"http://127.0.0.1:{port}"]
                subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                runs = json.load(open(out.name))["settings"]
            for run in runs:
                name = "Dynamo 1.6.1 (--service)" if run["name"].startswith("service") else run["name"]
                t = run["ttft"]
                print(f"| {skip}-{skip + args.requests} | {load} | {engines} | {name} | {t['mean']:.3f} "
                      f"| {t['p50']:.3f} | {t['p90']:.3f} | {t['p99']:.3f} | {run['hit_rate']:.3f} |", flush=True)
    finally:
        if reference is not None:
            reference.terminate()
            reference.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
