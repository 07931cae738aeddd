"""The prefill/decode table of docs/PD.md: `selection-proto simulate --pd` over the Mooncake trace and
two synthetic traces this script writes (seeded: the same bytes every time), at several loads and
fleet sizes. Each row is one run of the command it prints; each command stays under a minute on the
shared 2-core machine.

    python bench/pd.py [--out DIR] [--traces-only]

Synthetic traces (Mooncake format, 512-token blocks, ids no other trace uses):
- `long_io.jsonl`: 500 fresh prompts of 4,096-16,384 tokens, 500-1,500 output tokens each.
- `chat.jsonl`: 1,000 turns of 100 conversations: a shared 1,024-token system prompt, then each
  turn the conversation so far (its earlier prompts and answers) plus 100-600 new tokens; 100-400
  output tokens. A conversation restarts past 12,000 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRACE = os.path.join(ROOT, "..", "shared", "traces", "conversation_trace.jsonl.gz")
BLOCK = 512


def long_io(path: str) -> None:
    rng = random.Random(1)
    next_id, at = 1 << 40, 0.0
    with open(path, "w") as out:
        for _ in range(500):
            isl, osl = rng.randint(4096, 16_384), rng.randint(500, 1500)
            blocks = -(-isl // BLOCK)
            out.write(json.dumps({"timestamp": round(at), "input_length": isl, "output_length": osl,
                                  "hash_ids": list(range(next_id, next_id + blocks))}) + "\n")
            next_id += blocks
            at += rng.expovariate(1 / 100)  # ms; --load rescales the spacing


def chat(path: str) -> None:
    rng = random.Random(2)
    next_id = 1 << 41
    system = list(range(next_id, next_id + 2))  # 1,024 tokens every conversation starts with
    next_id += 2
    conversations: list[list[int]] = [[] for _ in range(100)]  # each one's hash ids so far (whole blocks)
    at = 0.0
    with open(path, "w") as out:
        for _ in range(1000):
            talk = rng.randrange(len(conversations))
            ids = conversations[talk]
            if not ids or len(ids) * BLOCK > 12_000:
                ids[:] = list(system)
            new = -(-rng.randint(100, 600) // BLOCK)  # the turn's new tokens, in whole blocks
            ids += range(next_id, next_id + new)
            next_id += new
            osl = rng.randint(100, 400)
            out.write(json.dumps({"timestamp": round(at), "input_length": len(ids) * BLOCK, "output_length": osl,
                                  "hash_ids": list(ids)}) + "\n")
            answer = -(-osl // BLOCK)  # the answer joins the conversation's context
            ids += range(next_id, next_id + answer)
            next_id += answer
            at += rng.expovariate(1 / 100)


RUNS = (  # (trace, flags)
    ("mooncake", ("--skip", "4000", "--requests", "1000", "--engines", "8", "--load", "0.5",
                  "--pd", "2:6", "4:4", "6:2")),
    ("mooncake", ("--skip", "4000", "--requests", "1000", "--engines", "8", "--load", "0.8",
                  "--pd", "4:4", "6:2")),
    ("mooncake", ("--skip", "4000", "--requests", "1000", "--engines", "8", "--load", "0.5", "--pd", "4:4",
                  "--link-gbps", "25")),
    ("mooncake", ("--skip", "4000", "--requests", "1000", "--engines", "8", "--load", "0.5", "--pd", "4:4",
                  "--link-gbps", "400")),
    ("mooncake", ("--skip", "4000", "--requests", "600", "--engines", "4", "--load", "0.5",
                  "--pd", "1:3", "2:2", "3:1")),
    ("long_io", ("--engines", "8", "--load", "0.5", "--pd", "2:6", "4:4")),
    ("long_io", ("--engines", "8", "--load", "0.8", "--pd", "2:6", "4:4")),
    ("chat", ("--engines", "8", "--load", "0.5", "--pd", "2:6", "4:4")),
    ("chat", ("--engines", "8", "--load", "0.8", "--pd", "2:6", "4:4")),
)
DECIDERS = ("--deciders", "isl_bounding,uncached_threshold,always,never,ttft")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for the synthetic traces (default: a temporary one)")
    parser.add_argument("--traces-only", action="store_true", help="write the synthetic traces and stop")
    args = parser.parse_args()
    folder = args.out or tempfile.mkdtemp(prefix="pd-traces-")
    os.makedirs(folder, exist_ok=True)
    paths = {"mooncake": TRACE, "long_io": os.path.join(folder, "long_io.jsonl"),
             "chat": os.path.join(folder, "chat.jsonl")}
    long_io(paths["long_io"])
    chat(paths["chat"])
    if args.traces_only:
        print(folder)
        return 0
    print("| trace | engines | load | link Gb/s | fleet, decider | remote | TTFT mean | p50 | p99 | TPOT mean (ms) "
          "| p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    commands = []
    for name, flags in RUNS:
        out = os.path.join(folder, "run.json")
        command = ["selection-proto", "simulate", paths[name], *flags, *DECIDERS, "--json", out]
        commands.append(" ".join(command).replace(folder, "$TRACES").replace(TRACE, "$MOONCAKE"))
        done = subprocess.run([sys.executable, "-m", "selection_proto", *command[1:]], check=True,
                              capture_output=True, text=True, cwd=ROOT)
        commands[-1] += "    # " + done.stdout.strip().splitlines()[-1]  # its runs, requests and seconds
        with open(out) as f:
            document = json.load(f)
        fleet = document["fleet"]
        for s in document["settings"]:
            t, p = s["ttft"], s["tpot"]
            print(f"| {name} | {fleet['engines']} | {fleet['load']} | {fleet['link_bytes_per_sec'] * 8 / 1e9:g} "
                  f"| {s['name']} | {s['remote_share']:.2f} "
                  f"| {t['mean']:.3f} | {t['p50']:.3f} | {t['p99']:.3f} | {p['mean'] * 1000:.1f} "
                  f"| {p['p99'] * 1000:.1f} |")
    print()
    for command in commands:
        print("    " + command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
