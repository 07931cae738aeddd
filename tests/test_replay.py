"""Byte-identical answers across refactors: seeded request scripts through the core's bytes API,
digested whole, compared with digests recorded before (tests/replay_digests.json).

Each script mixes catalog writes (upserts, patches, deletes, bad bodies), JSON and msgpack events
(with gaps and rewinds), pushed streams with `framing=seq`, selections with overrides and
queueing, reservations (and replays of pending selections), prefill completions, output blocks,
frees, ticks, `/loads`, `/overlap_scores`, `/dump`, `/ready` and `/metrics`. Every response, every output event, every stream report and every call
to the injected `random.Random` goes into the digest.

A deliberate change of an answer re-records the digests in the same commit, with the reason:

    .venv/bin/python tests/test_replay.py --record
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import attrs
import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from selection_proto import Pending, SelectionReady, SelectionService, Settings  # noqa: E402
from selection_proto.core.base.errors import StreamError  # noqa: E402
from selection_proto.core.base.outputs import InternalError  # noqa: E402
from selection_proto.core.base.wire import Response  # noqa: E402

DIGESTS = Path(__file__).with_name("replay_digests.json")
SEEDS = range(64)
STEPS = 1000


class SpyRandom(random.Random):
    """Records the sequence of draws, so that a refactor keeps the order of random calls."""

    def __init__(self, seed: int, log: list[str]) -> None:
        self.log = log
        super().__init__(seed)

    def getrandbits(self, k: int) -> int:
        value = super().getrandbits(k)
        self.log.append(f"getrandbits({k})={value}")
        return value

    def random(self) -> float:
        value = super().random()
        self.log.append(f"random()={value!r}")
        return value

    def randrange(self, *args: Any, **kwargs: Any) -> int:
        value = super().randrange(*args, **kwargs)
        self.log.append(f"randrange{args}={value}")
        return value


def _settings(seed: int) -> Settings:
    kind = seed % 4
    if kind == 0:
        return Settings(kv_events="push")
    if kind == 1:
        return Settings(kv_events="push", queue_threshold=0.5, queue_policy=("fcfs", "lcfs", "wspt")[seed % 3],
                        queue_max_pending=8, queue_timeout_secs=3.0, temperature=0.5)
    if kind == 2:
        return Settings(kv_events="subscribe", track_active_blocks=seed % 3 != 0, assume_kv_reuse=seed % 5 != 0,
                        overlap_score_credit=0.7, decode_active_request_weight=0.3)
    return Settings(kv_events="push", active_request_expiry_secs=2.0, max_reservations_per_key=6,
                    active_decode_blocks_threshold=4.0, host_cache_hit_weight=0.5)


def _engine_batch(rng: random.Random, block_size: int, prompts: list[list[int]]) -> bytes:
    """Stores of prompt prefixes (so that selections find them), removes and clears."""
    events = []
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.6:
            n = rng.randint(1, 4)
            hashes = [rng.randint(1, 40) for _ in range(n)]
            tokens = rng.choice(prompts)[:n * block_size]
            n = len(tokens) // block_size
            hashes, tokens = hashes[:n], tokens[:n * block_size]
            parent = None if rng.random() < 0.7 else rng.randint(1, 40)
            medium = rng.choice([None, "GPU", "CPU_PINNED", "DISK"])
            events.append(["BlockStored", hashes, parent, tokens, block_size, None, medium])
        elif roll < 0.9:
            events.append(["BlockRemoved", [rng.randint(1, 40) for _ in range(rng.randint(1, 3))],
                           rng.choice([None, "GPU", "CPU_PINNED"])])
        else:
            events.append(["AllBlocksCleared"])
    return bytes(msgpack.packb([rng.random() * 100, events, rng.choice([None, 0, 1])]))


def _json_events(rng: random.Random, wid: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(rng.randint(1, 3)):
        event_id = rng.randint(1, 30)
        roll = rng.random()
        if roll < 0.6:
            blocks = [{"block_hash": rng.randint(1, 40), "tokens_hash": rng.randint(1, 40)}
                      for _ in range(rng.randint(1, 4))]
            data: Any = {"stored": {"parent_hash": rng.choice([None, rng.randint(1, 40)]), "blocks": blocks}}
        elif roll < 0.9:
            data = {"removed": {"block_hashes": [rng.randint(1, 40) for _ in range(rng.randint(1, 3))]}}
        else:
            data = "cleared"
        event: dict[str, Any] = {"worker_id": wid, "event": {"event_id": event_id, "dp_rank": rng.choice([0, 0, 1]),
                                                             "data": data}}
        if rng.random() < 0.3:
            event["storage_tier"] = rng.choice(["device", "host_pinned", "disk"])
        out.append(event)
    return out


def canonical(value: Any) -> Any:
    """What a client can observe of a value, independent of internal class names."""
    if isinstance(value, Response):
        return ("response", value.status, value.headers, value.body)
    if isinstance(value, Pending):
        return ("pending", value.ticket)
    if isinstance(value, SelectionReady):
        return ("ready", value.ticket, canonical(value.response))
    if isinstance(value, InternalError):
        return ("internal", value.where)  # its traceback names files and lines
    if hasattr(value, "to_json"):
        return value.to_json()
    if attrs.has(type(value)):
        return (type(value).__name__, attrs.asdict(value))
    return value


def script_digest(seed: int) -> str:
    """Run one seeded script; the SHA-256 of everything it observed."""
    rng = random.Random(seed)
    draws: list[str] = []
    service = SelectionService(_settings(seed), SpyRandom(seed, draws))
    digest = hashlib.sha256()
    now = 10.0
    streams: dict[int, int] = {}
    bookings: list[str] = []
    selected: list[tuple[str, str]] = []  # (model, selection id) of plain selects
    prompts = [[rng.randint(0, 7) for _ in range(16)] for _ in range(4)]

    def note(*parts: Any) -> None:
        digest.update(repr(tuple(canonical(p) for p in parts)).encode())

    def call(method: str, path: str, body: Any = None, query: str = "", raw: bytes | None = None,
             content_type: str = "application/json") -> Any:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        result = service.handle(method, path, query, [("content-type", content_type)], data, now=now)
        note(method, path, query, result)
        while (out := service.next_output()) is not None:
            note("output", out)
        return result

    for step in range(STEPS):
        now += rng.choice([0.0, 0.01, 0.1, 0.5, 1.5])
        roll = rng.random()
        wid = rng.randint(1, 5)
        model = rng.choice(["m", "m", "n"])
        if roll < 0.12:
            worker: dict[str, Any] = {"worker_id": wid, "model_name": model, "endpoint": f"http://w{wid}",
                                      "block_size": rng.choice([2, 4]), "data_parallel_size": rng.choice([1, 2])}
            if rng.random() < 0.5:
                worker["kv_events_endpoint"] = f"tcp://e{wid}:{5000 + rng.randint(0, 2)}"
            if seed % 4 == 1 or rng.random() < 0.3:  # queueing needs it for a worker to be schedulable
                worker["max_num_batched_tokens"] = rng.choice([8, 64])
            if rng.random() < 0.2:
                worker["taints"] = [rng.choice(["a", "b"])]
            call("POST", "/workers", worker)
        elif roll < 0.15:
            call("PATCH", f"/workers/{wid}", {"data_parallel_size": rng.choice([1, 2]),
                                               "taints": [rng.choice(["a", "b"])]})
        elif roll < 0.17:
            call("DELETE", f"/workers/{wid}")
        elif roll < 0.30:
            call("POST", "/kv_events", _json_events(rng, wid), query=f"model_name={model}" if rng.random() < 0.2 else "")
        elif roll < 0.38:
            call("POST", "/kv_events", query=f"worker_id={wid}&dp_rank={rng.choice([0, 1])}",
                 raw=_engine_batch(rng, rng.choice([2, 4]), prompts), content_type="application/msgpack")
        elif roll < 0.44:
            if wid not in streams:
                try:
                    streams[wid] = service.open_event_stream(wid, rng.choice([0, 1]), now=now)
                except Exception as exc:  # noqa: BLE001 - its message is part of the digest
                    note("open", wid, type(exc).__name__, str(exc))
                    continue
            seq = rng.choice([None, step, step + rng.randint(1, 3), max(0, step - 5)])
            try:
                report = service.stream_message(streams[wid], _engine_batch(rng, 4, prompts) if rng.random() < 0.6 else
                                                json.dumps([e["event"] for e in _json_events(rng, wid)]),
                                                seq=seq, now=now)
                note("stream", wid, seq, report)
            except StreamError as exc:
                note("stream", wid, exc.code, exc.reason)
                service.close_event_stream(streams.pop(wid), now=now)
        elif roll < 0.47 and streams:
            gone = rng.choice(sorted(streams))
            service.close_event_stream(streams.pop(gone), now=now)
            note("closed", gone)
        elif roll < 0.62:
            tokens = rng.choice(prompts)[:rng.randint(1, 16)] + [rng.randint(0, 7) for _ in range(rng.randint(0, 8))]
            body: dict[str, Any] = {"model_name": model, "token_ids": tokens}
            if rng.random() < 0.3:
                body["router_config_override"] = {"overlap_score_weight": rng.choice([0.0, 0.5, 2.0]),
                                                  "router_temperature": rng.choice([0.0, 1.0])}
            if rng.random() < 0.2:
                body["allowed_worker_ids"] = sorted({rng.randint(1, 5) for _ in range(2)})
            if rng.random() < 0.1:
                body["pinned_worker"] = {"worker_id": wid, "dp_rank": 0}
            if rng.random() < 0.2:
                body["explain"] = True
            if rng.random() < 0.5:
                rid = f"r{step}"
                body["reservation_id"] = rid
                body["expected_output_tokens"] = rng.choice([None, 8])
                result = call("POST", "/select_and_reserve", body)
                if getattr(result, "status", None) == 200:
                    bookings.append(rid)
            else:
                body["selection_id"] = f"s{step}"  # a pending selection, booked later or not
                call("POST", "/select", body)
                selected.append((model, f"s{step}"))
        elif roll < 0.66:
            if selected and rng.random() < 0.5:  # 1.6.1's replay form of a pending selection
                model, rid = selected.pop(rng.randrange(len(selected)))
                result = call("POST", "/reservations", {"model_name": model, "selection_id": rid})
            else:
                rid = f"x{step}"
                result = call("POST", "/reservations", {"model_name": model, "reservation_id": rid,
                                                        "worker_id": wid,
                                                        "token_ids": [rng.randint(0, 7) for _ in range(8)]})
            if getattr(result, "status", None) == 201:
                bookings.append(rid)
        elif roll < 0.72 and bookings:
            rid = bookings[rng.randrange(len(bookings))]
            if rng.random() < 0.5:
                call("POST", f"/reservations/{rid}/prefill_complete")
            else:
                call("POST", f"/reservations/{rid}/output_block",
                     {"decay_fraction": rng.choice([None, 0.0, 0.5, 1.0])})
        elif roll < 0.80 and bookings:
            rid = bookings.pop(rng.randrange(len(bookings)))
            call("DELETE", f"/reservations/{rid}")
        elif roll < 0.84:
            service.tick(now)
            note("tick", now)
            while (out := service.next_output()) is not None:
                note("output", out)
        elif roll < 0.88:
            call("GET", "/loads")
        elif roll < 0.91:
            call("POST", "/overlap_scores", {"model_name": model, "token_ids": [rng.randint(0, 7) for _ in range(8)]})
        elif roll < 0.93:
            call("POST", "/potential_loads", {"model_name": model, "token_ids": [rng.randint(0, 7) for _ in range(8)]})
        elif roll < 0.95:
            call("GET", "/ready")
        elif roll < 0.97:
            call("POST", rng.choice(["/workers", "/select", "/kv_events"]),
                 raw=rng.choice([b"{", b"[]", b'{"worker_id": -1}', b'{"token_ids": [1, true]}']))
        else:
            call("GET", "/workers", query=rng.choice(["", "model_name=m", "model_name=n&tenant_id=default"]))
    call("GET", "/dump")
    call("GET", "/metrics")
    note("draws", draws)
    return digest.hexdigest()


def recorded() -> dict[str, str]:
    if not DIGESTS.is_file():
        pytest.fail(f"{DIGESTS} is missing: record it with `python tests/test_replay.py --record`")
    data: dict[str, str] = json.loads(DIGESTS.read_text())
    return data


@pytest.mark.parametrize("seed", SEEDS)
def test_answers_are_byte_identical_to_the_recording(seed: int) -> None:
    assert script_digest(seed) == recorded()[str(seed)]


def test_a_changed_answer_changes_the_digest() -> None:
    """The harness can fail: a different seed (another script) gives another digest."""
    assert script_digest(1) != script_digest(2)
    assert script_digest(3) == script_digest(3)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    DIGESTS.write_text(json.dumps({str(s): script_digest(s) for s in SEEDS}, indent=1) + "\n")
    print(f"recorded {len(SEEDS)} digests in {DIGESTS}")
