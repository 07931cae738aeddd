"""An experiment for issue 31, not the product: would `router_policy=ttft` gain from learning each
engine's prefill speed when its record does not declare one? The simulated client's calls are
watched (bookings, prefill completions); each engine's speed is the prefill tokens it completed
over the time it had prefill booked, and `ttft` is given the engine's speed against the fleet's
mean, to the power `--power` (0.5: halfway, in log terms, between "all equal" and what was
measured), once it has completed `--min-tokens`. Frees teach nothing (their time includes the
decode), so a client that never calls prefill_complete leaves the fleet "all equal".

    python bench/learned_speed.py [--requests 2000] [--power 0.5] [--min-tokens 20000]

Prints, per case, `ttft` without and with learning, each as mean and p99 TTFT against
`router_policy=dynamo` in the same run (Dynamo's cost, in process)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from selection_proto.cli import main as cli_main  # noqa: E402
from selection_proto.core.cost import worker_speed  # noqa: E402
from selection_proto.sim import fleet  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "traces", "conversation_trace.jsonl.gz")
CASES = ["--load 0.8", "--load 0.8 --engine-speeds 1,0.5", "--load 0.8 --engines 16 --engine-speeds 1,0.5",
         "--load 0.5 --engines 4", "--load 1.1", "--load 0.8 --event-delay 0.5"]


class Learner:
    """Busy time and completed prefill tokens per engine, fed by the simulated client's calls."""

    def __init__(self, power: float, min_tokens: float) -> None:
        self.power, self.min_tokens = power, min_tokens
        self.busy: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def advance(self, pool: Any, now: float) -> None:
        for rank, load in pool.tracker.loads.items():
            engine = rank[0]
            if load.prefill_tokens > 0:
                self.busy[engine] = self.busy.get(engine, 0.0) + now - self.last.get(engine, now)
            self.last[engine] = now

    def completed(self, pool: Any, engine: int, tokens: int) -> None:
        self.done[engine] = self.done.get(engine, 0.0) + tokens
        rates = {e: self.done[e] / self.busy[e] for e in self.done
                 if self.done[e] >= self.min_tokens and self.busy.get(e, 0.0) > 0}
        if len(rates) < 2:
            return
        mean = sum(rates.values()) / len(rates)
        default = worker_speed(None, None)[0]
        for e, rate in rates.items():
            slower = min(4.0, max(0.25, (mean / rate) ** self.power))
            pool.speeds[e] = (default * slower, pool.speeds.get(e, worker_speed(None, None))[1])


def patch(power: float, min_tokens: float) -> None:
    router: Any = fleet._Router
    choose, prefill_done = router.choose, router.prefill_done

    def learner(self: Any) -> tuple[Learner, Any]:
        if "_learner" not in self.__dict__:
            self._learner = Learner(power, min_tokens)
        return self._learner, next(iter(self.service.pools.values()))

    def watched_choose(self: Any, req: Any, now: float) -> Any:
        if self.service is not None:
            learn, pool = learner(self)
            learn.advance(pool, now)
        return choose(self, req, now)

    def watched_prefill_done(self: Any, req: Any, now: float) -> None:
        if self.service is None:
            return prefill_done(self, req, now)
        learn, pool = learner(self)
        learn.advance(pool, now)
        booking = pool.tracker.bookings.get(req.rid)
        prefill_done(self, req, now)
        if booking is not None and booking.prefill_done:
            learn.completed(pool, booking.rank[0], booking.prefill_tokens)

    router.choose, router.prefill_done = watched_choose, watched_prefill_done


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
    parser.add_argument("--power", type=float, default=0.5)
    parser.add_argument("--min-tokens", type=float, default=20_000)
    opts = parser.parse_args()
    import tempfile

    out = os.path.join(tempfile.mkdtemp(), "run.json")
    rows = []
    for case in CASES:
        for skip in (0, 4000):
            args = ["--skip", str(skip), "--requests", str(opts.requests), *case.split()]
            rows.append((skip, case, run(args, out)))
    patch(opts.power, opts.min_tokens)
    print(f"| slice | case | `ttft` mean, p99 vs `dynamo` | learned (power {opts.power:g}) |")
    print("|---|---|---|---|")
    for skip, case, (mean, p99) in rows:
        args = ["--skip", str(skip), "--requests", str(opts.requests), *case.split()]
        learned = run(args, out)
        print(f"| {skip}-{skip + opts.requests} | `{case}` | {mean:.2f}x, {p99:.2f}x | {learned[0]:.2f}x, {learned[1]:.2f}x |")


if __name__ == "__main__":
    main()
