"""Flow control in `simulate` (docs/FLOW_CONTROL.md): one tenant's burst against another's
steady traffic, over slices of the Mooncake trace, burst shapes, loads and fleet sizes. Tenant `a`
is a slice of the trace as it is (its own prefix reuse), at `load` of the fleet's capacity; tenant
`b` is a burst: the slice's middle requests copied `k` times within a window (`k` times `a`'s rate
there), each copy on its own blocks. Prints a Markdown table of `a`'s TTFT p99 alone and beside the
burst, with one FIFO, with fairness and a burst allowance (before), and with those and a share of the
KV in flight (`fairness_kv_share=1`: the recommended settings, which `a` alone also runs with, and
must run the same without).

    python bench/tenants.py [--trace ../shared/traces/conversation_trace.jsonl.gz] [--requests 1500]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from selection_proto.core.base.settings import Settings
from selection_proto.sim import FleetConfig, parse_trace, simulate
from selection_proto.sim.engine import SimRequest

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "conversation_trace.jsonl.gz")
SHAPES = {"short, 10x a's rate, 1/6 of the span": (10, 1 / 6), "long, 4x a's rate, 1/2 of the span": (4, 1 / 2)}
SETTINGS = {"fifo": dict(queue_threshold=1.0, fairness=False), "fair": dict(queue_threshold=1.0),
            "burst": dict(queue_threshold=1.0, fairness_burst_tokens=1 << 20),
            "share": dict(queue_threshold=1.0, fairness_burst_tokens=1 << 20, fairness_kv_share=1.0)}


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


def run(lines: list[bytes], engines: int, load: float, names: list[str],
        watch: Callable[[str, SimRequest], None] | None = None) -> dict[str, Any]:
    def trace() -> Iterator[Any]:
        return parse_trace(lines, "tenants", 512)

    runs = simulate(trace, FleetConfig(engines=engines, load=load),
                    [(name, Settings(kv_events="push", **SETTINGS[name])) for name in names], watch)
    return {r.name: r for r in runs}


def explain(requests: list[SimRequest]) -> str:
    """Where `a`'s slowest 1% spent their time (seconds in the router's queue, in the engine's, in
    prefill), and `a`'s demand during `b`'s burst over half of what the fleet served then (above 1:
    `a` asks more than its share), both in uncached prompt tokens."""
    a = sorted((r for r in requests if r.tenant == "a"), key=lambda r: r.first_token - r.arrival)
    slow = a[int(0.99 * len(a)):]
    burst = [r.arrival for r in requests if r.tenant == "b"]
    start, stop = min(burst), max(burst)
    asked = sum(r.isl - r.cached for r in a if start <= r.arrival <= stop)
    served = sum(r.isl - r.cached for r in requests if start <= r.started <= stop)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    return (f"{mean([r.dispatched - r.arrival for r in slow]):.2f} / {mean([r.started - r.dispatched for r in slow]):.2f}"
            f" / {mean([r.first_token - r.started for r in slow]):.2f} | {asked / (served / 2):.2f}")


def cases(args: argparse.Namespace) -> Iterator[tuple[int, str, list[bytes], list[bytes], int, float]]:
    """(slice start, burst shape, both tenants' lines, `a`'s, engines, `a`'s load) of each case."""
    for skip in (0, 5000, 10000):  # the trace has 12,031 requests
        for shape, (copies, window) in SHAPES.items():
            lines = tenant_lines(args.trace, skip, args.requests, copies, window)
            alone_lines = [line for line in lines if b'"tenant": "a"' in line]
            for engines in (4, 8):
                for load in (0.2, 0.4):  # `simulate` scales all arrivals: `a`'s is `load`, `b` on top
                    yield skip, shape, lines, alone_lines, engines, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--explain", action="store_true",
                        help="where a's slowest 1%% waited, and a's demand against its share during the burst")
    args = parser.parse_args()
    if args.explain:
        print("| slice | burst | engines | a's load | a's slowest 1%: router / engine / prefill s, before "
              "| a's demand / half served, before | a's slowest 1%, recommended | a's demand / half served, recommended |")
        print("|---|---|---|---|---|---|---|---|")
        for skip, shape, lines, alone_lines, engines, load in cases(args):
            seen: dict[str, list[SimRequest]] = {"burst": [], "share": []}
            run(lines, engines, load * len(lines) / len(alone_lines), ["burst", "share"],
                lambda name, req, seen=seen: seen[name].append(req))
            print(f"| {skip}+{args.requests} | {shape} | {engines} | {load} | {explain(seen['burst'])} "
                  f"| {explain(seen['share'])} |", flush=True)
        return
    print("| slice | burst | engines | a's load | a alone p99 | a p99, FIFO | a p99, fair + burst (before) "
          "| a p99, recommended | before / alone | **recommended / alone** | b mean, FIFO | b mean, before "
          "| b mean, recommended | b failed, before / recommended |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for skip, shape, lines, alone_lines, engines, load in cases(args):
        both = run(lines, engines, load * len(lines) / len(alone_lines), ["fifo", "burst", "share"])
        solo = run(alone_lines, engines, load, ["burst", "share"])
        # One fairness ID never meets the KV share: `a` alone runs the same with it or without.
        assert solo["burst"].tenants == solo["share"].tenants
        alone = solo["share"].tenants["a"]["ttft"]["p99"]
        fifo, before, now = (both[name].tenants for name in ("fifo", "burst", "share"))
        print(f"| {skip}+{args.requests} | {shape} | {engines} | {load} | {alone:.2f} "
              f"| {fifo['a']['ttft']['p99']:.2f} | {before['a']['ttft']['p99']:.2f} "
              f"| **{now['a']['ttft']['p99']:.2f}** | {before['a']['ttft']['p99'] / alone:.2f} "
              f"| **{now['a']['ttft']['p99'] / alone:.2f}** | {fifo['b']['ttft']['mean']:.2f} "
              f"| {before['b']['ttft']['mean']:.2f} | {now['b']['ttft']['mean']:.2f} "
              f"| {before['b']['failed']} / {now['b']['failed']} |", flush=True)


if __name__ == "__main__":
    main()
