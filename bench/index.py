"""Index lookup latency (64 / 1,024 / 8,192 blocks) and memory with 100k and 1M indexed blocks, ours
(DeviceTree) and the reference's RadixTree, each measured in a fresh process: `MiB` is the growth
of peak RSS while the blocks are stored (resizes of tables included), `held` the growth of
resident memory once they are (what the index keeps). Hashes are small integers, as in the first
runs of this benchmark; the last row spreads them over 64 bits, as real ones are.

    python bench/index.py [--reference-python PY]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# One worker holds `chains` chains of `length` blocks; a lookup walks a whole chain.
OURS = """
import json, resource, sys, time
sys.path.insert(0, %(root)r)
from selection_proto.core.cache.index import DeviceTree
mode, total = sys.argv[1], int(sys.argv[2])
# "wide": hashes spread over 64 bits, as real ones are (a Python int of 61+ bits takes 48 bytes)
spread = (lambda h: (h * 0x9E3779B97F4A7C15) & (2**64 - 1)) if mode == "wide" else (lambda h: h)
length = total if total <= 8192 else 1024
chains = total // length
def resident(): return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
held = resident()
tree = DeviceTree()
for c in range(chains):
    tree.store((1, 0), None, [(spread(c * 10**7 + i), spread(c * 10**7 + i)) for i in range(length)])
rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
held = resident() - held
q = [spread(i) for i in range(length)]
start = time.perf_counter(); n = 0
while time.perf_counter() - start < 1.0:
    tree.find(q); n += 1
print(json.dumps({"rss_bytes": rss, "held_bytes": held, "lookup_us": 1e6 * (time.perf_counter() - start) / n}))
"""
REFERENCE = """
import json, resource, sys, time
from dynamo.llm import RadixTree
mode, total = sys.argv[1], int(sys.argv[2])
# "wide": hashes spread over 64 bits, as real ones are (a Python int of 61+ bits takes 48 bytes)
spread = (lambda h: (h * 0x9E3779B97F4A7C15) & (2**64 - 1)) if mode == "wide" else (lambda h: h)
length = total if total <= 8192 else 1024
chains = total // length
def resident(): return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
held = resident()
tree = RadixTree()
for c in range(chains):
    blocks = [{"block_hash": spread(c * 10**7 + i), "tokens_hash": spread(c * 10**7 + i)} for i in range(length)]
    tree.apply_event(1, json.dumps({"event_id": c + 1, "dp_rank": 0, "data": {"stored": {
        "parent_hash": None, "blocks": blocks}}}).encode())
rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
held = resident() - held
q = [spread(i) for i in range(length)]
start = time.perf_counter(); n = 0
while time.perf_counter() - start < 1.0:
    tree.find_matches(q); n += 1
print(json.dumps({"rss_bytes": rss, "held_bytes": held, "lookup_us": 1e6 * (time.perf_counter() - start) / n}))
"""


def measure(python: str, script: str, total: int, mode: str) -> dict[str, float]:
    out = subprocess.run([python, "-c", script, mode, str(total)], capture_output=True, text=True, check=True,
                         env={**os.environ, "RUST_LOG": "error"}, timeout=1200)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-python", default=os.environ.get("REFERENCE_PYTHON"))
    args = parser.parse_args()
    ours_script = OURS % {"root": ROOT}
    print(f"{'blocks':>9}{'ours lookup us':>16}{'ref lookup us':>15}{'ours MiB':>10}{'ref MiB':>9}"
          f"{'ours held':>11}{'ref held':>10}")
    for total, mode in ((64, "small"), (1024, "small"), (8192, "small"), (100_000, "small"),
                        (1_000_000, "small"), (1_000_000, "wide")):
        mine = measure(sys.executable, ours_script, total, mode)
        ref = measure(args.reference_python, REFERENCE, total, mode) if args.reference_python else None
        length = total if total <= 8192 else 1024
        print(f"{total:>9,}{mine['lookup_us']:>16,.1f}{(ref['lookup_us'] if ref else float('nan')):>15,.1f}"
              f"{mine['rss_bytes'] / 2**20:>10,.1f}{(ref['rss_bytes'] / 2**20 if ref else float('nan')):>9,.1f}"
              f"{mine['held_bytes'] / 2**20:>11,.1f}{(ref['held_bytes'] / 2**20 if ref else float('nan')):>10,.1f}"
              f"   (lookup of {length} blocks{', 64-bit hashes' if mode == 'wide' else ''})")


if __name__ == "__main__":
    main()
