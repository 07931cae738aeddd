"""The routing table of docs/ROUTING.md: `selection-proto simulate` over several slices of the
Mooncake trace, loads and fleet sizes, for both router policies in process, Dynamo 1.6.1 over
HTTP (`--service`, when `--reference-python` is given) and the baselines.

    python bench/routing.py [--reference-python .venv-reference/bin/python] [--requests 3000] [--synthetic] [--hard]
                            [--baselines]   (also random, round-robin and least-loaded)
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


def synthetic_trace(path: str, requests: int, seed: int = 1) -> None:
    """A high-reuse trace in Mooncake's format: 40 system prompts of 8 blocks, 400 conversations
    each on one of them, whose turns resend the conversation so far plus 1-3 new blocks; Poisson
    arrivals (the rate does not matter: `--load` rescales it)."""
    import random

    rng = random.Random(seed)
    history: dict[int, list[int]] = {}
    next_id, clock = 1_000_000, 0.0
    with open(path, "w") as out:
        for _ in range(requests):
            clock += rng.expovariate(1.0)
            conversation = rng.randrange(400)
            blocks = history.setdefault(conversation, [100 * (conversation % 40) + j for j in range(8)])
            for _ in range(rng.randint(1, 3)):
                blocks.append(next_id)
                next_id += 1
            if len(blocks) > 48:  # a conversation that grew too long starts over on its prompt
                del blocks[8:]
            out.write(json.dumps({"timestamp": int(clock * 1000), "input_length": len(blocks) * 512 - rng.randrange(512),
                                  "output_length": rng.randint(50, 400), "hash_ids": list(blocks)}) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-python", default=None)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--hard", action="store_true",
                        help="docs/ROUTING.md's hard cases: saturation, mixed engine speeds, no prefill_complete, event lag")
    parser.add_argument("--synthetic", action="store_true",
                        help="a generated high-reuse trace instead (synthetic_trace), one slice")
    parser.add_argument("--baselines", action="store_true", help="also the cache-blind baselines")
    args = parser.parse_args()
    if args.synthetic:
        args.trace = os.path.join(tempfile.mkdtemp(), "synthetic.jsonl")
        synthetic_trace(args.trace, args.requests)
    reference = None
    if args.reference_python:
        port = free_port()
        reference = subprocess.Popen([args.reference_python, "-m", "dynamo.select_service", "--port", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "RUST_LOG": "error", "DYN_LOG": "error"})
        wait_for(port)
    cases: list[tuple[int, float, int, tuple[str, ...]]] = [
        (skip, 0.8, 8, ()) for skip in (0, 4000, 8000)]
    cases += [(4000, load, 8, ()) for load in (0.5, 1.0)] + [(4000, 0.8, engines, ()) for engines in (4, 16)]
    if args.synthetic:
        cases = [(0, load, engines, ()) for load, engines in ((0.5, 8), (0.8, 8), (1.0, 8), (0.8, 4), (0.8, 16))]
    if args.hard:  # docs/ROUTING.md's hard cases: saturation, unknown engine speeds, silent clients, event lag
        mixed = ("--engine-speeds", "1,0.5")
        cases = [(skip, load, engines, extra) for skip in (0, 4000) for load, engines, extra in (
            (1.1, 8, ()), (1.2, 8, ()), (0.8, 8, mixed), (0.8, 8, ("--no-prefill-complete",)),
            (0.8, 8, (*mixed, "--no-prefill-complete")), (1.0, 8, (*mixed, "--no-prefill-complete")),
            (0.8, 8, ("--event-delay", "0.5")), (0.5, 4, ()), (0.8, 16, mixed))]
    print("| slice | load | engines | fleet | setting | TTFT mean | p50 | p90 | p99 | hit rate | mean, p99 vs Dynamo |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for skip, load, engines, extra in cases:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                command = [sys.executable, "-m", "selection_proto", "simulate", args.trace, "--skip", str(skip),
                           "--requests", str(args.requests), "--load", str(load), "--engines", str(engines),
                           "--compare", "router_policy=dynamo", "router_policy=ttft", "--json", out.name,
                           *([] if args.baselines else ["--no-baselines"]), *extra]
                if reference is not None:
                    command += ["--service", f"http://127.0.0.1:{port}"]
                subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                runs = json.load(open(out.name))["settings"]
            # Dynamo is the reference over HTTP when it runs, else its cost in process.
            dynamo = next((r for r in runs if r["name"].startswith("service")), runs[0])["ttft"]
            fleet = " ".join(extra).replace("--engine-speeds ", "speeds ").replace("--", "") or "-"
            for run in runs:
                name = "Dynamo 1.6.1 (--service)" if run["name"].startswith("service") else run["name"]
                t = run["ttft"]
                print(f"| {skip}-{skip + args.requests} | {load} | {engines} | {fleet} | {name} | {t['mean']:.3f} "
                      f"| {t['p50']:.3f} | {t['p90']:.3f} | {t['p99']:.3f} | {run['hit_rate']:.3f} "
                      f"| {t['mean'] / dynamo['mean']:.2f}x, {t['p99'] / dynamo['p99']:.2f}x |", flush=True)
    finally:
        if reference is not None:
            reference.terminate()
            reference.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
