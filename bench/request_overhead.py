"""What learning the engines' fixed time per request is worth in `simulate` (docs/ROUTING.md, "A
fixed time per request"): engines that spend `--request-fixed-ms` on every prompt whatever they
hold, `router_policy=ttft` as it is (learning it) and with the learning off, beside Dynamo's cost
and round robin, on the conversation trace and the high-reuse one of bench/routing.py.

    python bench/request_overhead.py [--requests 1000] [--fixed-ms 0,15,30] [--load 0.8]

Runs in process; the learning is turned off by never reaching its sample count
(`speed.OVERHEAD_AFTER`)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from routing import TRACE, synthetic_trace  # noqa: E402

from selection_proto.core.base.settings import Settings  # noqa: E402
from selection_proto.core.fleet import speed  # noqa: E402
from selection_proto.sim import EngineModel, FleetConfig, parse_trace, simulate  # noqa: E402
from selection_proto.sim.command import _lines  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--fixed-ms", default="0,15,30")
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--stall-ms", type=float, default=0.0, help="each engine stops this long ...")
    parser.add_argument("--stall-every", type=float, default=0.0, help="... once every so many seconds")
    args = parser.parse_args()
    synthetic = os.path.join(tempfile.mkdtemp(), "synthetic.jsonl")
    synthetic_trace(synthetic, args.requests)
    print("| trace | fixed ms | ttft (learning): mean / p99 / hit | learning off | Dynamo's cost | round robin |")
    print("|---|---|---|---|---|---|")
    learn_after = speed.OVERHEAD_AFTER
    for name, path in (("conversation", TRACE), ("high reuse", synthetic)):
        for fixed in map(float, args.fixed_ms.split(",")):
            def trace(path: str = path) -> Iterator[Any]:
                return parse_trace(_lines(path), path, 512, limit=args.requests, kv_blocks=1000)

            config = FleetConfig(engines=8, load=args.load, model=EngineModel(request_fixed_ms=fixed, stall_ms=args.stall_ms,
                                                                                stall_every_secs=args.stall_every))
            cells = []
            for setting, after in ((Settings(kv_events="push", router_policy="ttft"), learn_after),
                                   (Settings(kv_events="push", router_policy="ttft"), 1 << 62),
                                   (Settings(kv_events="push"), learn_after), (None, learn_after)):
                speed.OVERHEAD_AFTER = after
                try:
                    (run,) = simulate(trace, config, [("round-robin" if setting is None else "s", setting)])
                finally:
                    speed.OVERHEAD_AFTER = learn_after
                cells.append(f"{run.ttft['mean']:.3f} / {run.ttft['p99']:.3f} / {run.hit_rate:.3f}")
            print(f"| {name} | {fixed:g} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
