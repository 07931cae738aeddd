"""What learning each engine's prefill speed (core/fleet/speed.py) is worth to `router_policy=ttft`:
each case run with `ttft` as it is and with learning turned off, each as mean and p99 TTFT against
`router_policy=dynamo` in the same run (Dynamo's cost, in process).

    python bench/learned_speed.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from selection_proto.cli import main as cli_main  # noqa: E402
from selection_proto.core.fleet import speed  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "traces", "conversation_trace.jsonl.gz")
CASES = ["--load 0.8", "--load 0.8 --engine-speeds 1,0.5", "--load 0.8 --engines 16 --engine-speeds 1,0.5",
         "--load 0.5 --engines 4", "--load 1.1", "--load 0.8 --event-delay 0.5"]


def unlearned() -> None:
    """`ttft` as it was before learning: every Speeds made from now on learns nothing."""
    init = speed.Speeds.__init__

    def without(self: speed.Speeds, learn: bool) -> None:
        init(self, False)

    speed.Speeds.__init__ = without  # type: ignore[method-assign]


def run(args: list[str], out: str) -> tuple[float, float]:
    import contextlib
    import io
    import json

    with contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["simulate", TRACE, "--no-baselines", "--json", out, "--compare", "router_policy=ttft",
                         "router_policy=dynamo", *args])
    assert code == 0
    ttft, dynamo = json.load(open(out))["settings"][:2]
    return ttft["ttft"]["mean"] / dynamo["ttft"]["mean"], ttft["ttft"]["p99"] / dynamo["ttft"]["p99"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    opts = parser.parse_args()
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "run.json")
    rows = []
    for case in CASES:
        for skip in (0, 4000):
            args = ["--skip", str(skip), "--requests", str(opts.requests), *case.split()]
            rows.append((skip, case, run(args, out)))
    unlearned()
    print("| slice | case | `ttft` unlearned: mean, p99 vs `dynamo` | `ttft` (learning) |")
    print("|---|---|---|---|")
    for skip, case, learned in rows:
        args = ["--skip", str(skip), "--requests", str(opts.requests), *case.split()]
        mean, p99 = run(args, out)
        print(f"| {skip}-{skip + opts.requests} | `{case}` | {mean:.2f}x, {p99:.2f}x | {learned[0]:.2f}x, {learned[1]:.2f}x |")


if __name__ == "__main__":
    main()
