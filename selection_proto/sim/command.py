"""The `simulate` command: its flags, and the files it reads (the trace, streamed, gzip or plain)
and writes (`--json`, `--report`). A trace that does not read ends it with exit status 2 and one
line naming the file and line; nothing here prints a traceback for bad input."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
import zlib
from collections.abc import Iterator
from typing import Any

import attrs

from ..config import UsageError, settings_with
from ..core.base.settings import Settings
from .engine import EngineModel, FleetConfig
from .fleet import BASELINES, DECIDERS, ORACLE, PdSetup, ReplicaSetup, Setup, simulate
from .report import document, html_report, summary, table
from .trace import MAX_TOKENS, TraceError, TraceRequest, parse_trace, read_lines

__all__ = ["add_parser", "run"]

_MODEL_FLAGS = (
    ("prefill_fixed_ms", float, "fixed cost of an iteration that prefills (ms)"),
    ("prefill_tokens_per_sec", float, "prefill speed, new tokens a second"),
    ("attention_ms", float, "attention cost, ms per million (new token x context token) pairs"),
    ("decode_ms", float, "a decode step on an empty KV cache (ms)"),
    ("decode_full_ms", float, "a decode step on a full KV cache (ms)"),
    ("max_batched_tokens", int, "new tokens an iteration prefills at most"),
    ("max_running", int, "requests an engine runs at once at most"),
    ("request_fixed_ms", float, "fixed cost of every prompt, in the iteration that ends its prefill (ms)"),
)


def add_parser(sub: Any) -> None:
    command = sub.add_parser("simulate", help="replay a Mooncake trace through simulated engines and the core")
    command.add_argument("trace", metavar="TRACE.jsonl", help="Mooncake JSONL (timestamp, input_length, "
                                                              "output_length, hash_ids); .gz read as gzip")
    command.add_argument("--engines", type=int, default=None,
                         help="engines in the fleet (default 8, or P+D of --pd)")
    command.add_argument("--kv-blocks", type=int, default=1000, help="KV blocks per engine, in trace blocks (1000)")
    command.add_argument("--load", type=float, default=0.8,
                         help="arrival rate as a fraction of what the fleet sustains without reuse (0.8)")
    command.add_argument("--speedup", type=float, default=None,
                         help="replay the trace's own timestamps this many times faster, instead of --load")
    command.add_argument("--requests", type=int, default=None, help="replay at most N requests")
    command.add_argument("--skip", type=int, default=0, help="skip the first N requests")
    command.add_argument("--trace-block-size", type=int, default=512, help="tokens per hash id (512)")
    command.add_argument("--event-delay", type=float, default=0.0, help="seconds KV events take to arrive (0)")
    command.add_argument("--engine-speeds", default="", metavar="X[,X...]",
                         help="each engine's speed as a multiple of the model's, cycled over the engines "
                              "(e.g. 1,0.5: every other engine half as fast); the router is not told")
    command.add_argument("--no-prefill-complete", action="store_true",
                         help="clients never call prefill_complete: only frees tell the router a request moved on")
    command.add_argument("--compare", action="extend", nargs="+", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                         help="settings of the service to run, each KEY=VALUE[,KEY=VALUE] (several after one "
                              "flag, or the flag repeated), or `oracle`: the all-knowing router, greedy on the "
                              "fleet's true state; default: the defaults")
    command.add_argument("--service", action="append", default=[], metavar="URL",
                         help="also route through a running selection service over HTTP (ours, or Dynamo "
                              "1.6.1's), its engines publishing ZMQ KV events to it (repeat for several)")
    command.add_argument("--no-baselines", action="store_true", help="skip the random and round-robin runs")
    command.add_argument("--pd", action="extend", nargs="+", default=[], metavar="P:D",
                         help="run fleets of P prefill and D decode engines (P+D = --engines), once per decider, "
                              "beside the same fleet aggregated, all through the core's plans, instead of the "
                              "plain runs and the baselines (docs/PD.md); several after one flag, or the flag "
                              "repeated")
    command.add_argument("--replicas", default=None, metavar="N[,N...]",
                         help="also run each setting as N services behind a round-robin balancer, each with its "
                              "own index and every engine's events: once sharing bookings through a ledger, once "
                              "alone (docs/ROUTING.md, Replicas); 1 is the lone service")
    command.add_argument("--ledger-delay", type=float, default=0.0, metavar="SECS",
                         help="--replicas: seconds a replica's change takes to reach the others through the ledger (0)")
    command.add_argument("--admission", choices=("advisory", "strict"), default="advisory",
                         help="--replicas: how shared replicas book, as serve's --admission: strict holds each "
                              "answer until the ledger confirms no other replica booked the rank meanwhile "
                              "(docs/REPLICATION.md) (advisory)")
    command.add_argument("--deciders", default=None, metavar="NAME[,NAME...]",
                         help=f"the deciders of the --pd runs, of {', '.join(DECIDERS)} (ttft: the faster "
                              f"predicted path, under router_policy=ttft) (default {','.join(DECIDERS[:4])})")
    fleet = FleetConfig()
    command.add_argument("--kv-bytes-per-token", type=int, default=None, metavar="BYTES",
                         help=f"--pd: bytes of KV cache a prompt token takes ({fleet.kv_bytes_per_token}: "
                              "Llama 3.1 8B in bf16)")
    command.add_argument("--link-gbps", type=float, default=None, metavar="GBPS",
                         help="--pd: each prefill engine's link to the decode engines, gigabits a second "
                              f"({fleet.link_bytes_per_sec * 8 / 1e9:g})")
    command.add_argument("--json", metavar="OUT.json", help="write the results as JSON")
    command.add_argument("--report", metavar="OUT.html", help="write a self-contained HTML report")
    command.add_argument("--seed", type=int, default=0, help="seed of the random choices (0)")
    command.add_argument("--mocker-timing", action="store_true",
                         help="time iterations with Dynamo's mocker polynomials exactly (docs/ROUTING.md)")
    defaults = EngineModel()
    for name, kind, text in _MODEL_FLAGS:
        command.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(defaults, name),
                             help=f"{text} ({getattr(defaults, name)})")


def _speeds(text: str) -> tuple[float, ...]:
    """`--engine-speeds`: positive multiples, at most 1,024 of them."""
    if not text:
        return ()
    try:
        speeds = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--engine-speeds: {text[:40]!r} is not a list of numbers") from None
    if len(speeds) > 1024 or not all(1e-3 <= s <= 1e3 for s in speeds):
        raise UsageError("--engine-speeds: at most 1024 numbers, each from 0.001 to 1000")
    return speeds


def _pd_fleets(texts: list[str], engines: int | None) -> tuple[list[int], int]:
    """`--pd P:D ...`: the prefill engines of each fleet, and the fleet's size (each P+D, all alike)."""
    sizes: list[tuple[int, int]] = []
    for text in texts:
        parts = text.split(":")
        if len(parts) != 2 or not all(p.isdigit() and len(p) <= 4 for p in parts):
            raise UsageError(f"--pd: expected P:D, prefill and decode engines (e.g. 2:6), not {text[:40]!r}")
        prefill, decode = int(parts[0]), int(parts[1])
        if prefill < 1 or decode < 1:
            raise UsageError(f"--pd {text}: a disaggregated fleet needs at least 1 prefill and 1 decode engine")
        sizes.append((prefill, decode))
    total = engines if engines is not None else sum(sizes[0])
    for prefill, decode in sizes:
        if prefill + decode != total:
            raise UsageError(f"--pd {prefill}:{decode}: {prefill + decode} engines, not the fleet's {total} "
                             "(the aggregated fleet it is compared with)")
    return [prefill for prefill, _ in sizes], total


def _deciders(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in DECIDERS:
            raise UsageError(f"--deciders: {name[:40]!r} is not one of {', '.join(DECIDERS)}")
    return list(dict.fromkeys(names))


def _replica_counts(text: str) -> list[int]:
    """`--replicas N[,N...]`: each from 1 to 64, in the order given."""
    parts = text.split(",")
    if len(parts) > 16 or not all(p.strip().isdigit() and len(p.strip()) <= 3 for p in parts):
        raise UsageError(f"--replicas: expected counts such as 1,2,4,8, not {text[:40]!r}")
    counts = [int(p) for p in parts]
    if not all(1 <= n <= 64 for n in counts):
        raise UsageError("--replicas: each count from 1 to 64")
    return list(dict.fromkeys(counts))


def _replica_runs(runs: list[tuple[str, Setup]], counts: list[int], delay: float,
                  admission: str = "advisory") -> list[tuple[str, Setup]]:
    """Per core setting: the lone service where 1 is asked, then each count shared and alone."""
    out: list[tuple[str, Setup]] = []
    for text, settings in runs:
        if not isinstance(settings, Settings):
            out.append((text, settings))
            continue
        prefix = "" if text == "default" else text + " "
        for count in counts:
            if count == 1:
                out.append((text, settings))
                continue
            for shared in (True, False):
                strict = " strict" if shared and admission == "strict" else ""
                out.append((f"{prefix}{count} replicas {'shared' if shared else 'alone'}{strict}",
                            ReplicaSetup(settings=settings, replicas=count, shared=shared, ledger_delay_secs=delay,
                                         admission=admission)))
    return out


def _lines(path: str) -> Iterator[bytes]:
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    opener: Any = gzip.open if gzipped else open
    with opener(path, "rb") as lines:
        yield from read_lines(lines)


def _pd_runs(runs: list[tuple[str, Setup]], prefill_engines: list[int],
             deciders: list[str], engines: int) -> list[tuple[str, Setup]]:
    """Per setting: the aggregated fleet (and under router_policy=ttft too when the `ttft` decider
    runs), then each P:D fleet with each decider (`ttft` under router_policy=ttft), all planned
    through the core."""
    out: list[tuple[str, Setup]] = []
    for text, settings in runs:
        assert isinstance(settings, Settings)
        prefix = "" if text == "default" else text + " "
        out.append((prefix + "aggregated", PdSetup(settings=settings)))
        if "ttft" in deciders and settings.router_policy != "ttft":  # its like, to compare the ttft runs with
            out.append((prefix + "aggregated ttft", PdSetup(settings=attrs.evolve(settings, router_policy="ttft"))))
        for prefill in prefill_engines:
            for decider in deciders:
                chosen = attrs.evolve(settings, router_policy="ttft") if decider == "ttft" else settings
                out.append((f"{prefix}{prefill}:{engines - prefill} {decider}",
                            PdSetup(settings=chosen, prefill_engines=prefill, decider=decider)))
    return out


def run(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.trace):
        raise UsageError(f"{args.trace}: no such file")
    prefill_engines, engines = _pd_fleets(args.pd, args.engines) if args.pd else ([], args.engines)
    args.engines = 8 if engines is None else engines
    for name in ("deciders", "kv_bytes_per_token", "link_gbps"):
        if getattr(args, name) is not None and not args.pd:
            raise UsageError(f"--{name.replace('_', '-')}: only with --pd")
    fleet = FleetConfig()
    deciders = _deciders(",".join(DECIDERS[:4]) if args.deciders is None else args.deciders)
    if args.kv_bytes_per_token is None:
        args.kv_bytes_per_token = fleet.kv_bytes_per_token
    if args.link_gbps is None:
        args.link_gbps = fleet.link_bytes_per_sec * 8 / 1e9
    if args.pd and args.service:
        raise UsageError("--pd: runs the core in process; it does not take --service")
    if args.replicas is not None and args.pd:
        raise UsageError("--replicas: runs aggregated fleets only; it does not take --pd")
    if args.ledger_delay != 0.0 and args.replicas is None:
        raise UsageError("--ledger-delay: only with --replicas")
    if args.admission != "advisory" and args.replicas is None:
        raise UsageError("--admission: only with --replicas")
    if not 0 <= args.ledger_delay <= 3600:
        raise UsageError("--ledger-delay: must be a number of seconds from 0 to 3600")
    if args.pd and ORACLE in args.compare:
        raise UsageError("--pd: the oracle routes aggregated fleets only; it does not take --compare oracle")
    if not 1 <= args.kv_bytes_per_token <= 1 << 40:
        raise UsageError("--kv-bytes-per-token: must be from 1 to 1099511627776")
    if not 1e-6 <= args.link_gbps <= 1e6:
        raise UsageError("--link-gbps: must be a number from 0.000001 to 1000000")
    for name, low in (("engines", 1), ("kv_blocks", 1), ("trace_block_size", 1), ("skip", 0), ("max_batched_tokens", 1),
                      ("max_running", 1), ("request_fixed_ms", 0)):
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')}: must be at least {low}")
    if args.requests is not None and args.requests < 1:
        raise UsageError("--requests: must be at least 1")
    # The service under test takes at most 1,024 workers a key and prompts of 2**20 tokens; an
    # engine slower than a token a second outlives every booking (active_request_expiry_secs).
    for name, high in (("engines", 1024), ("trace_block_size", MAX_TOKENS), ("kv_blocks", 1 << 30)):
        if getattr(args, name) > high:
            raise UsageError(f"--{name.replace('_', '-')}: must be at most {high}")
    if not args.prefill_tokens_per_sec >= 1:
        raise UsageError("--prefill-tokens-per-sec: must be at least 1")
    for path in (args.json, args.report):
        if path is not None and os.path.isdir(path):
            raise UsageError(f"{path}: is a folder; name a file to write")
    if args.speedup is not None and not 0 < args.speedup < 1e9:
        raise UsageError("--speedup: must be a positive number")
    for name in ("load", "prefill_tokens_per_sec"):
        if not 0 < getattr(args, name) < float("inf"):
            raise UsageError(f"--{name.replace('_', '-')}: must be a positive number")
    for name in ("event_delay", "prefill_fixed_ms", "attention_ms", "decode_ms", "decode_full_ms"):
        if not 0 <= getattr(args, name) < float("inf"):
            raise UsageError(f"--{name.replace('_', '-')}: must be a number of at least 0")
    speeds = _speeds(args.engine_speeds)
    model = EngineModel(mocker=args.mocker_timing, **{name: getattr(args, name) for name, _, _ in _MODEL_FLAGS})
    config = FleetConfig(engines=args.engines, kv_blocks=args.kv_blocks, trace_block_size=args.trace_block_size,
                         load=args.load, speedup=args.speedup, event_delay_secs=args.event_delay, seed=args.seed, model=model,
                         engine_speeds=speeds, prefill_complete=not args.no_prefill_complete,
                         kv_bytes_per_token=args.kv_bytes_per_token, link_bytes_per_sec=args.link_gbps * 1e9 / 8)
    base = Settings(kv_events="push")
    runs: list[tuple[str, Setup]] = [
        (text, None if text == ORACLE else settings_with(base, text, "--compare")) for text in args.compare]
    if all(text == ORACLE for text in args.compare) and not args.service:  # the defaults, beside the oracle
        runs.insert(0, ("default", base))
    if args.pd:
        runs = _pd_runs(runs, prefill_engines, deciders, args.engines)
    if args.replicas is not None:
        runs = _replica_runs(runs, _replica_counts(args.replicas), args.ledger_delay, args.admission)
    for url in args.service:
        if not url.startswith("http://"):
            raise UsageError(f"--service: expected http://HOST:PORT, not {url!r}")
        runs.append((f"service {url}", url))
    if not args.no_baselines and not args.pd:
        runs += [(name, None) for name in BASELINES]

    def trace() -> Iterator[TraceRequest]:
        return parse_trace(_lines(args.trace), args.trace, args.trace_block_size, skip=args.skip,
                           limit=args.requests, kv_blocks=args.kv_blocks)

    started = time.perf_counter()
    try:
        results = simulate(trace, config, runs)
    except TraceError as exc:
        print(f"selection-proto simulate: error: {exc}", file=sys.stderr)
        return 2
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # a truncated or corrupt gzip file
        print(f"selection-proto simulate: error: {args.trace}: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:  # a service that does not answer, or refuses the fleet
        print(f"selection-proto simulate: error: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    sys.stdout.write(table(results))
    for line in summary(results):
        print(line)
    requests = sum(r.requests for r in results)
    print(f"{len(results)} runs, {requests} requests in {seconds:.1f} s ({requests / max(seconds, 1e-9):.0f} a second)")
    try:
        if args.json:
            with open(args.json, "w") as out:
                json.dump(document(results, config, args.trace), out, indent=1)
        if args.report:
            with open(args.report, "w") as out:
                out.write(html_report(results, config, args.trace))
    except OSError as exc:
        print(f"selection-proto simulate: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0
