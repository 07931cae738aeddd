"""Index lookup latency (64 / 1,024 / 8,192 blocks) and peak memory with 100k and 1M indexed blocks,
ours (DeviceTree) and the reference's RadixTree, each measured in a fresh process.

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
from selection_proto.core.index import DeviceTree
mode, total = sys.argv[1], int(sys.argv[2])
length = total if total <= 8192 else 1024
chains = total // length
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tree = DeviceTree()
for c in range(chains):
    tree.store((1, 0), None, [(c * 10**7 + i, c * 10**7 + i) for i in range(length)])
rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
q = list(range(length))
start = time.perf_counter(); n = 0
while time.perf_counter() - start < 1.0:
    tree.find(q); n += 1
print(json.dumps({"rss_bytes": rss, "lookup_us": 1e6 * (time.perf_counter() - start) / n}))
"""
REFERENCE = """
import json, resource, sys, time
from dynamo.llm import RadixTree
mode, total = sys.argv[1], int(sys.argv[2])
length = total if total <= 8192 else 1024
chains = total // length
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tree = RadixTree()
for c in range(chains):
    blocks = [{"block_hash": c * 10**7 + i, "tokens_hash": c * 10**7 + i} for i in range(length)]
    tree.apply_event(1, json.dumps({"event_id": c + 1, "dp_rank": 0, "data": {"stored": {
        "parent_hash": None, "blocks": blocks}}}).encode())
rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
q = list(range(length))
start = time.perf_counter(); n = 0
while time.perf_counter() - start < 1.0:
    tree.find_matches(q); n += 1
print(json.dumps({"rss_bytes": rss, "lookup_us": 1e6 * (time.perf_counter() - start) / n}))
"""


def measure(python: str, script: str, total: int) -> dict[str, float]:
    out = subprocess.run([python, "-c", script, "x", str(total)], capture_output=True, text=True, check=True,
                         env={**os.environ, "RUST_LOG": "error"}, timeout=1200)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-python", default=os.environ.get("REFERENCE_PYTHON"))
    args = parser.parse_args()
    ours_script = OURS % {"root": ROOT}
    print(f"{'blocks':>9}{'ours lookup us':>16}{'ref lookup us':>15}{'ours MiB':>10}{'ref MiB':>9}")
    for total in (64, 1024, 8192, 100_000, 1_000_000):
        mine = measure(sys.executable, ours_script, total)
        ref = measure(args.reference_python, REFERENCE, total) if args.reference_python else None
        length = total if total <= 8192 else 1024
        print(f"{total:>9,}{mine['lookup_us']:>16,.1f}{(ref['lookup_us'] if ref else float('nan')):>15,.1f}"
              f"{mine['rss_bytes'] / 2**20:>10,.1f}{(ref['rss_bytes'] / 2**20 if ref else float('nan')):>9,.1f}"
              f"   (lookup of {length} blocks)")


if __name__ == "__main__":
    main()
