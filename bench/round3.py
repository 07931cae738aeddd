"""Routing round three (docs/ROUTING.md, "How close to the oracle"): `router_policy=ttft` against
the all-knowing oracle and Dynamo 1.6.1 over several traces, loads, fleet sizes and client
behaviours, with the variants that were measured before deciding them:

- `round 2`: ttft without reading a prefill's end from the engine's events;
- `+ttl 1 s`: the blocks of in-flight prefills visible to the next selection (`predicted_ttl_secs=1`);
- `whole`: a rank's running prefill counted whole until it ends, as before it was counted by what
  is left of it (`cost.COUNT_WHAT_IS_LEFT` off);
- `tokens`: what is left of it measured in plain tokens at the learned rate, as before its
  progress was weighed by each token's context (`cost.WEIGH_CONTEXT_IN_LEFT` off).

`round 2` also leaves saturated ranks unread (`cost.READ_SATURATION` off): without prefill ends
its booked prefill stays booked until requests are freed and would read every rank saturated.

    python bench/round3.py [--reference-python .venv-reference/bin/python] [--requests 2000] [--quick]
                           [--seeds 0,1,...] [--slices 0,4000]

`--seeds` runs each case once per seed (the random tie-breaks of every router; the trace and the
fleet stay) with the oracle, Dynamo's cost and `ttft` only, and prints per case the geometric
mean of ttft / oracle over the seeds, its range, and how many seeds are past 1.10x: a single
case moves by up to ±15% with the seed (docs/ROUTING.md, "How close to the oracle"). `--slices`
names where the conversation trace's cases start (0 and 4000 unless given); with `--seeds` and
more than two slices, a second table gives each configuration over all its slices and seeds.

Runs in process (`simulate`'s API); Dynamo 1.6.1 over HTTP when `--reference-python` is given,
else its cost in process (`router_policy=dynamo`) stands in for it."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from routing import TRACE, free_port, synthetic_trace, wait_for  # noqa: E402

import selection_proto.core.routing.cost as cost  # noqa: E402
import selection_proto.core.routing.selection as selection  # noqa: E402
from selection_proto.core.base.settings import Settings  # noqa: E402
from selection_proto.sim import FleetConfig, parse_trace, simulate  # noqa: E402
from selection_proto.sim.command import _lines  # noqa: E402
from selection_proto.sim.fleet import SettingRun  # noqa: E402

TTFT = Settings(kv_events="push", router_policy="ttft")


def run_one(trace: Callable[[], Iterator[Any]], config: FleetConfig, name: str, setting: Settings | str | None,
            left: bool = True, round2: bool = False, context: bool = True) -> SettingRun:
    cost.COUNT_WHAT_IS_LEFT = left
    cost.READ_SATURATION = not round2  # round 2 reads no prefill ends: every rank would read saturated
    cost.WEIGH_CONTEXT_IN_LEFT = context
    reads = selection.Selector._reads_prefill_ends
    if round2:
        selection.Selector._reads_prefill_ends = property(lambda self: False)  # type: ignore[method-assign,assignment]
    try:
        (result,) = simulate(trace, config, [(name, setting)])
    finally:
        cost.COUNT_WHAT_IS_LEFT = True
        cost.WEIGH_CONTEXT_IN_LEFT = True
        cost.READ_SATURATION = True
        selection.Selector._reads_prefill_ends = reads  # type: ignore[method-assign]
    return result


def case_trace(name: str, skip: int, synthetic: str, requests: int) -> Callable[[], Iterator[Any]]:
    """A case's trace, read afresh at each call: the conversation trace from `skip`, or the synthetic one."""
    path, skip = (TRACE, skip) if name == "conversation" else (synthetic, 0)
    return lambda: parse_trace(_lines(path), path, 512, skip=skip, limit=requests, kv_blocks=1000)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-python", default=None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="four cases only")
    parser.add_argument("--seeds", help="comma-separated seeds: ttft, the oracle and Dynamo's cost at each")
    parser.add_argument("--slices", default="0,4000", help="comma-separated requests of the conversation trace "
                        "its cases skip")
    args = parser.parse_args()
    synthetic = os.path.join(tempfile.mkdtemp(), "synthetic.jsonl")
    synthetic_trace(synthetic, args.requests)
    reference = url = None
    if args.reference_python:
        port = free_port()
        reference = subprocess.Popen([args.reference_python, "-m", "dynamo.select_service", "--port", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "RUST_LOG": "error", "DYN_LOG": "error"})
        wait_for(port)
        url = f"http://127.0.0.1:{port}"
    # (trace, skip, load, engines, clients report prefill_complete, engine speeds)
    cases: list[tuple[str, int, float, int, bool, tuple[float, ...]]] = []
    slices = [int(s) for s in args.slices.split(",")]
    for skip in slices:
        cases += [("conversation", skip, load, engines, True, ()) for load, engines in ((0.8, 8), (1.1, 8), (0.8, 4), (0.8, 16))]
        cases += [("conversation", skip, 0.8, 8, False, ()), ("conversation", skip, 0.8, 8, True, (1.0, 0.5)),
                  ("conversation", skip, 0.8, 8, False, (1.0, 0.5))]
    cases += [("high reuse", 0, load, engines, told, ()) for load, engines, told in (
        (0.8, 8, True), (1.1, 8, True), (0.8, 4, True), (0.8, 8, False))]
    if args.quick:
        cases = cases[:1] + cases[4:5] + cases[-4:-3] + cases[-1:]
    if len(slices) > 2:  # the configurations a slice's trajectory moves most, at 0.8 on 8 or 16 engines
        cases = [case for case in cases if case[2] == 0.8 and case[3] in (8, 16)]
    if args.seeds:
        try:
            return over_seeds(cases, [int(s) for s in args.seeds.split(",")], synthetic, args.requests, url)
        finally:
            if reference is not None:
                reference.terminate()
    print("| trace | slice | load | engines | clients | speeds | oracle mean | Dynamo mean / p99 | ttft mean / p99 "
          "| ttft / oracle | ttft / Dynamo: mean, p99 | round 2 / oracle | +ttl 1 s / oracle | whole / oracle "
          "| tokens: mean, p99 / oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for name, skip, load, engines, told, speeds in cases:
            trace = case_trace(name, skip, synthetic, args.requests)
            skip = skip if name == "conversation" else 0
            config = FleetConfig(engines=engines, load=load, prefill_complete=told, engine_speeds=speeds)
            oracle = run_one(trace, config, "oracle", None)
            dynamo = run_one(trace, config, "dynamo", url or Settings(kv_events="push"))
            ttft = run_one(trace, config, "ttft", TTFT)
            round2 = run_one(trace, config, "ttft", TTFT, left=False, round2=True)
            ttl = run_one(trace, config, "ttl", Settings(kv_events="push", router_policy="ttft", predicted_ttl_secs=1.0))
            whole = run_one(trace, config, "whole", TTFT, left=False)
            tokens = run_one(trace, config, "tokens", TTFT, context=False)
            o, d, t = oracle.ttft, dynamo.ttft, ttft.ttft
            print(f"| {name} | {skip}-{skip + args.requests} | {load} | {engines} | "
                  f"{'report' if told else 'silent'} | {','.join(map(str, speeds)) or '-'} | {o['mean']:.3f} "
                  f"| {d['mean']:.3f} / {d['p99']:.3f} | {t['mean']:.3f} / {t['p99']:.3f} | {t['mean'] / o['mean']:.2f}x "
                  f"| {t['mean'] / d['mean']:.2f}x, {t['p99'] / d['p99']:.2f}x "
                  f"| {round2.ttft['mean'] / o['mean']:.2f}x | {ttl.ttft['mean'] / o['mean']:.2f}x "
                  f"| {whole.ttft['mean'] / o['mean']:.2f}x "
                  f"| {tokens.ttft['mean'] / o['mean']:.2f}x ({tokens.ttft['mean']:.3f} / {tokens.ttft['p99']:.3f}) |",
                  flush=True)
    finally:
        if reference is not None:
            reference.terminate()
            reference.wait(timeout=30)
    return 0


def over_seeds(cases: list[tuple[str, int, float, int, bool, tuple[float, ...]]], seeds: list[int], synthetic: str,
               requests: int, url: str | None) -> int:
    print(f"| trace | slice | load | engines | clients | speeds | oracle mean | Dynamo mean | ttft mean "
          f"| ttft / oracle over {len(seeds)} seeds: geometric mean (range) | seeds past 1.10x | ttft / Dynamo |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    by_configuration: dict[tuple[str, float, int, bool, tuple[float, ...]], list[float]] = {}
    for name, skip, load, engines, told, speeds in cases:
        trace = case_trace(name, skip, synthetic, requests)
        skip = skip if name == "conversation" else 0
        runs = []
        for seed in seeds:
            config = FleetConfig(engines=engines, load=load, prefill_complete=told, engine_speeds=speeds, seed=seed)
            runs.append([run_one(trace, config, label, setting).ttft["mean"] for label, setting in (
                ("oracle", None), ("dynamo", url or Settings(kv_events="push")), ("ttft", TTFT))])
        ratios = [t / o for o, _, t in runs]
        by_configuration.setdefault((name, load, engines, told, speeds), []).extend(ratios)
        geomean = statistics.geometric_mean(ratios)
        oracle, dynamo, ttft = (statistics.fmean(column) for column in zip(*runs, strict=True))
        print(f"| {name} | {skip}-{skip + requests} | {load} | {engines} | {'report' if told else 'silent'} "
              f"| {','.join(map(str, speeds)) or '-'} | {oracle:.3f} | {dynamo:.3f} | {ttft:.3f} "
              f"| {geomean:.3f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {sum(r > 1.10 for r in ratios)} "
              f"| {ttft / dynamo:.2f}x |", flush=True)
    if len({case[1] for case in cases}) > 2:
        print("\n| trace | load | engines | clients | speeds | runs | ttft / oracle: geometric mean (range) "
              "| runs past 1.10x |")
        print("|---|---|---|---|---|---|---|---|")
        for (name, load, engines, told, speeds), ratios in by_configuration.items():
            print(f"| {name} | {load} | {engines} | {'report' if told else 'silent'} | {','.join(map(str, speeds)) or '-'} "
                  f"| {len(ratios)} | {statistics.geometric_mean(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
                  f"| {sum(r > 1.10 for r in ratios)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
