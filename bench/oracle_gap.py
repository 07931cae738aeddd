"""Where `router_policy=ttft` parts from the all-knowing oracle (docs/ROUTING.md, "How close to
the oracle"): at every arrival of a `ttft` run, the oracle's choice on the same true state beside
ours, and for each request where they differ, what our cost believed of both engines against the
truth (the simulator's engines, forked and run ahead):

- `wait`: our predicted wait against the true wait (first token if the request's own prefill cost
  nothing: the true first-token time less the time of its own prefill alone on that engine);
- `queue`: the prefill tokens booked on the rank and not complete, against the prompt tokens
  truly still to prefill in the engine (waiting prompts less their cache, running ones' rest);
- `cached`: our cached tokens against what the engine holds of the prompt;
- `kv`: whether the engine would have to wait for KV room to admit it.

    python bench/oracle_gap.py [--skip 0] [--requests 2000] [--load 0.8] [--engines 8] [--silent]
        [--speeds 1.0,0.5] [--trace high] [--whole] [--dump ROWS.jsonl]

The regret of a request is its true first-token time on our engine less on the oracle's (both
as the oracle predicts them, from the same state); summed over the run it says which belief lost
the most."""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from collections import OrderedDict, defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from routing import TRACE, synthetic_trace  # noqa: E402

import selection_proto.core.routing.cost as cost  # noqa: E402
from selection_proto.core.base.hashing import signed  # noqa: E402
from selection_proto.core.base.responses import Pending  # noqa: E402
from selection_proto.core.base.settings import Settings  # noqa: E402
from selection_proto.core.base.types import SelectAndReserveRequest  # noqa: E402
from selection_proto.sim import (  # noqa: E402
    FleetConfig,
    parse_trace,
    routers,  # noqa: E402
    simulate,
)
from selection_proto.sim.command import _lines  # noqa: E402
from selection_proto.sim.engine import Engine, SimRequest  # noqa: E402


def _run_ahead(engine: Engine, req: SimRequest, now: float) -> tuple[float, float]:
    """`oracle.first_token_at`, and when the request would be admitted."""
    twin = engine.fork()
    probe = req.fork()
    twin.waiting.append(probe)
    at = twin.busy_until if twin.busy_until is not None else twin.start(now)
    while at is not None:
        twin.finish(at)
        if probe.first_token >= 0:
            return at, probe.started
        at = twin.start(at)
    return float("inf"), float("inf")


def held_prefix(engine: Engine, req: SimRequest) -> int:
    """How many of `req`'s leading full blocks `engine` holds now."""
    held = 0
    for seq in req.seqs[:req.full]:
        if seq not in engine.active and seq not in engine.inactive:
            break
        held += 1
    return held


def truth(engine: Engine, req: SimRequest, now: float) -> dict[str, float]:
    """What the engine truly holds for `req` now."""
    held = held_prefix(engine, req)
    queued = sum(r.left for r in engine.prefilling)
    for r in engine.waiting:
        queued += r.isl - min(held_prefix(engine, r) * engine.block_size, r.isl - 1)
    at, admitted = _run_ahead(engine, req, now)
    # Its own prefill alone on the same cache: an idle copy of the engine with no one else.
    alone = engine.fork()
    alone.waiting.clear()
    alone.prefilling.clear()
    alone.decoding = []
    alone.last_prefill = []
    alone.busy_until = None
    alone.inactive = OrderedDict.fromkeys([*alone.inactive, *alone.active])
    alone.active, alone.private = {}, 0
    own = _run_ahead(alone, req, now)[0] - now
    return {"ttft": at - now, "own": own, "queue": float(queued), "cached": float(min(held * engine.block_size, req.isl)),
            "waiting": float(len(engine.waiting)), "admitted": admitted - now, "kv_free": float(engine.capacity - engine.used())}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--silent", action="store_true")
    parser.add_argument("--speeds", default="")
    parser.add_argument("--trace", default="conversation")
    parser.add_argument("--whole", action="store_true", help="count a running prefill whole until it ends")
    parser.add_argument("--dump", default=None, help="every request's rows, as JSON lines")
    args = parser.parse_args()
    path = TRACE
    if args.trace != "conversation":
        path = os.path.join(tempfile.mkdtemp(), "synthetic.jsonl")
        synthetic_trace(path, args.requests)
    speeds = tuple(float(s) for s in args.speeds.split(",") if s)
    config = FleetConfig(engines=args.engines, load=args.load, prefill_complete=not args.silent, engine_speeds=speeds)
    cost.COUNT_WHAT_IS_LEFT = not args.whole
    rows: list[dict[str, Any]] = []
    original = routers.Router.choose
    rng = random.Random(0)

    def choose(self: routers.Router, req: SimRequest, now: float) -> Any:
        if self.service is None:
            return original(self, req, now)
        assert self.service is not None
        pool = next(iter(self.service._pools.values()))
        started = pool.speeds._started
        loads = {r[0]: (load.requests, load.prefill_tokens, now - started[r] if r in started else -1.0) for r, load in pool.tracker.loads.items()}
        left = {r[0]: pool.speeds.left(r, load.prefill_tokens, now) for r, load in pool.tracker.loads.items()}
        answer = self.service.select_and_reserve(SelectAndReserveRequest(
            model_name="m", block_hashes=req.locals.tolist(), sequence_hashes=list(signed(req.seqs)),
            isl_tokens=req.isl, reservation_id=req.rid, explain=True, **req.flow), now=now)
        if isinstance(answer, Pending):
            return answer
        true = [truth(e, req, now) for e in self.fleet]
        pool = next(iter(self.service._pools.values()))
        for e, t in zip(self.fleet, true, strict=True):
            parts = {"waiting_b": 0, "waiting_t": 0, "running_b": 0, "running_t": 0, "running_done": 0, "past_b": 0,
                     "past_n": 0}
            where = {x.rid: ("w", x) for x in e.waiting}
            where.update({x.rid: ("p", x) for x in e.prefilling})
            for b in pool.tracker.bookings.values():
                if b.rank[0] != e.index or b.prefill_done or not b.prefill_tokens or b.rid == req.rid:
                    continue
                kind, x = where.get(b.rid, ("d", None))
                if kind == "w":
                    parts["waiting_b"] += b.prefill_tokens
                    match = 0
                    for seq in x.seqs[:x.full]:
                        if seq in e.active or seq in e.inactive:
                            match += 1
                        else:
                            break
                    parts["waiting_t"] += x.isl - min(match * e.block_size, x.isl - 1)
                elif kind == "p":
                    parts["running_b"] += b.prefill_tokens
                    parts["running_t"] += x.left
                    parts["running_done"] += x.isl - x.cached - x.left
                else:
                    parts["past_b"] += b.prefill_tokens
                    parts["past_n"] += 1
            t.update(parts)
        best = min(t["ttft"] for t in true)
        believed = {c.worker_id: c for c in answer.candidates or ()}
        rows.append({"left": left, "loads": loads, "kv": {w: pool.speeds.of[w] for w in loads}, "ours": answer.worker_id, "oracle": min(range(len(true)), key=lambda i: (true[i]["ttft"], rng.random())),
                     "best": best, "true": true, "believed": {w: (c.predicted_wait_secs, c.predicted_prefill_secs,
                                                                    c.cached_tokens, c.potential_prefill_tokens, c.logit,
                                                                    c.potential_decode_blocks)
                                                               for w, c in believed.items()},
                     "isl": req.isl})
        return answer.worker_id

    routers.Router.choose = choose  # type: ignore[method-assign]

    def trace() -> Any:
        return parse_trace(_lines(path), path, 512, skip=args.skip, limit=args.requests, kv_blocks=1000)

    (run,) = simulate(trace, config, [("ttft", Settings(kv_events="push", router_policy="ttft"))])
    routers.Router.choose = original  # type: ignore[method-assign]
    print(f"ttft mean {run.ttft['mean']:.3f} p99 {run.ttft['p99']:.3f} hit {run.hit_rate:.3f}")
    differ = [r for r in rows if r["true"][r["ours"]]["ttft"] > r["best"] + 1e-9]
    regret = sum(r["true"][r["ours"]]["ttft"] - r["best"] for r in differ)
    print(f"requests {len(rows)}; ours not the soonest {len(differ)}; regret {regret:.1f} s "
          f"({regret / len(rows):.3f} s a request)")
    # Attribution: for each differing pick, our believed gap against the true one, by part.
    parts: dict[str, float] = defaultdict(float)
    by: dict[str, list[float]] = defaultdict(list)
    for r in differ:
        c, o = r["ours"], r["oracle"]
        tc, to = r["true"][c], r["true"][o]
        bc, bo = r["believed"][c], r["believed"][o]
        true_wait = (tc["ttft"] - tc["own"]) - (to["ttft"] - to["own"])
        true_own = tc["own"] - to["own"]
        our_wait = bc[0] - bo[0]
        our_own = (bc[4] - bc[0]) - (bo[4] - bo[0])  # prefill less the reuse credit
        parts["wait (believed gap - true gap)"] += true_wait - our_wait
        parts["own prefill incl. credit"] += true_own - our_own
        parts["cached tokens missed, ours"] += tc["cached"] - bc[2]
        parts["cached tokens missed, oracle's"] += to["cached"] - bo[2]
        by["true wait gap"].append(true_wait)
        by["our wait gap"].append(our_wait)
        by["queue tokens true ours-oracle"].append(tc["queue"] - to["queue"])
        by["queue tokens booked ours-oracle"].append((bc[3] - (r["isl"] - bc[2])) - (bo[3] - (r["isl"] - bo[2])))
        by["queue tokens left ours-oracle"].append(r["left"][c] - r["left"][o])
        by["kv room ours"].append(tc["kv_free"])
        by["true admission wait ours"].append(tc["admitted"])
        by["true admission wait oracle"].append(to["admitted"])
        by["waiting ours"].append(tc["waiting"])
    for k, v in parts.items():
        print(f"  {k}: {v:.1f}")
    for k, v in by.items():
        v = sorted(v)
        print(f"  {k}: mean {sum(v) / len(v):.3f} p10 {v[len(v) // 10]:.3f} p50 {v[len(v) // 2]:.3f} p90 {v[9 * len(v) // 10]:.3f}")
    keys = ["waiting_b", "waiting_t", "running_b", "running_t", "running_done", "past_b", "past_n"]
    sums = {k: sum(t[k] for r in rows for t in r["true"]) / len(rows) / args.engines for k in keys}
    print("per rank, on average: " + ", ".join(f"{k} {v:.0f}" for k, v in sums.items()))
    # How well the booked queue reads the true one, over every rank of every request.
    import math
    xs, ys, ws, tw = [], [], [], []
    for r in rows:
        for w, b in r["believed"].items():
            t = r["true"][w]
            xs.append(b[3] - (r["isl"] - b[2]) if args.whole else r["left"][w])
            ys.append(t["queue"])
            ws.append(b[0])
            tw.append(t["ttft"] - t["own"])
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / n
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs) / n)
    sy = math.sqrt(sum((y - my) ** 2 for y in ys) / n)
    print(f"booked queue {mx:.0f} tokens on average, true {my:.0f}; corr {cov / (sx * sy) if sx and sy else 0:.3f}")
    mw, mt = sum(ws) / n, sum(tw) / n
    cov = sum((x - mw) * (y - mt) for x, y in zip(ws, tw, strict=True)) / n
    sx = math.sqrt(sum((x - mw) ** 2 for x in ws) / n)
    sy = math.sqrt(sum((y - mt) ** 2 for y in tw) / n)
    print(f"predicted wait {mw:.3f} s on average, true {mt:.3f}; corr {cov / (sx * sy) if sx and sy else 0:.3f}")
    if args.dump:
        import json
        with open(args.dump, "w") as out:
            for r in rows:
                out.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
