"""In-process benchmarks of the core, side by side with the reference when its virtualenv exists.

    python bench/run.py [--reference-python /path/to/venv/bin/python]

Prints one table row per figure: ours, reference, ratio (ours / reference, higher is better).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from workload import BLOCK_SIZE, WORKERS, best_rate, prompts  # noqa: E402

from selection_proto import (  # noqa: E402
    SelectAndReserveRequest,
    SelectionService,
    SelectRequest,
    Settings,
    WorkerRequest,
)
from selection_proto.core.base.hashing import block_hashes, sequence_hashes  # noqa: E402
from selection_proto.core.cache.index import DeviceTree  # noqa: E402


def ours() -> dict[str, tuple[float, float]]:
    results: dict[str, tuple[float, float]] = {}
    for n in (1024, 16384, 131072):
        tokens = prompts(n, 1)[0]
        results[f"hash_{n}"] = best_rate(lambda t: block_hashes(t, BLOCK_SIZE), [tokens] * 20)
        results[f"hash_seq_{n}"] = best_rate(lambda t: sequence_hashes(block_hashes(t, BLOCK_SIZE)), [tokens] * 20)
    for blocks in (64, 1024, 8192):
        chain = block_hashes(prompts(blocks * BLOCK_SIZE, 1)[0], BLOCK_SIZE)
        tree = DeviceTree()
        for w in range(WORKERS):
            tree.store((w, 0), None, [(h ^ w, h) for h in chain[: blocks * (w + 1) // WORKERS]])
        results[f"find_{blocks}"] = best_rate(tree.find, [chain] * 200)
        stores = [[(h ^ (1 << 60) ^ i, h) for h in chain[:16]] for i in range(200)]
        fresh = DeviceTree()
        results[f"store16_{blocks}"] = best_rate(lambda b, t=fresh: t.store((99, 0), None, b), stores, repeat=1)
    service = SelectionService(Settings(kv_events="push"), random.Random(0))
    for w in range(WORKERS):
        service.upsert_worker(WorkerRequest(worker_id=w, model_name="m", endpoint=f"http://w{w}",
                                            block_size=BLOCK_SIZE), now=0.0)
    for n, count in ((1024, 400), (16384, 60)):
        items = prompts(n, count)
        results[f"select_{n}"] = best_rate(
            lambda p: service.select(SelectRequest(model_name="m", token_ids=p), now=1.0), items)
    ttft = SelectionService(Settings(kv_events="push", router_policy="ttft"), random.Random(0))
    for w in range(WORKERS):  # the same selects, chosen by the least predicted time to first token
        ttft.upsert_worker(WorkerRequest(worker_id=w, model_name="m", endpoint=f"http://w{w}",
                                         block_size=BLOCK_SIZE), now=0.0)
    results["select_1024_ttft"] = best_rate(
        lambda p: ttft.select(SelectRequest(model_name="m", token_ids=p), now=1.0), prompts(1024, 400))
    pairs = prompts(1024, 400)
    counter = iter(range(10**9))

    def reserve_and_free(p: list[int]) -> None:
        rid = f"r{next(counter)}"
        service.select_and_reserve(SelectAndReserveRequest(model_name="m", token_ids=p, reservation_id=rid),
                                   now=1.0)
        service.free(rid, now=1.0)

    results["reserve_free_1024"] = best_rate(reserve_and_free, pairs)
    return results


def main() -> None:
    import statistics

    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-python", default=os.environ.get("REFERENCE_PYTHON"))
    parser.add_argument("--rounds", type=int, default=5, help="alternating ours/reference rounds")
    args = parser.parse_args()
    env = {**os.environ, "RUST_LOG": "warn", "DYN_LOG": "warn"}
    script = os.path.join(os.path.dirname(__file__), "reference.py")
    mine: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for n in range(args.rounds):
        # Alternate the order so that drift on a shared machine does not favour one side.
        order = ("ours", "reference") if n % 2 == 0 else ("reference", "ours")
        for side in order:
            if side == "ours":
                for name, (rate, _) in ours().items():
                    mine.setdefault(name, []).append(rate)
            elif args.reference_python:
                out = subprocess.run([args.reference_python, script], capture_output=True, text=True,
                                     env=env, check=True)
                for name, (rate, _) in json.loads(out.stdout.strip().splitlines()[-1]).items():
                    theirs.setdefault(name, []).append(rate)
    print(f"{'figure':<18}{'ours /s':>12}{'spread':>10}{'reference /s':>14}{'spread':>10}{'ratio':>8}")
    for name, rates in mine.items():
        ref = theirs.get(name)
        ours_median = statistics.median(rates)
        ref_text = f"{statistics.median(ref):>14,.0f}{max(ref) - min(ref):>10,.0f}" if ref else f"{'-':>14}{'-':>10}"
        ratio = f"{ours_median / statistics.median(ref):.2f}" if ref else "-"
        print(f"{name:<18}{ours_median:>12,.0f}{max(rates) - min(rates):>10,.0f}{ref_text}{ratio:>8}")


if __name__ == "__main__":
    main()
