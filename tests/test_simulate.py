"""`selection-proto simulate` (docs/ROUTING.md): a Mooncake trace replayed through simulated engines and the
real core, as a real subprocess; its JSON, its table, its HTML report rendered by a real headless
Chromium, and its refusals of bad traces (exit 2, one line, no traceback)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
import subprocess
import sys
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import attrs
import pytest

import selection_proto.sim.routers as routers_module
from selection_proto.core.base.settings import Settings
from selection_proto.sim import EngineModel, FleetConfig, parse_trace, simulate

ROOT = Path(__file__).resolve().parent.parent
TRACE = Path(os.environ.get("SELECTION_PROTO_TRACES", ROOT.parent / "shared" / "traces")) / "conversation_trace.jsonl.gz"


def trace_file() -> Path:
    if not TRACE.is_file():
        pytest.fail(f"the Mooncake trace is missing: {TRACE} (set SELECTION_PROTO_TRACES)")
    return TRACE


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "selection_proto", "simulate", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_slice_of_the_trace_side_by_side_with_the_baselines(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    done = run(str(trace_file()), "--requests", "1500", "--skip", "500", "--engines", "4",
               "--compare", "overlap_score_weight=1", "--compare", "overlap_score_weight=0", "--json", str(out))
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    names = [s["name"] for s in document["settings"]]
    assert names == ["overlap_score_weight=1", "overlap_score_weight=0", "random", "round-robin", "least-loaded"]
    for setting in document["settings"]:
        assert set(setting) >= {"name", "ttft", "queue_wait", "hit_rate", "busy_max_mean", "requests", "failed"}
        assert set(setting["ttft"]) == {"mean", "p50", "p90", "p99"}
        assert setting["requests"] == 1500 and setting["failed"] == 0
        assert setting["events_failed"] == 0  # every KV event the engines published applied
        assert 0 < setting["ttft"]["p50"] <= setting["ttft"]["p90"] <= setting["ttft"]["p99"]
    by_name = {s["name"]: s for s in document["settings"]}
    assert by_name["overlap_score_weight=0"]["settings"] == {"overlap_score_weight": 0.0}
    # Routing for the cache finds more of it than spreading blindly, and so answers sooner.
    cache_aware = by_name["overlap_score_weight=1"]
    for baseline in ("random", "round-robin", "least-loaded"):
        assert cache_aware["hit_rate"] > 1.5 * by_name[baseline]["hit_rate"]
        assert cache_aware["ttft"]["mean"] < by_name[baseline]["ttft"]["mean"]
    assert document["fleet"]["engines"] == 4 and document["fleet"]["engine_model"]["max_batched_tokens"] == 8192
    table = done.stdout.splitlines()
    assert table[0].split()[:2] == ["setting", "ttft"] and table[2].startswith("overlap_score_weight=1")
    assert "5 runs, 7500 requests in" in done.stdout


def _trace_lines(count: int, shared: int) -> list[bytes]:
    """`count` requests, one a second, each of 8 blocks whose first `shared` are the same."""
    return [json.dumps({"timestamp": i * 1000, "input_length": 8 * 512, "output_length": 20,
                        "hash_ids": list(range(shared)) + [1000 + 8 * i + j for j in range(8 - shared)]}).encode()
            for i in range(count)]


def test_the_api_is_deterministic_and_follows_the_cache() -> None:
    # 40 conversations of a 6-block prefix each, taking turns: more than one engine's cache holds.
    lines = [json.dumps({"timestamp": i * 1000, "input_length": 8 * 512, "output_length": 20, "hash_ids": [
        100 * (i % 40) + j for j in range(6)] + [10_000 + 2 * i, 10_001 + 2 * i]}).encode() for i in range(400)]

    def trace() -> Any:
        return parse_trace(lines, "shared", 512)

    config = FleetConfig(engines=4, kv_blocks=100, load=0.6)
    runs = [("default", Settings(kv_events="push")), ("random", None)]
    first, second = simulate(trace, config, runs), simulate(trace, config, runs)
    assert [r.to_json() for r in first] == [r.to_json() for r in second]
    core, spread = first
    # Each engine holds a quarter of the conversations if the router keeps them apart: the core
    # does, random scatters them over every engine's cache.
    assert core.hit_rate > 1.5 * spread.hit_rate, (core.hit_rate, spread.hit_rate)
    assert core.requests == spread.requests == 400


@pytest.mark.parametrize(("content", "message"), [
    (b'{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\nnot json\n', "bad.jsonl:2: not JSON"),
    (b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n',
     "bad.jsonl:1: `input_length` 600 exceeds its 1 blocks of 512 tokens"),
    (b'{"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n',
     "bad.jsonl:1: `timestamp` must be a number of milliseconds, at least 0"),
    (b'[1, 2]\n', "bad.jsonl:1: expected a JSON object"),
    (b'{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, -2]}\n',
     "bad.jsonl:1: `hash_ids` must be an array of non-negative integers"),
    (b'{"timestamp": 0, "input_length": 1' + b"0" * 5000 + b', "output_length": 1, "hash_ids": [1]}\n',
     "bad.jsonl:1:"),
    (b'{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n' * 2
     + b'{"timestamp": 1, "input_length": 4, "output_length": true, "hash_ids": [1]}\n',
     "bad.jsonl:3: `output_length` must be an integer from 0 to 1048576"),
    (b'{"timestamp": 0, "input_length": 4, "output_length": 1000000000000, "hash_ids": [1]}\n',
     "bad.jsonl:1: `output_length` must be an integer from 0 to 1048576"),
    (b'{"timestamp": 0, "input_length": 1000000000000, "output_length": 1, "hash_ids": [1]}\n',
     "bad.jsonl:1: `input_length` must be an integer from 1 to 1048576"),
    (b'{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [' + b"1," * 2000 + b'1]}\n',
     "bad.jsonl:1: the request needs 2001 KV blocks and an engine has 1000 (--kv-blocks)"),
    (b'{"timestamp": 9, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n'
     b'{"timestamp": 3, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n',
     "bad.jsonl:2: `timestamp` 3 is before the line above's (9)"),
    (b'{"timestamp": NaN, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n', "bad.jsonl:1: not JSON"),
    (b'{"timestamp": 0, "hash_ids": [' + b"1," * (9 << 20) + b'1]}\n',
     "bad.jsonl:1: the line is longer than 16777216 bytes"),
    (b'{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n'
     b'{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1], "x": "\\ud800"}\n',
     "bad.jsonl:2: not JSON"),
])
def test_a_bad_line_ends_it_with_one_line_naming_the_file_and_line(tmp_path: Path, content: bytes,
                                                                   message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    done = run(str(path))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("selection-proto simulate: error: ") and str(path) in lines[0]
    assert lines[0].split(str(path).rsplit("/", 1)[0] + "/", 1)[1].startswith(message)


def test_a_missing_or_corrupt_file_and_bad_flags_exit_2(tmp_path: Path) -> None:
    done = run(str(tmp_path / "nowhere.jsonl"))
    assert done.returncode == 2 and done.stderr.strip() == (
        f"selection-proto: error: {tmp_path / 'nowhere.jsonl'}: no such file")
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b"\n".join(_trace_lines(50, 2)))[:200])
    done = run(str(cut))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"\n".join(_trace_lines(10, 2)))
    for flags, text in ((("--load", "0"), "--load: must be a positive number"),
                        (("--engines", "0"), "--engines: must be at least 1"),
                        (("--engines", "100000"), "--engines: must be at most 1024"),
                        (("--kv-blocks", "0"), "--kv-blocks: must be at least 1"),
                        (("--request-fixed-ms", "-1"), "--request-fixed-ms: must be at least 0"),
                        (("--trace-block-size", "1000000000000"), "--trace-block-size: must be at most 1048576"),
                        (("--prefill-tokens-per-sec", "1e-300"), "--prefill-tokens-per-sec: must be at least 1"),
                        (("--report", str(tmp_path)), f"{tmp_path}: is a folder; name a file to write"),
                        (("--json", str(tmp_path)), f"{tmp_path}: is a folder; name a file to write"),
                        (("--compare", "nonsense=1"), "--compare: expected KEY=VALUE with a setting's name"),
                        (("--compare", "overlap_score_weight=x"), "invalid float value 'x'"),
                        (("--engine-speeds", "1,0"), "--engine-speeds: at most 1024 numbers, each from 0.001 to 1000"),
                        (("--engine-speeds", "1,nan"), "--engine-speeds: at most 1024 numbers"),
                        (("--engine-speeds", "fast"), "--engine-speeds: 'fast' is not a list of numbers")):
        done = run(str(good), *flags)
        assert done.returncode == 2 and text in done.stderr and "Traceback" not in done.stderr, done.stderr


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the RGB(A) rows of an 8-bit PNG (what Chromium writes), unfiltered."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = channels = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    previous = bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line))
        previous = line
    return width, channels, rows


def test_the_report_renders_in_chromium_with_a_curve_per_setting(tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("chromium is missing: .ci/run installs Debian's chromium")
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"\n".join(_trace_lines(200, 5)))
    report = tmp_path / "report.html"
    done = run(str(trace), "--engines", "3", "--kv-blocks", "200", "--report", str(report))
    assert done.returncode == 0, done.stderr
    page = report.read_text()
    assert "<svg" in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1000,900", f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, timeout=120, check=True)
    width, channels, rows = _png_pixels(shot.read_bytes())
    assert width == 1000

    def count(color: str) -> int:
        rgb = bytes.fromhex(color[1:])
        return sum(row[i:i + 3] == rgb for row in rows for i in range(0, len(row), channels))

    from selection_proto.sim.report import COLORS

    # One CDF curve per setting, each drawn in its own color (default, random, round-robin).
    for color in COLORS[:3]:
        assert count(color) > 150, color
    dark = sum(1 for row in rows for i in range(0, len(row), channels) if sum(row[i:i + 3]) < 150)
    assert dark > 2000  # the title, the table and the axes' text


def test_a_running_service_over_http_routes_as_the_core_in_process(tmp_path: Path) -> None:
    """`--service`: the fleet routed by a real `serve` over HTTP, its engines publishing vLLM KV
    events over ZMQ to it, decides exactly as the same core in process."""
    from test_http import Server

    server = Server(mode="subscribe")
    try:
        out = tmp_path / "runs.json"
        done = run(str(trace_file()), "--requests", "300", "--skip", "100", "--engines", "3", "--no-baselines",
                   "--compare", "router_policy=dynamo", "--service", f"http://127.0.0.1:{server.port}",
                   "--json", str(out))
        assert done.returncode == 0, done.stderr
        local, remote = json.loads(out.read_text())["settings"]
        assert remote["name"] == f"service http://127.0.0.1:{server.port}" and remote["events_failed"] == 0
        for key in ("ttft", "queue_wait", "hit_rate", "requests", "failed"):
            assert remote[key] == local[key], key
        assert remote["hit_rate"] > 0  # its index was fed by the engines' events
        # The run's workers are gone again, and their bookings with them.
        assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/loads").read()) == []
    finally:
        server.stop()
    done = run(str(trace_file()), "--requests", "10", "--service", "http://127.0.0.1:1")
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_trace_lines_may_say_their_tenant_and_each_tenant_gets_its_figures(tmp_path: Path) -> None:
    """Tenant `a` steady, tenant `b` a burst of many times its share; with fairness on,
    `a`'s TTFT barely moves, with one FIFO it waits behind `b`. Several settings after one --compare."""
    lines, block = [], 10_000
    for i in range(240):  # a: one every half second for two minutes
        block += 4
        lines.append((i * 500, {"tenant": "a", "hash_ids": list(range(block, block + 4))}))
    for i in range(600):  # b: twenty a second from 30 s to 60 s
        block += 4
        lines.append((30_000 + i * 50, {"tenant": "b", "hash_ids": list(range(block, block + 4)), "priority": 0}))
    trace = tmp_path / "tenants.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 4 * 512, "output_length": 10, **extra}) + "\n"
                             for t, extra in sorted(lines, key=lambda line: line[0])))
    out, report = tmp_path / "runs.json", tmp_path / "report.html"
    done = run(str(trace), "--engines", "2", "--load", "1.0", "--no-baselines", "--json", str(out), "--report",
               str(report), "--compare", "queue_threshold=1,fairness=false", "queue_threshold=1")
    assert done.returncode == 0, done.stderr
    runs = {s["name"]: s for s in json.loads(out.read_text())["settings"]}
    fifo, fair = runs["queue_threshold=1,fairness=false"], runs["queue_threshold=1"]
    for setting in (fifo, fair):
        assert set(setting["tenants"]) == {"a", "b"}
        assert setting["tenants"]["a"]["requests"] == 240 and setting["tenants"]["b"]["requests"] == 600
        assert set(setting["tenants"]["a"]["ttft"]) == {"mean", "p50", "p90", "p99"}
    a_fair, a_fifo = fair["tenants"]["a"]["ttft"]["p99"], fifo["tenants"]["a"]["ttft"]["p99"]
    assert a_fair * 3 < a_fifo, (a_fair, a_fifo)
    assert "tenant" in done.stdout and "Per tenant" in report.read_text()
    bad = tmp_path / "bad.jsonl"
    for extra, message in (({"tenant": ""}, "`tenant` must be a string of 1 to 256 characters"),
                           ({"priority": 1.5}, "`priority` must be a 64-bit integer"),
                           ({"deadline_ms": 0}, "`deadline_ms` must be a number of milliseconds greater than 0"),
                           ({"policy_class": 7}, "`policy_class` must be a string of 1 to 256 characters")):
        bad.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], **extra}))
        done = run(str(bad), "--no-baselines")
        assert done.returncode == 2 and done.stderr.strip().endswith(f"bad.jsonl:1: {message}"), done.stderr


def test_speedup_replays_the_traces_own_timestamps(tmp_path: Path) -> None:
    """--speedup X keeps the trace's own spacing, X times faster, instead of --load."""
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"\n".join(_trace_lines(60, 0)))  # one request a second, nothing shared
    waits = {}
    for speedup in ("1", "1000"):
        out = tmp_path / f"{speedup}.json"
        done = run(str(trace), "--engines", "1", "--speedup", speedup, "--no-baselines", "--json", str(out))
        assert done.returncode == 0, done.stderr
        document = json.loads(out.read_text())
        assert document["fleet"]["speedup"] == float(speedup)
        waits[speedup] = document["settings"][0]["ttft"]["mean"]
    assert waits["1"] < 0.2 < 1.0 < waits["1000"]  # a second apart each is alone; all at once, they share
    for bad in ("0", "-1", "nan", "inf"):
        done = run(str(trace), "--speedup", bad)
        assert done.returncode == 2 and "--speedup: must be a positive number" in done.stderr


def test_mocker_timing_uses_dynamos_polynomials_exactly(tmp_path: Path) -> None:
    """Ours counts attention over a chunk's context (a 32k prompt ~1.0 s); the mocker does
    not (~0.68 s); --mocker-timing uses its formulas, decode's quadratic in KV use too."""
    from selection_proto.sim.engine import EngineModel

    ours, mocker = EngineModel(), EngineModel(mocker=True)
    chunks = [(8192, 8192 * i) for i in range(4)]
    assert round(sum(ours.iteration_ms([c], 0, 0.0) for c in chunks)) == 1015
    assert round(sum(mocker.iteration_ms([c], 0, 0.0) for c in chunks)) == 677
    t = 3000  # the mocker's quadratic is over the iteration's total new tokens
    assert mocker.iteration_ms([(1000, 0), (2000, 5000)], 0, 0.0) == pytest.approx(
        4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142)
    assert mocker.iteration_ms([], 4, 0.5) == pytest.approx(-25.74 / 4 + 54.01 / 2 + 5.74)
    assert mocker.iteration_ms([], 0, 0.5) == 0.0
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"\n".join(_trace_lines(50, 4)))
    out = tmp_path / "out.json"
    done = run(str(trace), "--engines", "2", "--mocker-timing", "--no-baselines", "--json", str(out))
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert document["fleet"]["engine_model"]["mocker"] is True and document["settings"][0]["failed"] == 0


def test_the_report_says_the_differences_in_words_and_a_far_behind_baseline_turns_the_axis_logarithmic() -> None:
    import re

    from selection_proto.sim.fleet import SettingRun
    from selection_proto.sim.report import html_report, summary

    def setting(name: str, scale: float, hit: float) -> SettingRun:
        cdf = [(scale * (i + 1) / 10, (i + 1) / 10) for i in range(10)]
        return SettingRun(name=name, settings={}, ttft={"mean": scale * 0.5, "p50": scale * 0.5, "p90": scale * 0.9,
                                                        "p99": scale}, queue_wait={"mean": 0.0}, hit_rate=hit,
                          busy_max_mean=1.0, requests=10, failed=0, events_failed=0, ttft_cdf=cdf,
                          series={"times": [], "in_flight": [], "kv_used": []})

    fast, slow = setting("router_policy=ttft", 0.3, 0.5), setting("random", 30.0, 0.1)
    assert summary([fast, slow]) == ["random: mean TTFT 100.00x, p99 TTFT 100.00x, hit rate 0.20x those of "
                                     "router_policy=ttft"]
    page = html_report([fast, slow], FleetConfig(), "t")
    assert "those of router_policy=ttft" in page and "log scale" in page
    first = re.search(r'<polyline [^>]*points="([^"]+)"', page)
    assert first is not None
    xs = [float(point.split(",")[0]) for point in first.group(1).split()]
    assert max(xs) - min(xs) > 0.3 * 620  # the fast setting's curve spans the chart, not its left edge
    assert "log scale" not in html_report([fast, setting("close", 0.4, 0.5)], FleetConfig(), "t")


def test_the_series_stay_bounded_when_the_fleet_runs_long_after_the_last_arrival() -> None:
    """Two requests arriving together, each a long generation: the fleet runs minutes after the
    last arrival, and the per-engine series were sampled every millisecond meanwhile (a run of
    one million-token prompt kept 480,000 samples). They keep at most twice `samples` points,
    evenly spread over the whole run."""
    lines = [json.dumps({"timestamp": 0, "input_length": 512, "output_length": 20_000, "hash_ids": [i]}).encode()
             for i in range(2)]
    config = FleetConfig(engines=2, kv_blocks=100, load=0.5, samples=50)
    (run,) = simulate(lambda: parse_trace(lines, "long", 512), config, [("default", Settings(kv_events="push"))])
    times = run.series["times"]
    assert run.requests == 2 and 50 <= len(times) < 100, len(times)
    assert all(len(s) == len(times) for s in (*run.series["in_flight"], *run.series["kv_used"]))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= 1.01 * min(gaps), gaps
    assert times[-1] > 60  # they cover the whole run: 20,000 tokens decoded after the arrivals


def test_engine_speeds_slow_the_engines_named_and_the_load_follows_the_fleet(tmp_path: Path) -> None:
    """A mixed fleet. Every other engine a quarter as fast: round-robin, blind to speed,
    gives the slow ones as much as the fast ones and waits far longer than on a uniform fleet
    offered the same share of its capacity, while a load-aware router keeps closer."""
    out, mixed_out = tmp_path / "uniform.json", tmp_path / "mixed.json"
    common = [str(trace_file()), "--requests", "1500", "--engines", "4", "--load", "0.7", "--compare",
              "router_policy=ttft"]
    assert run(*common, "--json", str(out)).returncode == 0
    done = run(*common, "--engine-speeds", "1,0.25", "--json", str(mixed_out))
    assert done.returncode == 0, done.stderr
    uniform = {r["name"]: r for r in json.loads(out.read_text())["settings"]}
    document = json.loads(mixed_out.read_text())
    mixed = {r["name"]: r for r in document["settings"]}
    assert document["fleet"]["engine_speeds"] == [1.0, 0.25]
    assert mixed["round-robin"]["ttft"]["mean"] > 3 * uniform["round-robin"]["ttft"]["mean"]
    assert mixed["router_policy=ttft"]["ttft"]["mean"] < mixed["round-robin"]["ttft"]["mean"] / 3
    assert all(r["requests"] == 1500 and r["failed"] == 0 for r in mixed.values())


def test_without_prefill_complete_the_router_hears_only_frees() -> None:
    """Clients that never call prefill_complete: the core never hears one, each booking's prefill
    tokens count until its free, and the routing changes."""
    lines = [json.dumps({"timestamp": i * 100, "input_length": 4 * 512, "output_length": 200,
                         "hash_ids": [i % 7, 100 + i, 200 + i, 300 + i]}).encode() for i in range(300)]
    heard: list[int] = []

    class Counting(routers_module.SelectionService):
        def prefill_complete(self, *args: Any, **kwargs: Any) -> None:
            heard.append(1)
            super().prefill_complete(*args, **kwargs)

    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routers_module, "SelectionService", Counting)
        for told in (True, False):
            heard.clear()
            config = FleetConfig(engines=4, kv_blocks=200, load=0.9, prefill_complete=told)
            (runs[told],) = simulate(lambda: parse_trace(lines, "t", 512), config,
                                     [("ttft", Settings(kv_events="push", router_policy="ttft"))])
            assert (len(heard) == 300) if told else not heard
    assert runs[True].requests == runs[False].requests == 300
    assert runs[True].ttft != runs[False].ttft


EXACT = EngineModel(prefill_fixed_ms=0, attention_ms=0, decode_ms=0, decode_full_ms=0)  # time = tokens / speed


def _deadline_lines(count: int, deadline_ms: float, every_ms: float = 20) -> list[bytes]:
    """`count` prompts of 2,048 tokens, nothing shared, each with `deadline_ms`."""
    return [json.dumps({"timestamp": i * every_ms, "input_length": 4 * 512, "output_length": 50,
                        "hash_ids": [10 * i + k for k in range(4)], "deadline_ms": deadline_ms}).encode()
            for i in range(count)]


def test_the_simulated_engines_say_their_prefill_speed_so_deadline_admission_is_right() -> None:
    """At 1.5x what two exact engines prefill, with 300 ms deadlines: told each engine's speed (the
    default), the router admits what it can serve in time and no admitted request is late; a mixed
    fleet (`engine_speeds`) is not told, and the router, assuming 10,000 tokens a second, refuses
    three times as many."""
    lines = _deadline_lines(400, 300)
    failed = {}
    for speeds in ((), (1.0,)):
        config = FleetConfig(engines=2, kv_blocks=200, speedup=1.5, engine_speeds=speeds, model=EXACT)
        (result,) = simulate(lambda: parse_trace(lines, "t", 512), config,
                             [("q", Settings(kv_events="push", queue_threshold=1e-6))])
        failed[speeds] = result.failed
        assert result.ttft_cdf[-1][0] <= 0.3  # the slowest first token of the admitted
    assert 0 < 3 * failed[()] < failed[(1.0,)], failed


def test_simulate_runs_with_free_decoding(tmp_path: Path) -> None:
    """`--decode-ms 0 --decode-full-ms 0`: decode steps cost nothing (it ended in ZeroDivisionError)."""
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"\n".join(_trace_lines(30, 2)))
    out = tmp_path / "out.json"
    done = run(str(trace), "--decode-ms", "0", "--decode-full-ms", "0", "--engines", "2", "--no-baselines",
               "--json", str(out))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    (setting,) = json.loads(out.read_text())["settings"]
    assert setting["requests"] == 30 and setting["failed"] == 0 and setting["ttft"]["mean"] > 0
    done = run(str(trace), "--decode-ms", "-1", "--no-baselines")
    assert done.returncode == 2 and "--decode-ms: must be a number of at least 0" in done.stderr


def test_trace_lines_may_name_their_policy_class() -> None:
    """A line's `policy_class` reaches the router: `gold` holds one waiting request at most, so in
    a burst of gold and bulk at once the gold ones past it are refused and no bulk one is."""
    lines = [json.dumps({"timestamp": i, "input_length": 4 * 512, "output_length": 10, "tenant": name,
                         "policy_class": name, "hash_ids": [10 * i + k + (5000 if name == "bulk" else 0)
                                                            for k in range(4)]}).encode()
             for i in range(20) for name in ("gold", "bulk")]
    config = FleetConfig(engines=1, kv_blocks=200, speedup=1.0)
    (result,) = simulate(lambda: parse_trace(lines, "t", 512), config, [("q", Settings(
        kv_events="push", queue_threshold=1e-6, flow_classes="gold:1:max_queued=1,bulk:1"))])
    assert result.tenants["bulk"]["failed"] == 0 and result.tenants["gold"]["failed"] >= 15, result.tenants


@pytest.mark.parametrize("deadline_ms", [2000, 500])
def test_with_exact_speeds_no_admitted_request_misses_its_deadline(deadline_ms: int) -> None:
    """800 requests of the Mooncake trace, each with a deadline, at 1.5x what four exact engines
    prefill: an engine prefills a request in a batch with others' tokens, and the prediction counts
    that batch, so no admitted request's first token is late, at the docs' `queue_threshold=1` as at
    1e-6 (before, at 2,000 ms: 1.23x late at 1, 1.04x at 1e-6; at 500 ms a long prompt sent at once
    to a free engine was 3.7x late)."""
    with gzip.open(trace_file()) as lines:
        raw = [json.loads(line) for _, line in zip(range(800), lines, strict=False)]
    trace = [json.dumps({**r, "deadline_ms": deadline_ms}).encode() for r in raw]
    config = FleetConfig(engines=4, load=1.5, model=EXACT)
    runs = simulate(lambda: parse_trace(trace, "t", 512), config, [
        (str(threshold), Settings(kv_events="push", queue_threshold=threshold)) for threshold in (1.0, 1e-6)])
    for result in runs:
        assert result.ttft_cdf[-1][0] <= deadline_ms / 1000, (result.name, result.ttft_cdf[-1])
        assert result.failed < (0.1 if deadline_ms == 2000 else 0.4) * len(raw), (result.name, result.failed)


def test_the_oracle_beside_ours_and_dynamos(tmp_path: Path) -> None:
    """`--compare oracle`: the all-knowing router runs beside the settings, and the table and the
    report give each run's mean TTFT over the oracle's and over Dynamo's cost."""
    report = tmp_path / "report.html"
    done = run(str(trace_file()), "--requests", "400", "--engines", "4", "--no-baselines", "--report", str(report),
               "--compare", "router_policy=dynamo", "router_policy=ttft", "oracle")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[-2:] == ["mean/oracle", "mean/dynamo"]
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    assert list(rows) == ["router_policy=dynamo", "router_policy=ttft", "oracle"]
    for row in rows.values():
        mean = float(row[1])
        assert row[-2] == f"{mean / float(rows['oracle'][1]):.2f}x"
        assert row[-1] == f"{mean / float(rows['router_policy=dynamo'][1]):.2f}x"
    assert rows["oracle"][-2] == "1.00x" and rows["router_policy=dynamo"][-1] == "1.00x"
    page = report.read_text()
    assert "<th>mean/oracle</th><th>mean/dynamo</th>" in page
    assert f"<td>{rows['router_policy=ttft'][-2]}</td><td>{rows['router_policy=ttft'][-1]}</td>" in page
    # Alone, `oracle` runs beside the defaults (Dynamo's cost).
    done = run(str(trace_file()), "--requests", "200", "--engines", "2", "--no-baselines", "--compare", "oracle")
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[2:4]] == ["default", "oracle"]


def _tenants_lines(count: int, copies: int, window: float) -> tuple[list[bytes], list[bytes]]:
    """(both tenants, `a` alone): `a` the trace's first `count` requests as they are; `b` the
    middle `window` of them copied `copies` times within it, each copy on blocks of its own."""
    with gzip.open(trace_file(), "rb") as raw:
        records = [json.loads(line) for _, line in zip(range(count), raw, strict=False)]
    first, last = records[0]["timestamp"], records[-1]["timestamp"]
    start = first + (last - first) * (0.5 - window / 2)
    stop = start + (last - first) * window
    middle = [r for r in records if start <= r["timestamp"] < stop]
    burst = [dict(r, tenant="b", timestamp=start + (n + copy / (copies + 1)) * (stop - start) / len(middle),
                  hash_ids=[h + (copy << 40) for h in r["hash_ids"]])
             for copy in range(1, copies + 1) for n, r in enumerate(middle)]
    alone = [dict(r, tenant="a") for r in records]
    both = sorted(alone + burst, key=lambda r: r["timestamp"])
    return [json.dumps(r).encode() for r in both], [json.dumps(r).encode() for r in alone]


def test_a_light_tenant_keeps_its_ttft_beside_a_burst_held_to_its_share_of_the_kv() -> None:
    """docs/FLOW_CONTROL.md: `a` a slice of the Mooncake trace at 20% of 4 engines; `b` copies of
    its middle half at 4x its rate. With fairness and a burst allowance only, `b`'s requests, once
    sent, fill the engines' KV cache while they decode and `a`'s wait for it: `a`'s TTFT p99 was
    1.8x its own alone. Holding `b` to its share of the KV in flight (`fairness_kv_share=1`) keeps
    it within 1.5x, and `b` loses nothing by it. `a` alone runs exactly the same with it."""
    both, alone = _tenants_lines(1500, 4, 0.5)
    before = Settings(kv_events="push", queue_threshold=1.0, fairness_burst_tokens=1 << 20)
    recommended = attrs.evolve(before, fairness_kv_share=1.0)

    def runs(lines: list[bytes], load: float) -> dict[str, Any]:
        found = simulate(lambda: parse_trace(lines, "tenants", 512), FleetConfig(engines=4, load=load),
                         [("before", before), ("recommended", recommended)])
        return {r.name: r for r in found}

    solo = runs(alone, 0.2)
    assert solo["before"].tenants == solo["recommended"].tenants and solo["before"].ttft == solo["recommended"].ttft
    a_alone = solo["recommended"].tenants["a"]["ttft"]["p99"]
    shared = runs(both, 0.2 * len(both) / len(alone))  # `a` at 20%, `b` on top
    ratio = {name: run.tenants["a"]["ttft"]["p99"] / a_alone for name, run in shared.items()}
    assert ratio["recommended"] <= 1.5 < ratio["before"], ratio
    assert shared["recommended"].tenants["a"]["failed"] == 0
    b_before, b_now = shared["before"].tenants["b"], shared["recommended"].tenants["b"]
    assert b_now["failed"] <= b_before["failed"] and b_now["ttft"]["mean"] <= b_before["ttft"]["mean"]


def test_an_engine_given_stalls_stops_for_them() -> None:
    """`EngineModel(stall_ms, stall_every_secs)`: an iteration during which a stall point of its
    engine falls ends `stall_ms` later (docs/ROUTING.md, "An engine behind its prediction"). Each
    prompt here prefills alone in one iteration of 62 ms, which a stall point every 50 ms always
    meets: every first token comes 100 ms later; without stalls the engine runs as before."""
    lines = _trace_lines(20, 0)
    ttft = {}
    for stall_ms in (0.0, 100.0):
        config = FleetConfig(engines=1, kv_blocks=200, speedup=1.0,
                             model=attrs.evolve(EXACT, stall_ms=stall_ms, stall_every_secs=0.05))
        (result,) = simulate(lambda: parse_trace(lines, "t", 512), config, [("s", Settings(kv_events="push"))])
        ttft[stall_ms] = result.ttft["mean"]
    assert ttft[0.0] == pytest.approx(8 * 512 / EXACT.prefill_tokens_per_sec, rel=1e-6)
    assert ttft[100.0] == pytest.approx(ttft[0.0] + 0.1, rel=1e-6)
