"""`simulate --pd` (docs/PD.md): disaggregated fleets of prefill and decode engines planned through the
core's `select_pd_and_reserve`, handoff and end, beside the aggregated fleet of the same size. Tiny
traces whose answers are worked out by hand from the engine model, the real CLI as a subprocess
(its columns, its JSON and HTML, its one-line refusals), and the Mooncake trace."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import selection_proto.sim.fleet as fleet_module
import selection_proto.sim.routers as routers_module
from selection_proto.core.base.settings import Settings
from selection_proto.sim import EngineModel, FleetConfig, SettingRun, parse_trace, simulate
from selection_proto.sim.engine import Engine
from selection_proto.sim.fleet import PdSetup
from selection_proto.sim.report import COLORS

BASE = Settings(kv_events="push")


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "selection_proto", "simulate", *args],
                          capture_output=True, text=True, timeout=timeout)


def _lines(requests: list[tuple[float, int, int]]) -> list[bytes]:
    """(arrival seconds, input tokens, output tokens) each, no block shared with another."""
    out, next_id = [], 0
    for at, isl, osl in requests:
        blocks = -(-isl // 512)
        out.append(json.dumps({"timestamp": at * 1000, "input_length": isl, "output_length": osl,
                               "hash_ids": list(range(next_id, next_id + blocks))}).encode())
        next_id += blocks
    return out


def _simulate(lines: list[bytes], config: FleetConfig, setups: dict[str, Settings | PdSetup]) -> dict[str, SettingRun]:
    runs = simulate(lambda: parse_trace(lines, "t", 512), config, list(setups.items()))
    return {r.name: r for r in runs}


def test_a_lone_remote_plan_waits_for_its_prefill_the_transfer_and_one_decode_step() -> None:
    # One 4,096-token prompt on an idle 1:1 fleet, `always` remote: prefill on P (one chunk, no
    # decode beside it), its 8 blocks cross a 10 Gb/s link, then every step on D is a pure decode.
    model = EngineModel()
    config = FleetConfig(engines=2, kv_blocks=100, speedup=1.0, link_bytes_per_sec=1.25e9)
    lines = _lines([(0.0, 4096, 11)])
    runs = _simulate(lines, config, {"always": PdSetup(settings=BASE, prefill_engines=1, decider="always"),
                                     "aggregated": PdSetup(settings=BASE)})
    remote, aggregated = runs["always"], runs["aggregated"]
    prefilled = model.iteration_ms([(4096, 0)], 0, 0.0) / 1000
    sent = prefilled + 4096 * 131_072 / 1.25e9  # 0.429 s of transfer
    step = model.iteration_ms([], 1, 8 / 100) / 1000  # D holds the prompt's 8 blocks of its 100
    assert remote.remote_share == 1.0 and remote.failed == 0 and remote.events_failed == 0
    assert remote.ttft["mean"] == pytest.approx(sent + step, rel=1e-12)
    assert remote.tpot is not None and remote.tpot["mean"] == pytest.approx(step, rel=1e-9)
    # Aggregated, the first token comes with the prefill, then the same decode steps.
    assert aggregated.ttft["mean"] == pytest.approx(prefilled, rel=1e-12)
    assert aggregated.tpot is not None and aggregated.tpot["mean"] == pytest.approx(step, rel=1e-9)
    assert aggregated.remote_share == 0.0


def test_one_link_sends_one_prompt_at_a_time() -> None:
    # Two 4,096-token prompts at once prefill in one iteration on the lone prefill engine; over a
    # 1 Gb/s link (4.3 s a prompt) the second waits for the first to be sent.
    config = FleetConfig(engines=3, kv_blocks=100, speedup=1.0, link_bytes_per_sec=1.25e8)
    lines = _lines([(0.0, 4096, 2), (0.0, 4096, 2)])
    pd = PdSetup(settings=BASE, prefill_engines=1, decider="always")
    run_ = _simulate(lines, config, {"pd": pd})["pd"]
    transfer = 4096 * 131_072 / 1.25e8
    assert run_.remote_share == 1.0
    first, last = run_.ttft_cdf[0][0], run_.ttft_cdf[-1][0]
    assert last - first >= transfer - 0.05  # the second's transfer began when the first's ended


def test_short_prompts_stay_local_and_answer_as_the_aggregated_fleet() -> None:
    # 200-token prompts a second apart: llm-d's decider keeps each on its decode engine (200
    # uncached tokens, not above 256); each request is alone, so its first token comes after
    # exactly its own prefill, as on the aggregated fleet.
    lines = _lines([(float(i), 200, 20) for i in range(10)])
    config = FleetConfig(engines=4, kv_blocks=1000, speedup=1.0)
    runs = _simulate(lines, config, {
        "aggregated": PdSetup(settings=BASE),
        "uncached_threshold": PdSetup(settings=BASE, prefill_engines=1, decider="uncached_threshold"),
        "always": PdSetup(settings=BASE, prefill_engines=1, decider="always")})
    alone = EngineModel().iteration_ms([(200, 0)], 0, 0.0) / 1000
    for name in ("aggregated", "uncached_threshold"):
        assert runs[name].ttft["p50"] == runs[name].ttft["p99"] == pytest.approx(alone, rel=1e-12), name
        assert runs[name].failed == 0
    assert runs["uncached_threshold"].remote_share == 0.0
    assert runs["uncached_threshold"].ttft == runs["aggregated"].ttft
    # Sent to a prefill engine instead, each waits for its transfer and a decode step too.
    assert runs["always"].remote_share == 1.0 and runs["always"].ttft["p50"] > alone


def test_isl_bounding_keeps_short_prompts_local_and_sends_long_ones() -> None:
    # Dynamo's defaults: local iff uncached < 2,048 and uncached share < 0.7. A prompt of 1,600
    # tokens whose first 1,536 the decode engines hold (the same conversation, a turn later) is
    # local; a 6,000-token prompt of nothing cached is remote.
    first = json.dumps({"timestamp": 0, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 3]})
    turns = [json.dumps({"timestamp": 1000 * i, "input_length": 1600, "output_length": 2,
                         "hash_ids": [1, 2, 3, 100 + i]}) for i in range(1, 4)]
    long = json.dumps({"timestamp": 5000, "input_length": 6000, "output_length": 2,
                       "hash_ids": list(range(200, 212))})
    lines = [line.encode() for line in (first, *turns, long)]
    config = FleetConfig(engines=2, kv_blocks=100, speedup=1.0)
    run_ = _simulate(lines, config, {"pd": PdSetup(settings=BASE, prefill_engines=1, decider="isl_bounding")})["pd"]
    # The first 1,536-token prompt is all uncached (ratio 1.0): remote; its blocks land on the
    # decode engine with the transfer, so the turns find them there (64 uncached, ratio 0.04):
    # local; the long one: remote. 2 of 5 remote.
    assert run_.remote_share == pytest.approx(2 / 5)
    assert run_.failed == 0 and run_.events_failed == 0


def test_long_prompts_with_long_outputs_decode_faster_split() -> None:
    # 8,192-token prompts every 0.2 s, 100 tokens each, on 2 engines. Aggregated, every engine's
    # decode steps share iterations with the next prompt's prefill (169 ms), so some tokens wait
    # that long; split 1:1, the decode engine only decodes, each step at most decode_ms plus the
    # KV term (its KV holds a few prompts of 16 blocks among 10,000).
    model = EngineModel()
    lines = _lines([(0.2 * i, 8192, 100) for i in range(20)])
    config = FleetConfig(engines=2, kv_blocks=10_000, speedup=1.0)
    runs = _simulate(lines, config, {"aggregated": PdSetup(settings=BASE),
                                     "always": PdSetup(settings=BASE, prefill_engines=1, decider="always")})
    split, aggregated = runs["always"], runs["aggregated"]
    assert split.tpot is not None and aggregated.tpot is not None
    slowest_pure_step = model.iteration_ms([], 1, 20 * 16 / 10_000) / 1000  # all 20 prompts' blocks at once
    assert split.tpot["p99"] <= slowest_pure_step * (1 + 1e-9)  # (float sums of the steps)
    prefill_beside = model.iteration_ms([(8192, 0)], 1, 0.0) / 1000
    assert aggregated.tpot["p99"] > slowest_pure_step + prefill_beside / 100  # one 169 ms step in 99
    assert split.tpot["mean"] < aggregated.tpot["mean"]
    assert split.remote_share == 1.0 and split.failed == aggregated.failed == 0
    # The price: the first token waits for the transfer (and a single prefill engine).
    assert split.ttft["mean"] > aggregated.ttft["mean"]


def test_the_aggregated_fleet_planned_answers_as_the_aggregated_simulator() -> None:
    """With no prefill engines every plan is local on the engine `/select` picks, the handoff is
    prefill_complete and the end is free: the same figures as the `Settings` run, exactly."""
    lines = [json.dumps({"timestamp": i * 150, "input_length": 8 * 512, "output_length": 40, "hash_ids": [
        100 * (i % 12) + j for j in range(6)] + [10_000 + 2 * i, 10_001 + 2 * i]}).encode() for i in range(300)]
    config = FleetConfig(engines=3, kv_blocks=120, load=0.9)
    for policy in (BASE, Settings(kv_events="push", router_policy="ttft")):
        runs = _simulate(lines, config, {"plain": policy, "planned": PdSetup(settings=policy)})
        plain, planned = runs["plain"], runs["planned"]
        assert planned.ttft == plain.ttft and planned.queue_wait == plain.queue_wait
        assert planned.hit_rate == plain.hit_rate and planned.series == plain.series
        assert plain.tpot is None and planned.tpot is not None and planned.tpot["mean"] > 0


def _write(tmp_path: Path, lines: list[bytes]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines))
    return path


def test_the_cli_prints_the_new_columns_and_writes_them_to_json_and_html(tmp_path: Path) -> None:
    trace = _write(tmp_path, _lines([(0.05 * i, 3000 + 500 * (i % 5), 50) for i in range(60)]))
    out, report = tmp_path / "out.json", tmp_path / "out.html"
    done = run(str(trace), "--pd", "1:3", "2:2", "--deciders", "always,never,ttft", "--load", "0.5",
               "--link-gbps", "200", "--kv-bytes-per-token", "65536", "--json", str(out), "--report", str(report))
    assert done.returncode == 0, done.stderr
    table = done.stdout.splitlines()
    assert table[0].split() == ["setting", "remote", "ttft", "mean", "p50", "p99", "tpot", "mean", "ms", "p99", "ms",
                                "wait", "mean", "hit", "rate", "requests", "failed"]
    names = ["aggregated", "aggregated ttft", "1:3 always", "1:3 never", "1:3 ttft", "2:2 always", "2:2 never", "2:2 ttft"]
    assert [re.split(r"\s{2,}", line)[0] for line in table[2:10]] == names
    assert "1:3 always: mean TTFT" in done.stdout and "mean TPOT" in done.stdout
    assert "8 runs, 480 requests in" in done.stdout
    document: dict[str, Any] = json.loads(out.read_text())
    assert document["fleet"]["engines"] == 4
    assert document["fleet"]["kv_bytes_per_token"] == 65536 and document["fleet"]["link_bytes_per_sec"] == 25e9
    by_name = {s["name"]: s for s in document["settings"]}
    assert list(by_name) == names
    assert by_name["aggregated"]["pd"] == {"prefill_engines": 0, "decode_engines": 4, "decider": None}
    assert by_name["2:2 ttft"]["pd"] == {"prefill_engines": 2, "decode_engines": 2, "decider": "ttft"}
    assert by_name["2:2 ttft"]["settings"] == by_name["aggregated ttft"]["settings"] == {"router_policy": "ttft"}
    assert by_name["1:3 always"]["remote_share"] == 1.0
    for setting in document["settings"]:
        assert set(setting["tpot"]) == {"mean", "p50", "p90", "p99"} and setting["failed"] == 0
        assert 0 < setting["tpot"]["p50"] <= setting["tpot"]["p99"] and setting["events_failed"] == 0
    page = report.read_text()
    assert "<th>TPOT mean (ms)</th>" in page and "1 prefill + 3 decode engines, decider always" in page
    assert f"<td>{by_name['1:3 always']['tpot']['mean'] * 1000:.1f}</td>" in page
    assert "kv_bytes_per_token=65536" in page
    # Two distributions, a curve per run in each: the time to the first token and per output token.
    assert "<h2>Time per output token</h2>" in page and "time per output token (ms)" in page
    for color in COLORS[:len(names)]:
        assert page.count(f'stroke="{color}" stroke-width="2.0"') == 2, color


def test_without_pd_the_output_has_no_new_columns(tmp_path: Path) -> None:
    trace = _write(tmp_path, _lines([(0.1 * i, 2000, 10) for i in range(20)]))
    out = tmp_path / "out.json"
    done = run(str(trace), "--engines", "2", "--no-baselines", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "tpot" not in done.stdout and "remote" not in done.stdout
    document = json.loads(out.read_text())
    assert "kv_bytes_per_token" not in document["fleet"] and "tpot" not in document["settings"][0]


def test_bad_pd_flags_give_one_line_usage_errors(tmp_path: Path) -> None:
    trace = _write(tmp_path, _lines([(0.1 * i, 2000, 10) for i in range(5)]))
    for flags, text in (
            (("--pd", "3:6", "--engines", "8"), "--pd 3:6: 9 engines, not the fleet's 8"),
            (("--pd", "2:6", "3:3"), "--pd 3:3: 6 engines, not the fleet's 8"),
            (("--pd", "0:8"), "--pd 0:8: a disaggregated fleet needs at least 1 prefill and 1 decode engine"),
            (("--pd", "4:0"), "needs at least 1 prefill and 1 decode engine"),
            (("--pd", "4"), "--pd: expected P:D, prefill and decode engines (e.g. 2:6), not '4'"),
            (("--pd=-1:9",), "--pd: expected P:D"),
            (("--pd", "-1:9"), "argument --pd: expected at least one argument"),
            (("--pd", "a:b"), "--pd: expected P:D"),
            (("--pd", "99999999999999:1"), "--pd: expected P:D"),
            (("--pd", "1000:1000"), "--engines: must be at most 1024"),
            (("--pd", "1:1", "--service", "http://127.0.0.1:1"), "--pd: runs the core in process"),
            (("--pd", "1:1", "--link-gbps", "0"), "--link-gbps: must be a number from 0.000001 to 1000000"),
            (("--pd", "1:1", "--link-gbps", "-5"), "--link-gbps: must be a number from"),
            (("--pd", "1:1", "--link-gbps", "nan"), "--link-gbps: must be a number from"),
            (("--pd", "1:1", "--link-gbps", "inf"), "--link-gbps: must be a number from"),
            (("--pd", "1:1", "--kv-bytes-per-token", "0"), "--kv-bytes-per-token: must be from 1 to"),
            (("--pd", "1:1", "--kv-bytes-per-token", "-1"), "--kv-bytes-per-token: must be from 1 to"),
            (("--pd", "1:1", "--deciders", "always,sometimes"), "--deciders: 'sometimes' is not one of isl_bounding"),
            (("--pd", "1:1", "--deciders", ""), "--deciders: '' is not one of"),
            (("--deciders", "always"), "--deciders: only with --pd"),
            (("--link-gbps", "400"), "--link-gbps: only with --pd"),
            (("--kv-bytes-per-token", "1"), "--kv-bytes-per-token: only with --pd")):
        done = run(str(trace), *flags)
        assert done.returncode == 2 and text in done.stderr, (flags, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr


_REQUEST = st.tuples(st.integers(0, 400), st.integers(0, 3), st.integers(1, 3000), st.integers(0, 60))


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(_REQUEST, min_size=1, max_size=25), prefill=st.integers(0, 2),
       decider=st.sampled_from(["isl_bounding", "uncached_threshold", "always", "never", "ttft"]),
       kv_blocks=st.integers(8, 40), gbps=st.sampled_from([0.5, 100.0]), complete=st.booleans())
def test_every_request_ends_and_leaves_nothing_behind(requests: list[tuple[int, int, int, int]], prefill: int,
                                                      decider: str, kv_blocks: int, gbps: float,
                                                      complete: bool) -> None:
    """Any small trace on any split, decider, KV size and link: every request gets its first and
    last token once, and at the end the core holds no booking and the engines hold no block a
    request pins (what they cached stays cached)."""
    engines: list[Engine] = []
    services: list[Any] = []

    class Recorded(Engine):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            engines.append(self)

    class Routed(routers_module.PdRouter):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            services.append(self.service)

    lines: list[bytes] = []
    at = 0
    for gap, conversation, isl, osl in requests:  # a conversation's prompts share their first block
        at += gap
        blocks = -(-isl // 512)
        lines.append(json.dumps({"timestamp": at, "input_length": isl, "output_length": osl, "hash_ids": [
            conversation] + [10 + 1000 * len(lines) + j for j in range(blocks - 1)]}).encode())
    config = FleetConfig(engines=3, kv_blocks=kv_blocks, speedup=1.0, link_bytes_per_sec=gbps * 1e9 / 8,
                         prefill_complete=complete)
    settings_ = Settings(kv_events="push", router_policy="ttft") if decider == "ttft" else BASE
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fleet_module, "Engine", Recorded)
        patch.setattr(fleet_module, "PdRouter", Routed)
        run_ = _simulate(lines, config, {"run": PdSetup(settings=settings_, prefill_engines=prefill,
                                                        decider=None if prefill == 0 else decider)})["run"]
    assert run_.failed == 0 and run_.events_failed == 0 and run_.requests == len(requests)
    assert len(run_.ttft_cdf) >= 1 and run_.ttft_cdf[-1][1] == 1.0
    assert len(run_.ttft_cdf) == len(requests) + 1  # every first token (none thinned out), and the closing point
    assert (run_.remote_share or 0.0) <= (1.0 if prefill else 0.0)
    assert len(engines) == 3
    for engine in engines:
        assert engine.private == 0 and not engine.active and engine.in_flight() == 0
        assert not engine.loading and not engine.to_send and not engine.prefilled
    (service,) = services
    (key,) = service.loads()
    assert all(load.active_requests == load.potential_prefill_tokens == load.potential_decode_blocks == 0
               for load in key.loads), key
