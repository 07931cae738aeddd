"""The all-knowing router of `simulate --compare oracle` (sim/oracle.py): its prediction against a
hand computation on two engines, against what the engine then does, and against round robin on a
trace whose best answer is known."""

from __future__ import annotations

import json
import random

from selection_proto.core.cache.events import KvEvent
from selection_proto.sim import FleetConfig, parse_trace, simulate
from selection_proto.sim.engine import Engine, EngineModel, SimRequest, block_hash
from selection_proto.sim.oracle import fastest, first_token_at
from selection_proto.sim.trace import TraceRequest

# One millisecond a token, nothing else: iterations are easy to add up by hand.
PLAIN = EngineModel(prefill_fixed_ms=0.0, prefill_tokens_per_sec=1000.0, attention_ms=0.0, decode_ms=0.0,
                    decode_full_ms=0.0, max_batched_tokens=8)
CONFIG = FleetConfig(engines=2, kv_blocks=64, trace_block_size=4, model=PLAIN)


def request(rid: str, hash_ids: list[int], output: int = 3, at: float = 0.0) -> SimRequest:
    trace = TraceRequest(at, 4 * len(hash_ids), output, tuple(hash_ids))
    return SimRequest(rid, at, trace, 4, [block_hash(h) for h in hash_ids])


def run_until_first_token(engine: Engine, req: SimRequest, now: float) -> float:
    """What the fleet does: the request joins the engine's queue, and iterations run."""
    engine.waiting.append(req)
    at = engine.busy_until if engine.busy_until is not None else engine.start(now)
    while req.first_token < 0:
        assert at is not None
        engine.finish(at)
        at = engine.start(at)
    return req.first_token


def two_engines(ahead_tokens: int) -> list[Engine]:
    """Engine 0 holds blocks 1-3 (an earlier request's, finished) and has just started a request
    of `ahead_tokens` new tokens; engine 1 is idle and holds nothing."""
    events: list[KvEvent] = []
    engines = [Engine(i, CONFIG, lambda _, e: events.append(e)) for i in range(2)]
    run_until_first_token(engines[0], request("earlier", [1, 2, 3], output=1), 0.0)
    assert engines[0].busy_until is None  # it finished with its first token
    ahead = request("ahead", list(range(100, 100 + ahead_tokens // 4)))
    assert engines[0].start(1.0) is None
    engines[0].waiting.append(ahead)
    engines[0].start(1.0)
    return engines


def test_the_choice_is_the_hand_computed_one_on_two_engines() -> None:
    # The request: blocks 1-4, 16 tokens. On engine 1 (idle, nothing cached): two iterations of
    # 8 tokens, 16 ms. On engine 0 the 12 cached tokens are free, 4 are left, but it first
    # finishes the request ahead: 8 tokens (8 ms, then its 4: 12 ms) or 40 (five iterations,
    # then its 4: 44 ms).
    for ahead_tokens, expected_ms, chosen in ((8, 12.0, 0), (40, 44.0, 1)):
        engines = two_engines(ahead_tokens)
        probe = request("r", [1, 2, 3, 4], at=1.0)
        times = [first_token_at(e, probe, 1.0) for e in engines]
        assert [round((t - 1.0) * 1000, 6) for t in times] == [expected_ms, 16.0]
        assert fastest(engines, probe, 1.0, random.Random(0)) == chosen
        # Nothing moved: the forks ran ahead, the engines did not.
        assert engines[0].busy_until == 1.008  # the first 8 tokens of the request ahead
        assert probe.first_token == -1.0 and not engines[1].waiting
        # And the engine, left alone, gives the first token at the time predicted.
        assert run_until_first_token(engines[chosen], probe, 1.0) == min(times)


def test_the_prediction_is_what_the_engine_does_when_nothing_else_comes() -> None:
    """A busy engine (decoding requests, a queue, a full cache that must evict): the fork's time is
    the engine's own, to the bit, and neither the engine nor its requests were touched."""
    config = FleetConfig(engines=1, kv_blocks=20, trace_block_size=4, model=EngineModel(max_batched_tokens=8))
    engine = Engine(0, config, lambda _, e: None)
    for i in range(6):
        engine.waiting.append(request(f"q{i}", [i, 50 + i, 60 + i], output=5 + i))
    engine.start(0.0)
    for _ in range(3):
        assert engine.busy_until is not None
        engine.finish(engine.busy_until)
        engine.start(engine.busy_until)
    now = engine.busy_until - 1e-4 if engine.busy_until is not None else 0.0
    before = (dict(engine.active), list(engine.inactive), engine.private, len(engine.waiting),
              [(r.left, r.context, list(r.blocks_held)) for r in engine.prefilling],
              [(i, r.private, list(r.blocks_held)) for i, _, r in engine.decoding])
    probe = request("probe", [0, 50, 7, 8])
    predicted = first_token_at(engine, probe, now)
    after = (dict(engine.active), list(engine.inactive), engine.private, len(engine.waiting),
             [(r.left, r.context, list(r.blocks_held)) for r in engine.prefilling],
             [(i, r.private, list(r.blocks_held)) for i, _, r in engine.decoding])
    assert after == before
    assert run_until_first_token(engine, probe, now) == predicted


def _lines(count: int) -> list[bytes]:
    """`count` requests 2 s apart (each long done before the next), each 6 shared blocks then 2
    of its own: the best answer is to keep every one on the engine holding the 6."""
    return [json.dumps({"timestamp": 2000 * i, "input_length": 8 * 512, "output_length": 10,
                        "hash_ids": [1, 2, 3, 4, 5, 6, 1000 + 2 * i, 1001 + 2 * i]}).encode() for i in range(count)]


def test_never_worse_than_round_robin_where_the_answer_is_known() -> None:
    config = FleetConfig(engines=4, kv_blocks=200, speedup=1.0)
    oracle, round_robin = simulate(lambda: parse_trace(_lines(40), "shared", 512), config,
                                   [("oracle", None), ("round-robin", None)])
    # After the first, every request finds the 6 shared blocks: 39 x 6 of 40 x 8 blocks (the
    # last token of a prompt is always computed, and none is the last here).
    assert oracle.hit_rate == 39 * 6 / (40 * 8)
    assert round_robin.hit_rate == 36 * 6 / (40 * 8)  # each of the 4 engines misses them once
    assert oracle.ttft["mean"] < round_robin.ttft["mean"] and oracle.ttft["p99"] <= round_robin.ttft["p99"]
    assert oracle.failed == round_robin.failed == 0 and oracle.requests == 40
