"""Run one fuzz target for a while: with atheris when it is installed, else with Hypothesis.

    python fuzz/run.py TARGET [--seconds N]      (TARGET: http, jsonl, ws, json_events, engine_batch)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fuzz.targets import TARGETS, seeds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    target = TARGETS[args.target]
    try:
        import atheris  # type: ignore[import-not-found]
    except ImportError:
        atheris = None
    if atheris is not None:
        deadline = time.monotonic() + args.seconds

        def one(data: bytes) -> None:
            if time.monotonic() > deadline:
                raise SystemExit(0)
            target(data)

        atheris.Setup([sys.argv[0], "-atheris_runs=0"], one)
        atheris.Fuzz()
        return 0
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    examples = st.one_of(st.binary(max_size=4096),
                         st.sampled_from(seeds(args.target)).flatmap(_mutations))
    deadline = time.monotonic() + args.seconds
    runs = 0
    while time.monotonic() < deadline:
        @settings(max_examples=500, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(examples)
        def check(data: bytes) -> None:
            target(data)

        check()
        runs += 500
    print(f"{args.target}: {runs} inputs, no failure")
    return 0


def _mutations(seed: bytes):  # type: ignore[no-untyped-def]
    from hypothesis import strategies as st

    return st.tuples(st.integers(0, len(seed)), st.integers(0, len(seed)), st.binary(max_size=16)).map(
        lambda t: seed[:min(t[0], t[1])] + t[2] + seed[max(t[0], t[1]):])


if __name__ == "__main__":
    sys.exit(main())
