"""`simulate`'s speed and memory: trace requests per second per setting, and peak memory for a
slice of the trace against the whole of it (the trace is streamed: memory must stay flat).

    python bench/simulate.py [--trace ../shared/traces/conversation_trace.jsonl.gz]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = """
import gzip, json, resource, sys, time
from selection_proto.core.base.settings import Settings
from selection_proto.sim import FleetConfig, parse_trace, simulate
path, limit = sys.argv[1], int(sys.argv[2])
def trace():
    return parse_trace(gzip.open(path), path, 512, limit=limit)
started = time.perf_counter()
runs = simulate(trace, FleetConfig(), [("default", Settings(kv_events="push"))])
seconds = time.perf_counter() - started
print(json.dumps({"requests": runs[0].requests, "seconds": seconds,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", default=os.path.join(ROOT, "..", "shared", "traces", "conversation_trace.jsonl.gz"))
    args = parser.parse_args()
    print("| requests | seconds (both passes) | requests a second | peak RSS (MiB) |")
    print("|---|---|---|---|")
    for limit in (3000, 12031):
        done = subprocess.run([sys.executable, "-c", CHILD, args.trace, str(limit)], capture_output=True,
                              text=True, check=True, cwd=ROOT)
        row = json.loads(done.stdout)
        print(f"| {row['requests']:,} | {row['seconds']:.1f} | {row['requests'] / row['seconds']:,.0f} "
              f"| {row['max_rss_mib']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
