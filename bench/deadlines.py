"""Deadline admission in `simulate` (docs/FLOW_CONTROL.md): slices of the Mooncake trace, every
request with one `deadline_ms`, through engines whose time is exactly their tokens over the speed
their records declare (no fixed cost, attention or decode step), so that any late first token is
the prediction's fault. Prints a Markdown table: requests refused, and the latest admitted first
token against the deadline (at most 1.00 means none late), at `queue_threshold` 1 and 1e-6.

    python bench/deadlines.py [--trace ../shared/traces/conversation_trace.jsonl.gz] [--requests 800]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os

from selection_proto.core.base.settings import Settings
from selection_proto.sim import EngineModel, FleetConfig, parse_trace, simulate

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "conversation_trace.jsonl.gz")
EXACT = EngineModel(prefill_fixed_ms=0, attention_ms=0, decode_ms=0, decode_full_ms=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--requests", type=int, default=800)
    opts = parser.parse_args()
    print("| slice | engines | load | deadline_ms | refused, threshold 1 | latest / deadline | "
          "refused, 1e-6 | latest / deadline |")
    print("|---|---|---|---|---|---|---|---|")
    for skip in (0, 5000):
        with gzip.open(opts.trace, "rb") as raw:
            records = [json.loads(line) for _, line in zip(range(skip + opts.requests), raw, strict=False)][skip:]
        for engines, load in ((4, 0.8), (4, 1.5), (8, 1.5)):
            for deadline in (2000, 500):
                lines = [json.dumps({**r, "deadline_ms": deadline}).encode() for r in records]
                runs = simulate(lambda lines=lines: parse_trace(lines, "t", 512),  # type: ignore[misc]
                                FleetConfig(engines=engines, load=load, model=EXACT),
                                [(str(t), Settings(kv_events="push", queue_threshold=t)) for t in (1.0, 1e-6)])
                cells = [f"{r.failed} | {r.ttft_cdf[-1][0] * 1000 / deadline:.2f}" for r in runs]
                print(f"| {skip}+{opts.requests} | {engines} | {load} | {deadline} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
