"""Flow control in `simulate` (docs/FLOW_CONTROL.md): one tenant's burst against another's
steady traffic, over slices of the Mooncake trace, burst shapes, loads and fleet sizes. Tenant `a`
is a slice of the trace as it is (its own prefix reuse), at `load` of the fleet's capacity; tenant
`b` is a burst: the slice's middle requests copied `k` times within a window (`k` times `a`'s rate
there), each copy on its own blocks. Prints a Markdown table of `a`'s TTFT p99 alone and beside the
burst, with one FIFO, with fairness, and with fairness and a burst allowance (the recommended
settings, which `a` alone also runs with).

    python bench/tenants.py [--trace ../shared/traces/conversation_trace.jsonl.gz] [--requests 1500]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from collections.abc import Iterator
from typing import Any

from selection_proto.core.base.settings import Settings
from selection_proto.sim import FleetConfig, parse_trace, simulate

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "conversation_trace.jsonl.gz")
SHAPES = {"short, 10x a's rate, 1/6 of the span": (10, 1 / 6), "long, 4x a's rate, 1/2 of the span": (4, 1 / 2)}
SETTINGS = {"fifo": dict(queue_threshold=1.0, fairness=False), "fair": dict(queue_threshold=1.0),
            "burst": dict(queue_threshold=1.0, fairness_burst_tokens=1 << 20)}


def tenant_lines(path: str, skip: int, count: int, copies: int, window: float, burst: bool = True) -> list[bytes]:
    with gzip.open(path, "rb") as raw:
        records = [json.loads(line) for _, line in zip(range(skip + count), raw, strict=False)][skip:]
    first, last = records[0]["timestamp"], records[-1]["timestamp"]
    span = last - first
    start = first + span * (0.5 - window / 2)
    stop = start + span * window
    out = [dict(r, tenant="a") for r in records]
    if burst:
        middle = [r for r in records if start <= r["timestamp"] < stop]
        shift = 1 << 40
        for copy in range(1, copies + 1):
            for n, r in enumerate(middle):  # spread within the window, each copy on blocks of its own
                at = start + (n + copy / (copies + 1)) * (stop - start) / max(1, len(middle))
                out.append(dict(r, tenant="b", timestamp=at, hash_ids=[h + copy * shift for h in r["hash_ids"]]))
    out.sort(key=lambda r: r["timestamp"])
    return [json.dumps(r).encode() for r in out]


def run(lines: list[bytes], engines: int, load: float, names: list[str]) -> dict[str, Any]:
    def trace() -> Iterator[Any]:
        return parse_trace(lines, "tenants", 512)

    runs = simulate(trace, FleetConfig(engines=engines, load=load),
                    [(name, Settings(kv_events="push", **SETTINGS[name])) for name in names])
    return {r.name: r for r in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--requests", type=int, default=1500)
    args = parser.parse_args()
    print("| slice | burst | engines | a's load | a alone p99 | a p99, FIFO | a p99, fair | a p99, fair + burst "
          "| fair + burst / alone | b mean, FIFO | b mean, fair + burst |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for skip in (0, 5000, 10000):  # the trace has 12,031 requests
        for shape, (copies, window) in SHAPES.items():
            lines = tenant_lines(args.trace, skip, args.requests, copies, window)
            alone_lines = [line for line in lines if b'"tenant": "a"' in line]
            for engines in (4, 8):
                for load in (0.2, 0.4):
                    # `simulate` scales all arrivals to a load: that of `a` is `load`, `b` comes on top.
                    both = run(lines, engines, load * len(lines) / len(alone_lines), ["fifo", "fair", "burst"])
                    alone = run(alone_lines, engines, load, ["burst"])["burst"].tenants["a"]["ttft"]["p99"]
                    fifo, fair, burst = (both[name].tenants for name in ("fifo", "fair", "burst"))
                    print(f"| {skip}+{args.requests} | {shape} | {engines} | {load} | {alone:.2f} "
                          f"| {fifo['a']['ttft']['p99']:.2f} | {fair['a']['ttft']['p99']:.2f} "
                          f"| **{burst['a']['ttft']['p99']:.2f}** | {burst['a']['ttft']['p99'] / alone:.2f} "
                          f"| {fifo['b']['ttft']['mean']:.2f} | {burst['b']['ttft']['mean']:.2f} |", flush=True)

if __name__ == "__main__":
    main()
