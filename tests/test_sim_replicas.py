"""`simulate --replicas` (docs/ROUTING.md, "Replicas"): N real services behind a round-robin
balancer, each with its own index fed every engine's events, sharing bookings through an in-process
ledger (sim/ledger.py) that moves exactly what the real transport moves, or each alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import selection_proto.sim.routers as routers_module
from selection_proto.core.base.settings import Settings
from selection_proto.core.fleet.journal import LedgerOp
from selection_proto.core.fleet.ledger_wire import ADD, FREE, PREFILL, Reply
from selection_proto.core.service import SelectionService
from selection_proto.sim import FleetConfig, parse_trace, simulate
from selection_proto.sim.fleet import ReplicaSetup
from selection_proto.sim.ledger import FeedLedger, UnmodelledOp

BASE = Settings(kv_events="push")
# 40 conversations of a 6-block prefix each, taking turns, one a second.
LINES = [json.dumps({"timestamp": i * 1000, "input_length": 8 * 512, "output_length": 20, "hash_ids": [
    100 * (i % 40) + j for j in range(6)] + [10_000 + 2 * i, 10_001 + 2 * i]}).encode() for i in range(300)]
CONFIG = FleetConfig(engines=4, kv_blocks=100, load=0.9)


def trace() -> Any:
    return parse_trace(LINES, "conversations", 512)


def loads(service: SelectionService) -> dict[tuple[int, int], tuple[int, int]]:
    return {rank: (load.requests, load.prefill_tokens)
            for pool in service.pools.values() for rank, load in pool.tracker.loads.items()}


Views = list[dict[tuple[int, int], tuple[int, int]]]


def watch(monkeypatch: pytest.MonkeyPatch, routers: list[Any] | None = None) -> list[Views]:
    """Every replica's loads after each of the balancer's calls has gone through the ledger (and
    in `routers`, the balancers)."""
    seen: list[Views] = []
    share = routers_module.Replicas.share

    def checked(self: Any, replica: int, now: float) -> None:
        share(self, replica, now)
        seen.append([loads(r.service) for r in self.replicas])
        if routers is not None and self not in routers:
            routers.append(self)

    monkeypatch.setattr(routers_module.Replicas, "share", checked)
    return seen


@pytest.mark.parametrize("settings", [BASE, Settings(kv_events="push", router_policy="ttft")])
def test_one_replica_is_todays_run_exactly_shared_or_not(settings: Settings) -> None:
    runs = simulate(trace, CONFIG, [("core", settings),
                                    ("core", ReplicaSetup(settings=settings, replicas=1, shared=True)),
                                    ("core", ReplicaSetup(settings=settings, replicas=1, shared=False))])
    lone, *replicated = (run.to_json() for run in runs)
    assert lone["requests"] == 300 and lone["failed"] == 0 and lone["hit_rate"] > 0.2
    for run in replicated:
        assert run.pop("replicas")["replicas"] == 1
        assert run == lone


def test_shared_replicas_see_each_others_bookings_after_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = watch(monkeypatch)
    run, = simulate(trace, CONFIG, [("4 shared", ReplicaSetup(settings=BASE, replicas=4))])
    assert run.requests == 300 and run.failed == 0 and run.events_failed == 0
    assert run.replicas == {"replicas": 4, "shared": True, "ledger_delay_secs": 0.0}
    assert len(seen) > 2000
    for step in seen:
        assert all(view == step[0] for view in step[1:]), step
    # Requests were in flight on several engines at once, each booked by one replica, counted by all.
    assert max(sum(n for n, _ in step[0].values()) for step in seen) >= 4
    assert all(n == 0 for n, _ in seen[-1][0].values())  # every booking freed, everywhere


def test_replicas_alone_count_only_their_own_bookings(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = watch(monkeypatch)
    run, = simulate(trace, CONFIG, [("4 alone", ReplicaSetup(settings=BASE, replicas=4, shared=False))])
    assert run.requests == 300 and run.failed == 0
    assert len(seen) > 2000
    diverged = [step for step in seen if any(view != step[0] for view in step[1:])]
    assert len(diverged) > len(seen) // 2
    # Each replica routed every fourth request: its own count is a quarter of what is in flight.
    busiest = max(seen, key=lambda step: sum(sum(n for n, _ in view.values()) for view in step))
    totals = [sum(n for n, _ in view.values()) for view in busiest]
    assert max(totals) < sum(totals)


def test_a_ledger_delay_holds_the_others_bookings_back_then_they_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    routers: list[Any] = []
    seen = watch(monkeypatch, routers)
    config = FleetConfig(engines=4, kv_blocks=100, load=0.9, seed=3)
    first, = simulate(trace, config, [("late", ReplicaSetup(settings=BASE, replicas=2, ledger_delay_secs=0.05))])
    assert first.failed == 0 and first.events_failed == 0
    assert any(step[0] != step[1] for step in seen)  # the window in which one lacks the other's booking
    ends = [loads(replica.service) for replica in routers[0].replicas]  # the last of the feed arrived
    assert ends[0] == ends[1] and all(n == 0 for n, _ in ends[0].values())
    again, = simulate(trace, config, [("late", ReplicaSetup(settings=BASE, replicas=2, ledger_delay_secs=0.05))])
    assert again.to_json() == first.to_json()


def test_the_simulated_ledger_answers_as_the_script_and_refuses_what_it_does_not_model() -> None:
    ledger = FeedLedger()
    replies, entries = ledger.write("a", [LedgerOp(ADD, "r1", b"body", b"rk", view=0),
                                          LedgerOp(PREFILL, "r1", owner=b"a")])
    assert replies == [Reply("ok", 1), Reply("ok", 2)]
    assert [(f[b"n"], f[b"o"], f[b"k"], f[b"i"], f[b"w"]) for _, f in entries] == [
        (b"1", b"a", b"add", b"r1", b"a"), (b"2", b"a", b"prefill", b"r1", b"a")]
    assert ledger.write("b", [LedgerOp(FREE, "r1", b"b")])[0] == [Reply("stale", 0)]  # not b's booking
    assert ledger.write("a", [LedgerOp(FREE, "r1", b"a")])[0] == [Reply("ok", 3)]
    assert ledger.write("a", [LedgerOp(FREE, "r1", b"a")]) == ([Reply("gone", 0)], [])  # a retried free
    assert ledger.write("a", [LedgerOp(PREFILL, "r1", owner=b"a")]) == ([Reply("missing", 0)], [])
    for op in (LedgerOp(FREE, "never"), LedgerOp(ADD, "r1", b"", b"rk")):
        with pytest.raises(UnmodelledOp):
            ledger.write("a", [op])
    # Strict admission: a booking that names how many it saw on the rank (one so far, r1's) is
    # refused when there are more, with the feed position to catch up to; taken when it is right.
    assert ledger.write("b", [LedgerOp(ADD, "s", b"", b"rk", count=0)]) == ([Reply("conflict", 3)], [])
    assert ledger.write("b", [LedgerOp(ADD, "s", b"", b"rk", count=1)])[0] == [Reply("ok", 4)]
    assert ledger.write("a", [LedgerOp(ADD, "t", b"", b"other", count=0)])[0] == [Reply("ok", 5)]


def test_the_command_runs_each_count_shared_and_alone_with_a_replicas_column(tmp_path: Path) -> None:
    source = tmp_path / "t.jsonl"
    source.write_bytes(b"\n".join(LINES[:120]) + b"\n")
    out = tmp_path / "runs.json"
    done = subprocess.run([sys.executable, "-m", "selection_proto", "simulate", str(source), "--engines", "4",
                           "--kv-blocks", "100", "--replicas", "1,2", "--no-baselines", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["setting", "replicas", "ttft"]
    assert [line.split()[:5] for line in lines[2:5]] == [
        ["default", "1", lines[2].split()[2], lines[2].split()[3], lines[2].split()[4]], ["2", "replicas", "shared", "2", "shared"], ["2", "replicas", "alone", "2", "alone"]]
    settings = json.loads(out.read_text())["settings"]
    assert [s.get("replicas") for s in settings] == [
        None, {"replicas": 2, "shared": True, "ledger_delay_secs": 0.0},
        {"replicas": 2, "shared": False, "ledger_delay_secs": 0.0}]
    done = subprocess.run([sys.executable, "-m", "selection_proto", "simulate", str(source), "--engines", "4",
                           "--kv-blocks", "100", "--replicas", "2", "--admission", "strict", "--ledger-delay", "0.001",
                           "--no-baselines", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[2].split()[:6] == ["2", "replicas", "shared", "strict", "2", "shared"]
    assert [s.get("replicas") for s in json.loads(out.read_text())["settings"]] == [
        {"replicas": 2, "shared": True, "ledger_delay_secs": 0.001, "admission": "strict"},
        {"replicas": 2, "shared": False, "ledger_delay_secs": 0.001}]
    for args, message in ((["--replicas", "0"], "--replicas: each count from 1 to 64"),
                          (["--replicas", "two"], "--replicas: expected counts such as 1,2,4,8"),
                          (["--ledger-delay", "0.1"], "--ledger-delay: only with --replicas"),
                          (["--admission", "strict"], "--admission: only with --replicas"),
                          (["--replicas", "2", "--ledger-delay", "-1"], "--ledger-delay: must be a number"),
                          (["--replicas", "2", "--pd", "1:3"], "--replicas: runs aggregated fleets only")):
        done = subprocess.run([sys.executable, "-m", "selection_proto", "simulate", str(source), *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_shared_replicas_drawing_from_one_generator_are_the_lone_service_under_ttft() -> None:
    """With `router_policy=ttft` each replica's cost also reads what it learned of the engines'
    speeds, how far each rank's running prefill has got, and which prefills a prompt with nothing
    new to store waits behind (docs/ROUTING.md, "Replicas"): the ledger's bookings and prefill ends
    teach every replica the same, so that with one random generator shared replicas are the lone
    service to the last digit (with a generator each, they differ only by their tie-breaks). On a
    mixed fleet too (`engine_speeds`, learned): a replica hears one batch of prefill ends in
    another order than one service (its own first, then the ledger's), and the speeds it works
    out from them must not depend on it."""
    from test_simulate import TRACE

    def conversation() -> Any:
        return parse_trace(TRACE.read_bytes().splitlines() if TRACE.suffix != ".gz" else
                           __import__("gzip").decompress(TRACE.read_bytes()).splitlines(),
                           str(TRACE), 512, limit=600, kv_blocks=1000)

    settings = Settings(kv_events="push", router_policy="ttft")
    for replicas, speeds in ((4, ()), (8, (1.0, 0.5))):
        config = FleetConfig(engines=8, load=0.8, prefill_complete=False, engine_speeds=speeds)
        lone, shared = (run.to_json() for run in simulate(conversation, config, [
            ("core", settings), ("core", ReplicaSetup(settings=settings, replicas=replicas, one_generator=True))]))
        assert shared.pop("replicas")["replicas"] == replicas
        assert lone["requests"] == 600 and lone["failed"] == 0
        assert shared == lone, speeds


def test_strict_admission_spreads_a_burst_that_advisory_replicas_herd() -> None:
    """Eight requests of one prefix in the same millisecond, each to another replica, with a 1 ms
    ledger (docs/REPLICATION.md, "Strict admission"): advisory, every replica books on a view
    without the others' bookings and all pick the engine that holds the prefix; strict, the
    ledger refuses all but one booking a rank, and the others select again once they have seen
    it. With no delay, strict books as advisory does: no conflict, the same run."""
    prefix = [json.dumps({"timestamp": 0, "input_length": 8 * 512, "output_length": 20,
                          "hash_ids": list(range(8))}).encode()]
    burst = [json.dumps({"timestamp": 1000, "input_length": 16 * 512, "output_length": 200,
                         "hash_ids": list(range(8)) + [100 + 8 * i + j for j in range(8)]}).encode() for i in range(8)]

    def bursty() -> Any:
        return parse_trace(prefix + burst, "burst", 512)

    config = FleetConfig(engines=4, kv_blocks=100, speedup=1.0)
    made: list[Any] = []
    init = routers_module.Replicas.__init__

    def remember(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routers_module.Replicas, "__init__", remember)
        runs = simulate(bursty, config, [
            ("burst", ReplicaSetup(settings=BASE, replicas=8, ledger_delay_secs=delay, admission=admission))
            for delay in (0.0, 0.001) for admission in ("advisory", "strict")])
    conflicts = [sum(float(line.rsplit(" ", 1)[1]) for r in replicas.replicas
                     for line in r.service.metrics_text(now=100.0).splitlines()
                     if line.startswith('selection_proto_ledger_events_total{event="conflict"}'))
                 for replicas in made]
    assert conflicts[0] == conflicts[1] == conflicts[2] == 0 and conflicts[3] > 0
    plain, strict_plain, herded, strict = (run.to_json() for run in runs)
    assert all(run["failed"] == 0 and run["requests"] == 9 for run in (plain, herded, strict))
    assert strict_plain.pop("replicas")["admission"] == "strict"
    assert "admission" not in plain.pop("replicas")
    assert strict_plain == plain
    assert strict["ttft"]["mean"] < 0.8 * herded["ttft"]["mean"]
    assert strict["busy_max_mean"] < herded["busy_max_mean"]
