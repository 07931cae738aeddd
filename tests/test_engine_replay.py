"""Engine replay (docs/DECISIONS.md) with a real ZMQ engine stand-in: a PUB socket and a ROUTER replay socket
framed as vLLM frames them, against a real `serve --kv-events subscribe`. Batches published before
the subscription, batches lost on the wire, and batches the engine no longer has."""

from __future__ import annotations

import collections
import re
import threading
import time
from typing import Any

import msgpack
import zmq

from tests.interop.test_services import Http, free_port
from tests.test_http import Server

END = (-1).to_bytes(8, "big", signed=True)


class Engine:
    """An engine's event publisher: live batches on PUB, the last `keep` again on request."""

    def __init__(self, keep: int = 10_000) -> None:
        context = zmq.Context.instance()
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(self.endpoint)
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(self.replay_endpoint)
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=keep)
        self.lock = threading.Lock()
        self.requests: list[int] = []
        self.lose: set[int] = set()  # batches the next replay loses on the wire (as a full ROUTER does)
        self.running = True
        threading.Thread(target=self._serve_replays, daemon=True).start()

    def _serve_replays(self) -> None:
        while self.running:
            if not self.router.poll(50):
                continue
            identity, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            with self.lock:
                lost, self.lose = self.lose, set()
                for seq, payload in list(self.buffer):
                    if seq >= first and seq not in lost:
                        self.router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([identity, b"", END, b""])

    def publish(self, seq: int, send: bool = True, clear: bool = False) -> None:
        """Batch `seq`: one block stored (hash 1000 + seq), or with `clear` the engine's cache reset."""
        events = [["AllBlocksCleared"]] if clear else [
            ["BlockStored", [1000 + seq], None, list(range(4 * seq, 4 * seq + 4)), 4, None, "GPU", None, None]]
        payload = msgpack.packb([time.time(), events, 0])
        with self.lock:
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        self.running = False
        time.sleep(0.1)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def metric(port: int, line_start: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    match = re.search("^" + re.escape(line_start) + r" ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def freshness(service: Http) -> Any:
    body = {"model_name": "m", "token_ids": [0, 1, 2, 3]}
    return service.call("POST", "/overlap_scores", body)[1]["freshness"][0]


def until(check: Any, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


BLOCKS = 'selection_proto_index_blocks{model_name="m",tenant_id="default",tier="device"}'


def test_replay_recovers_what_was_published_before_and_lost_between() -> None:
    engine = Engine()
    server = Server(mode="subscribe")
    try:
        service = Http(server.port, "tenant_id")
        for seq in range(3):
            engine.publish(seq, send=False)  # before anyone subscribed
        assert service.call("POST", "/workers", {
            "worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4,
            "kv_events_endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint})[0] == 201

        def publish_until_applied(seq: int) -> None:
            deadline = time.monotonic() + 20
            while metric(server.port, BLOCKS) < seq + 1:
                assert time.monotonic() < deadline, "the batches were not applied"
                engine.pub.send_multipart([b"", seq.to_bytes(8, "big"), engine.buffer[-1][1]])
                time.sleep(0.1)

        engine.publish(3, send=False)
        publish_until_applied(3)  # the first batch seen is 3: 0-2 come from the replay
        assert engine.requests[0] == 0
        engine.publish(4, send=False)  # lost on the wire
        engine.publish(5, send=False)
        publish_until_applied(5)
        assert engine.requests[-1] == 4
        fresh = freshness(service)
        assert fresh["stale"] is False and fresh["event_gaps"] == 0
        assert metric(server.port, 'selection_proto_kv_replay_total{result="recovered"}') >= 5
        assert metric(server.port, 'selection_proto_kv_replay_total{result="unrecovered"}') == 0
    finally:
        server.stop()
        engine.close()


def test_batches_the_engine_no_longer_has_are_a_counted_gap_and_a_stale_rank() -> None:
    engine = Engine(keep=3)
    server = Server(mode="subscribe")
    try:
        service = Http(server.port, "tenant_id")
        assert service.call("POST", "/workers", {
            "worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4,
            "kv_events_endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint})[0] == 201
        deadline = time.monotonic() + 20
        engine.publish(0, send=False)
        while metric(server.port, BLOCKS) < 1:  # the slow joiner: resend 0 until it lands
            assert time.monotonic() < deadline
            engine.pub.send_multipart([b"", (0).to_bytes(8, "big"), engine.buffer[-1][1]])
            time.sleep(0.1)
        for seq in range(1, 5):
            engine.publish(seq, send=False)  # four lost on the wire
        engine.publish(5)  # the engine keeps 3-5 only: 1 and 2 are gone
        until(lambda: metric(server.port, BLOCKS) >= 4)
        fresh = freshness(service)
        assert fresh["stale"] is True and fresh["event_gaps"] == 1 and fresh["missing_events"] == 2
        assert metric(server.port, 'selection_proto_kv_replay_total{result="unrecovered"}') == 2
        assert metric(server.port, BLOCKS) == 4
    finally:
        server.stop()
        engine.close()


def subscribe_late(engine: Engine, server: Server, last: int, blocks: int) -> Http:
    """Register the worker once the engine has published up to `last` - 1 unseen, then publish
    `last` live until the index holds `blocks` (the replay from 0 comes first)."""
    service = Http(server.port, "tenant_id")
    assert service.call("POST", "/workers", {
        "worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4,
        "kv_events_endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint})[0] == 201
    engine.publish(last, send=False)
    deadline = time.monotonic() + 60
    while (held := metric(server.port, BLOCKS)) != blocks:  # the slow joiner: resend until it lands
        assert time.monotonic() < deadline, f"the index holds {held} blocks, not {blocks}"
        engine.pub.send_multipart([b"", last.to_bytes(8, "big"), engine.buffer[-1][1]])
        time.sleep(0.2)
    return service


def test_a_new_subscription_gets_all_of_a_long_history_and_health_answers_meanwhile() -> None:
    """vLLM keeps its last 10,000 batches and sends them all at once to a replay request, dropping
    what the requester's socket does not take: none may be lost. Applying them is sliced, so that
    `/health` answers meanwhile."""
    import http.client
    import threading

    batches = 10_000
    engine = Engine(keep=batches + 1)
    for seq in range(batches):
        engine.publish(seq, send=False)
    server = Server(mode="subscribe")
    worst = [0.0]
    probing = threading.Event()

    def probe() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        while not probing.is_set():
            started = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            worst[0] = max(worst[0], time.perf_counter() - started)
            time.sleep(0.005)

    try:
        prober = threading.Thread(target=probe)
        prober.start()
        service = subscribe_late(engine, server, batches, batches + 1)
        probing.set()
        prober.join()
        assert metric(server.port, 'selection_proto_kv_replay_total{result="unrecovered"}') == 0
        assert metric(server.port, 'selection_proto_kv_replay_total{result="recovered"}') == batches + 1
        assert freshness(service)["stale"] is False
        # Applied whole it held the loop 1.6-7 s here; sliced, /health is never held for long.
        assert worst[0] < 1.0, f"/health took {worst[0]:.2f} s during the replay"
    finally:
        probing.set()
        server.stop()
        engine.close()


def test_batches_a_replay_lost_on_the_wire_are_asked_for_again() -> None:
    engine = Engine()
    for seq in range(10):
        engine.publish(seq, send=False)
    engine.lose = {3, 7}
    server = Server(mode="subscribe")
    try:
        service = subscribe_late(engine, server, 10, 11)
        assert engine.requests == [0, 3]  # from the first hole on
        assert metric(server.port, 'selection_proto_kv_replay_total{result="unrecovered"}') == 0
        fresh = freshness(service)
        assert fresh["stale"] is False and fresh["event_gaps"] == 0
    finally:
        server.stop()
        engine.close()


def test_replay_holes_are_what_the_wire_lost_not_what_the_engine_evicted() -> None:
    from selection_proto.adapters.replay import replay_holes

    assert replay_holes([3, 4, 5], ended=True) is None  # 0-2 evicted: asking again brings nothing
    assert replay_holes([0, 1, 3, 4, 7], ended=True) == 2
    assert replay_holes([0, 1, 2], ended=False) == 3  # the end marker lost: maybe more after 2
    assert replay_holes([], ended=False) is None  # an engine that does not answer is not asked again


def test_a_new_subscription_replays_from_the_engines_newest_clear() -> None:
    """What precedes an engine's newest `AllBlocksCleared` changes nothing the index will hold: a
    new subscription passes it over (counted), and applies the clear and what follows."""
    engine = Engine()
    for seq in range(100):
        engine.publish(seq, send=False, clear=seq in (20, 60))
    server = Server(mode="subscribe")
    try:
        service = subscribe_late(engine, server, 100, 40)  # 61-100
        assert metric(server.port, 'selection_proto_kv_replay_total{result="passed_over"}') == 60
        assert metric(server.port, 'selection_proto_kv_replay_total{result="recovered"}') == 41  # 60-100
        assert metric(server.port, 'selection_proto_kv_replay_total{result="unrecovered"}') == 0
        verdict = service.call("GET", "/workers/1")[1]["kv_routing"]
        assert verdict["events_total"] == 41 and verdict["state"] == "ok"
        fresh = freshness(service)
        assert fresh["stale"] is False and fresh["event_gaps"] == 0
        # A gap later in the stream is filled batch for batch, a clear inside it included: the
        # core counts what it applies, and nothing is passed over.
        engine.publish(101, send=False)
        engine.publish(102, send=False, clear=True)
        engine.publish(103)
        until(lambda: metric(server.port, BLOCKS) == 1)
        assert metric(server.port, 'selection_proto_kv_replay_total{result="passed_over"}') == 60
        assert metric(server.port, 'selection_proto_kv_replay_total{result="recovered"}') == 44
        assert freshness(service)["event_gaps"] == 0
    finally:
        server.stop()
        engine.close()


def test_the_relay_resumes_where_the_service_stands() -> None:
    """`relay --replay`: batches published before the relay started, and while it was stopped,
    reach the index once each, in order (the service says its last seq; the engine replays)."""
    import signal
    import subprocess
    import sys

    engine = Engine()
    server = Server()  # kv_events=push
    service = Http(server.port, "tenant_id")

    def start_relay() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "selection_proto", "relay", "--zmq", engine.endpoint, "--replay",
             engine.replay_endpoint, "--to", f"ws://127.0.0.1:{server.port}/kv_events", "--worker-id", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop(relay: subprocess.Popen[str]) -> dict[str, Any]:
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(timeout=15) == 0
        assert relay.stderr is not None
        import json

        return [json.loads(line) for line in relay.stderr.read().splitlines()
                if '"relay_stopped"' in line][-1]

    try:
        assert service.call("POST", "/workers", {"worker_id": 1, "model_name": "m", "endpoint": "http://w1",
                                                 "block_size": 4})[0] == 201
        for seq in range(3):
            engine.publish(seq)  # nobody listens yet
        relay = start_relay()
        until(lambda: metric(server.port, BLOCKS) >= 3)
        first = stop(relay)
        assert first["replayed"] == 3
        for seq in range(3, 5):
            engine.publish(seq)  # the relay is down
        relay = start_relay()
        until(lambda: metric(server.port, BLOCKS) >= 5)
        engine.publish(5)
        until(lambda: metric(server.port, BLOCKS) >= 6)
        second = stop(relay)
        assert second["replayed"] == 2  # 3 and 4: what the service had is not sent again
        fresh = freshness(service)
        assert fresh["stale"] is False and fresh["event_gaps"] == 0 and fresh["rewinds"] == 0
    finally:
        server.stop()
        engine.close()


def test_passing_over_what_precedes_the_newest_clear_changes_nothing_the_index_holds() -> None:
    """For any history of stores, removals and clears replayed to a new subscription: the blocks
    held after what `SeqOrder` hands on equal the blocks held after the whole history, and
    nothing after the newest clear is passed over."""
    from hypothesis import given
    from hypothesis import strategies as st

    from selection_proto.adapters.replay import SeqOrder

    event = st.one_of(st.tuples(st.just("store"), st.integers(0, 20)),
                      st.tuples(st.just("remove"), st.integers(0, 20)), st.just(("clear", 0)))

    def payload(events: list[tuple[str, int]]) -> bytes:
        wire = [["AllBlocksCleared"] if kind == "clear" else
                ["BlockStored", [h], None, [1, 2, 3, 4], 4, None, "GPU", None, None] if kind == "store" else
                ["BlockRemoved", [h], "GPU"] for kind, h in events]
        return msgpack.packb([0.0, wire, 0])

    def held(history: list[list[tuple[str, int]]]) -> set[int]:
        blocks: set[int] = set()
        for batch in history:
            for kind, h in batch:
                if kind == "clear":
                    blocks.clear()
                elif kind == "store":
                    blocks.add(h)
                else:
                    blocks.discard(h)
        return blocks

    @given(st.lists(st.lists(event, max_size=4), min_size=2, max_size=30))  # the live one is past 0
    def check(history: list[list[tuple[str, int]]]) -> None:
        order = SeqOrder()
        last = len(history) - 1
        order.live(last, payload(history[last]))
        assert order.want == 0
        order.replay([(seq, payload(batch)) for seq, batch in enumerate(history)])
        order.replay_done()
        handed = order.ready()
        by_seq = dict(enumerate(history))
        assert held([by_seq[seq] for seq, _ in handed]) == held(history)
        cleared = [seq for seq, batch in enumerate(history) if ("clear", 0) in batch]
        assert [seq for seq, _ in handed] == list(range(cleared[-1] if cleared else 0, len(history)))
        assert order.passed_over == (cleared[-1] if cleared else 0) and order.unrecovered == 0

    check()
