"""Short Hypothesis runs of every fuzz target (the `ci` profile bounds them); long runs: fuzz/run.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz.targets import SPLITTERS, TARGETS, seeds  # noqa: E402


def mutated(name: str) -> st.SearchStrategy[bytes]:
    def mutate(seed: bytes) -> st.SearchStrategy[bytes]:
        return st.tuples(st.integers(0, len(seed)), st.integers(0, len(seed)), st.binary(max_size=24)).map(
            lambda t: seed[:min(t[0], t[1])] + t[2] + seed[max(t[0], t[1]):])

    return st.one_of(st.binary(max_size=512), st.sampled_from(seeds(name)).flatmap(mutate))


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_never_raises(name: str) -> None:
    target = TARGETS[name]

    @settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutated(name))
    def run(data: bytes) -> None:
        target(data)

    run()


@pytest.mark.parametrize("name", sorted(SPLITTERS))
def test_valid_streams_split_at_every_boundary(name: str) -> None:
    """Feeding a valid stream in two pieces, cut anywhere, answers exactly as feeding it whole."""
    observe = SPLITTERS[name]
    for seed in seeds(name):
        whole = observe([seed])
        assert whole
        for cut in range(1, len(seed)):
            assert observe([seed[:cut], seed[cut:]]) == whole, cut


@pytest.mark.parametrize("mode", ["push", "subscribe"])
def test_the_running_server_survives_hostile_clients(mode: str) -> None:
    """fuzz/server_fuzz.py for a few seconds per mode (10 minutes: docs/INVARIANTS.md)."""
    from fuzz.server_fuzz import run

    result = run(seconds=8, seed=11 if mode == "push" else 12, mode=mode)
    assert result["cases"] > 200


def test_the_running_server_survives_the_heavy_shapes_and_answers_health_throughout() -> None:
    """fuzz/server_fuzz.py --heavy: huge prompts beside huge bookings, event floods and stalled
    bodies among the hostile cases; every /health probe answered, none after a stall of seconds.
    (The prober shares its GIL with five clients building megabytes of JSON, and the suite may
    run under coverage: the latency goals are asserted in tests/test_hardening.py.)"""
    from fuzz.server_fuzz import run

    result = run(seconds=10, seed=13, heavy=True, max_health_ms=3000.0)
    assert result["cases"] > 200 and result["health_probes"] > 100
