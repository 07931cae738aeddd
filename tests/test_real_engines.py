"""Real vLLM engines in the loop: three engines on the CPU serving a tiny model built here,
our `serve` subscribed to their ZMQ KV events, and every scenario checked against what the engine
itself reports (`usage.prompt_tokens_details.cached_tokens`). docs/REAL_ENGINES.md says what they
need; they fail, never skip, without it.

Engine a replays (a ZMQ ROUTER) and is started with docs/GATEWAY.md's recipe as written, b does
not replay, c runs with prefix caching off. The tests run in file
order over the same engines (starting one costs ~45 s); each uses token ranges of its own."""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engines.vllm import VllmEngine, recipe_args, recipe_blocks, render_recipe
from test_http import Server, api_call

BLOCK = 32
WINDOW = 3.0  # --kv-verdict-window-secs of the service under test


class Fleet:
    def __init__(self, folder: Path, model: Path) -> None:
        self.model = model
        self.a = VllmEngine(self.model, folder, "a", core=0, replay=True, recipe=True)
        self.b = VllmEngine(self.model, folder, "b", core=1, replay=False)
        self.c = VllmEngine(self.model, folder, "c", core=1, prefix_caching=False)
        self.engines = [self.a, self.b, self.c]
        try:
            for engine in self.engines:
                engine.start()
            for engine in self.engines:
                engine.healthy_or_retried()
            self.server = Server("--kv-verdict-window-secs", str(WINDOW), "--engine-metrics-interval-secs", "0.5",
                                 mode="subscribe")
            for worker_id, engine in ((1, self.a), (2, self.b)):
                record = engine.worker(worker_id, metrics_endpoint=engine.url + "/metrics")
                assert self.api("POST", "/workers", record)[0] == 201
            self.by_worker = {1: self.a, 2: self.b}
            self.wait_subscribed(1, 2)
        except BaseException:  # no engine outlives a failed start
            self.stop()
            raise

    def wait_subscribed(self, *worker_ids: int, model: str = "tiny", port: int | None = None) -> None:
        """Until the service's subscriptions to these workers' engines are connected: an engine
        sends a subscriber only what it publishes after the handshake."""
        def connected() -> bool:
            rows = self.ok("POST", "/overlap_scores", {"model_name": model, "token_ids": [1]}, port)["freshness"]
            return all(any(r["worker_id"] == w and r["open_streams"] for r in rows) for w in worker_ids)

        until(connected, f"subscriptions to {worker_ids}")

    def api(self, method: str, path: str, body: Any = None, port: int | None = None) -> tuple[int, Any]:
        try:
            return api_call(port or self.server.port, method, path, body)
        except ConnectionRefusedError:  # the service is gone: say how it ended
            raise AssertionError(f"serve exited ({self.server.proc.poll()}):\n" + "".join(self.server.logs[-20:])) from None

    def ok(self, method: str, path: str, body: Any = None, port: int | None = None) -> Any:
        status, answer = self.api(method, path, body, port)
        assert 200 <= status < 300, (status, answer)
        return answer

    def ok_text(self, path: str, port: int | None = None) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port or self.server.port, timeout=30)
        conn.request("GET", path)
        text = conn.getresponse().read().decode()
        conn.close()
        return text

    def verdict(self, worker_id: int, port: int | None = None) -> dict[str, Any]:
        return self.ok("GET", f"/workers/{worker_id}", port=port)["kv_routing"]  # type: ignore[no-any-return]

    def held(self, worker_id: int, prompt: list[int], model: str = "tiny", port: int | None = None) -> int:
        """Prompt blocks the index places on the worker's device."""
        rows = self.ok("POST", "/overlap_scores", {"model_name": model, "token_ids": prompt}, port)["workers"]
        return next((r["device_blocks"] for r in rows if r["worker_id"] == worker_id), 0)

    def stop(self) -> None:
        if hasattr(self, "server"):
            self.server.stop()
        for engine in self.engines:
            engine.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("engines"), tiny_model)
    yield fleet
    fleet.stop()


def until(check: Callable[[], bool], what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def tokens(start: int, n: int) -> list[int]:
    """`n` token ids of a sequence of the caller's own (`start` names it; the vocabulary has 1,024)."""
    rng = random.Random(start)
    return [rng.randrange(2, 1024) for _ in range(n)]


def run_booked(fleet: Fleet, prompt: list[int], rid: str) -> tuple[int, int, int]:
    """Select and book through the service, run on the chosen engine, report back as a client
    would; (worker, predicted cached tokens, the engine's own count)."""
    selected = fleet.ok("POST", "/select_and_reserve", {"model_name": "tiny", "token_ids": prompt,
                                                        "reservation_id": rid})
    engine = fleet.by_worker[selected["worker_id"]]
    found = engine.complete(prompt)
    fleet.ok("POST", f"/reservations/{rid}/prefill_complete", {"cached_tokens": found})
    fleet.ok("DELETE", f"/reservations/{rid}")
    # The engine publishes the prompt's full blocks with the step that computed them.
    until(lambda: fleet.held(selected["worker_id"], prompt) == len(prompt) // BLOCK, "the stored event")
    return selected["worker_id"], selected["cached_tokens"], found


def test_token_prompts_are_predicted_as_the_engine_finds_them_and_routed_to_their_cache(fleet: Fleet) -> None:
    shared = tokens(0, 192)  # six blocks
    runs = [run_booked(fleet, shared[:n] + tokens(500 + n, 40), f"tok-{n}") for n in (96, 160, 192, 64)]
    assert [(predicted, found) for _, predicted, found in runs] == [(0, 0), (96, 96), (160, 160), (64, 64)]
    holder = runs[0][0]
    assert all(worker == holder for worker, _, _ in runs)  # the prefix went where it was cached
    verdict = fleet.verdict(holder)
    assert verdict["state"] == "ok" and verdict["reasons"] == []
    assert verdict["observations"] == 4 and verdict["engine_block_size"] == BLOCK
    assert verdict["predicted_cached_tokens"] == verdict["observed_cached_tokens"] == 320
    assert verdict["events_total"] >= 4 and verdict["last_event_age_secs"] < 60

    def engine() -> dict[str, Any]:  # what the engine's own /metrics says, as /loads shows it
        engines = fleet.ok("GET", "/loads")[0].get("engines", [])
        return next((e for e in engines if e["worker_id"] == holder), {})

    until(lambda: (engine().get("prefix_cache_hits") or 0) >= 320, "the engine's own count of hits")
    seen = engine()
    assert seen["error"] is None and seen["prefix_cache_queries"] > seen["prefix_cache_hits"] > 0
    assert seen["running_requests"] == 0 and seen["waiting_requests"] == 0 and 0 <= seen["kv_usage"] <= 1


def test_evictions_are_followed_block_for_block(fleet: Fleet) -> None:
    a = fleet.a
    prompts = [tokens(3000 + 128 * i, 128) for i in range(26)]  # 104 blocks, against 80 in the engine
    for prompt in prompts:
        a.complete(prompt)
    until(lambda: fleet.held(1, prompts[-1]) == 4, "the last prompt's events")
    evicted = 0
    for prompt in prompts[:8]:  # each probe stores its prompt again, and so may evict another
        probe = prompt + [7]  # one token past the blocks: what the engine can find is all 4 blocks
        predicted = fleet.held(1, probe) * BLOCK
        assert a.complete(probe) == predicted
        evicted += predicted < 128
        until(lambda p=probe: fleet.held(1, p) == 4, "the probe's events")  # type: ignore[misc]
    assert evicted > 0  # the engine did evict, and the index followed
    assert 'kind="removed",result="ok"' in "".join(
        line for line in fleet.ok_text("/metrics").splitlines() if line.startswith("selection_proto_kv_events_total"))


def test_text_and_chat_through_the_picker_are_predicted_as_the_engine_finds_them(fleet: Fleet) -> None:
    """Behind the real Envoy, the picker tokenizes with the model's tokenizer.json and chat
    template; each response's `cached_tokens` goes back with the free and is observed."""
    from gateway import Gateway

    gateway = Gateway("--tokenizer", f"tiny={fleet.model}", mode="subscribe",
                      records=[fleet.a.worker(1), fleet.b.worker(2)])
    try:
        fleet.wait_subscribed(1, 2, port=gateway.server.port)

        def events() -> int:
            return sum(gateway.api("GET", f"/workers/{w}")[1]["kv_routing"]["events_total"] for w in (1, 2))

        system = "You are a helpful assistant. Answer briefly and precisely. " * 8  # ~4 blocks
        bodies: list[tuple[str, dict[str, Any]]] = []
        for i, topic in enumerate(("Which worker holds the cache?", "How are blocks hashed?",
                                   "Once upon a time there was a small engine.")):
            # A tail of its own (two blocks or more), so that every request stores new blocks.
            question = topic + " " + " ".join(f"w{i}x{j}" for j in range(24))
            bodies.append(("/v1/completions", {"model": "tiny", "prompt": system + question, "max_tokens": 1}))
            bodies.append(("/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": question + " again"}]}))
        found = []
        for path, body in bodies:
            before = events()
            status, _, payload = gateway.request(path, body, timeout=60)
            assert status == 200, payload
            found.append(json.loads(payload)["usage"]["prompt_tokens_details"]["cached_tokens"])
            until(lambda b=before: events() > b, "the request's stored event")  # type: ignore[misc]
        assert gateway.wait_idle(model="tiny") == 0
        verdicts = [gateway.api("GET", f"/workers/{w}")[1]["kv_routing"] for w in (1, 2)]
        assert sum(v["observations"] for v in verdicts) == len(bodies)
        observed = sum(v["observed_cached_tokens"] for v in verdicts)
        assert observed == sum(found) and observed >= 4 * BLOCK  # the shared prefixes were found
        assert sum(v["predicted_cached_tokens"] for v in verdicts) == observed
        assert all(v["state"] in ("ok", "waiting") for v in verdicts)
    finally:
        gateway.stop()


@pytest.mark.parametrize("mode", ["subscribe", "approximate"])
def test_the_gateway_recipe_works_as_written(fleet: Fleet, mode: str) -> None:
    """docs/GATEWAY.md's recipe: engine a runs its engine command; here its `serve` command (with
    KV events, or approximate), its Envoy config, and its `curl` commands (through bash) on this
    machine's free ports. The same chat twice: the second is found cached by the engine as the
    router predicted; with events the router also knows what the engine held before."""
    from gateway import Gateway

    blocks = recipe_blocks()
    prefix = "" if mode == "subscribe" else "approximate-"
    assert recipe_args(blocks["envoy"]) == ["envoy", "-c", "deploy/envoy/envoy.yaml"]  # what Gateway runs
    serve = recipe_args(render_recipe(blocks[prefix + "serve"], {"picker": 0}, fleet.model))
    assert serve[:4] == ["selection-proto", "serve", "--kv-events", mode], serve
    gateway = Gateway(*serve[2:], records=[])
    try:
        ports = {"engine": fleet.a.http_port, "events": fleet.a.events_port, "replay": fleet.a.replay_port,
                 "api": gateway.server.port, "gateway": gateway.port}

        def run(name: str) -> Any:
            command = render_recipe(blocks[name], ports, fleet.model)
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, (command, done.stderr)
            return json.loads(done.stdout)

        registered = run(prefix + "register")
        assert registered["worker_id"] == 1, registered

        def verdict() -> dict[str, Any]:
            return gateway.api("GET", "/workers/1")[1]["kv_routing"]  # type: ignore[no-any-return]

        if mode == "subscribe":
            fleet.wait_subscribed(1, port=gateway.server.port)
        answers = [run("request")]
        if mode == "subscribe":
            until(lambda: verdict()["events_total"] > 0, "the prompt's stored blocks")
        answers.append(run("request"))
        assert all("usage" in answer for answer in answers), answers
        found = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers]
        whole_blocks = (answers[1]["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
        assert found[1] == whole_blocks >= BLOCK
        assert gateway.wait_idle(model="tiny") == 0
        seen = verdict()
        assert seen["state"] == "ok" and seen["observations"] == 2
        assert seen["observed_cached_tokens"] == sum(found)
        # Approximate mode knows only what it sent: the first request is predicted 0 whatever the
        # engine held (from the run with events before).
        first = found[0] if mode == "subscribe" else 0
        assert seen["predicted_cached_tokens"] == first + found[1]
    finally:
        gateway.stop()


def test_reset_prefix_cache_clears_the_index(fleet: Fleet) -> None:
    b = fleet.b
    prompt = tokens(7000, 96)
    b.complete(prompt)
    until(lambda: fleet.held(2, prompt) == 3, "the stored event")
    status, _ = b.post("/reset_prefix_cache", {})
    assert status == 200
    b.complete(tokens(7200, 40))  # AllBlocksCleared goes out with the engine's next step
    until(lambda: fleet.held(2, prompt) == 0, "the clear")
    assert b.complete(prompt + [7]) == 0


def test_a_block_size_other_than_the_engines_is_named(fleet: Fleet) -> None:
    record = fleet.a.worker(11, model_name="tiny-16", block_size=16)
    assert fleet.api("POST", "/workers", record)[0] == 201
    assert fleet.verdict(11)["state"] == "waiting"
    fleet.wait_subscribed(11, model="tiny-16")
    fleet.a.complete(tokens(8000, 70))
    until(lambda: fleet.verdict(11)["state"] == "block_size_mismatch", "the mismatch")
    verdict = fleet.verdict(11)
    assert verdict["engine_block_size"] == BLOCK and "block_size 32" in verdict["reasons"][0]
    assert fleet.api("DELETE", "/workers/11")[0] == 200


def test_an_endpoint_nothing_publishes_on_is_no_events(fleet: Fleet) -> None:
    from engines.vllm import free_ports

    silent = free_ports(1)[0]
    assert fleet.api("POST", "/workers", {"worker_id": 12, "model_name": "ghost", "block_size": BLOCK,
                                          "endpoint": "http://127.0.0.1:9",
                                          "kv_events_endpoint": f"tcp://127.0.0.1:{silent}"})[0] == 201
    fleet.ok("POST", "/reservations", {"model_name": "ghost", "worker_id": 12, "token_ids": tokens(0, 70),
                                       "reservation_id": "ghost-1"})
    assert fleet.verdict(12)["state"] == "waiting"  # inside the window
    until(lambda: fleet.verdict(12)["state"] == "no_events", "no_events", WINDOW + 10)
    assert "publishing" in fleet.verdict(12)["reasons"][0]
    metrics = fleet.ok_text("/metrics")
    assert 'selection_proto_kv_routing_state{model_name="ghost",tenant_id="default",worker_id="12",' \
           'state="no_events"} 1.0' in metrics


def test_prefix_caching_off_is_no_events_with_events_and_misses_with_predictions(fleet: Fleet) -> None:
    c = fleet.c
    # With real events: the engine publishes nothing for what it does not cache.
    assert fleet.api("POST", "/workers", c.worker(13, model_name="nocache"))[0] == 201
    fleet.wait_subscribed(13, model="nocache")
    fleet.ok("POST", "/reservations", {"model_name": "nocache", "worker_id": 13, "token_ids": tokens(0, 70),
                                       "reservation_id": "nc-1"})
    c.complete(tokens(0, 70))
    until(lambda: fleet.verdict(13)["state"] == "no_events", "no_events", WINDOW + 10)
    assert "prefix caching" in fleet.verdict(13)["reasons"][0]
    # With predictions (approximate mode): booked prompts count as cached; the engine finds none.
    predicting = Server(mode="approximate")
    try:
        assert fleet.api("POST", "/workers", c.worker(1), port=predicting.port)[0] == 201
        prompt = tokens(9000, 130)
        for i in range(7):
            rid = f"approx-{i}"
            selected = fleet.ok("POST", "/select_and_reserve", {"model_name": "tiny", "token_ids": prompt,
                                                                "reservation_id": rid}, port=predicting.port)
            found = c.complete(prompt)
            assert found == 0 and selected["cached_tokens"] == (0 if i == 0 else 128)
            fleet.ok("DELETE", f"/reservations/{rid}", {"cached_tokens": found}, port=predicting.port)
        verdict = fleet.verdict(1, port=predicting.port)
        assert verdict["state"] == "misses" and verdict["observations"] == 7
        assert verdict["predicted_cached_tokens"] == 6 * 128 and verdict["observed_cached_tokens"] == 0
        assert "prefix caching" in verdict["reasons"][0]
    finally:
        predicting.stop()


def test_a_fresh_service_replays_a_real_engine_from_its_newest_clear(fleet: Fleet) -> None:
    """Engine a has published every test's batches so far; after a cache reset, a service started
    now passes over what came before the clear and knows what the engine holds since."""
    a = fleet.a
    kept = tokens(11000, 96)
    assert a.post("/reset_prefix_cache", {})[0] == 200
    a.complete(kept)  # the clear goes out with this step, then the prompt's three blocks
    until(lambda: fleet.held(1, kept) == 3, "the stored event")
    fresh = Server(mode="subscribe")
    try:
        assert fleet.api("POST", "/workers", a.worker(1), port=fresh.port)[0] == 201
        fleet.wait_subscribed(1, port=fresh.port)
        a.complete(tokens(11200, 40))  # a live batch: the replay from 0 comes first
        until(lambda: fleet.held(1, kept, port=fresh.port) == 3, "the replay")

        def replays(result: str) -> float:
            line = f'selection_proto_kv_replay_total{{result="{result}"}} '
            found = [x for x in fleet.ok_text("/metrics", fresh.port).splitlines() if x.startswith(line)]
            return float(found[0].split()[-1]) if found else 0.0

        assert replays("passed_over") > 0 and replays("unrecovered") == 0
        probe = kept + [7]
        assert fleet.held(1, probe, port=fresh.port) * BLOCK == a.complete(probe) == 96
        verdict = fleet.verdict(1, port=fresh.port)
        assert verdict["state"] == "ok" and verdict["restarts"] == 0
    finally:
        fresh.stop()


def test_a_restarted_engine_is_forgotten_with_and_without_replay(fleet: Fleet) -> None:
    prompt = tokens(12000, 96)
    for worker_id, engine in ((1, fleet.a), (2, fleet.b)):
        engine.complete(prompt)
        until(lambda w=worker_id: fleet.held(w, prompt) == 3, "the stored events")  # type: ignore[misc]
    for engine in (fleet.a, fleet.b):
        engine.kill()
    # The engines' connections closed: what they held is gone with them.
    until(lambda: fleet.held(1, prompt) == 0 and fleet.held(2, prompt) == 0, "the index to forget")
    for worker_id in (1, 2):
        verdict = fleet.verdict(worker_id)
        assert verdict["state"] == "stale" and "restarted" in verdict["reasons"][0]
    for engine in (fleet.a, fleet.b):
        engine.start()
    for engine in (fleet.a, fleet.b):
        engine.wait_healthy()
    fleet.wait_subscribed(1, 2)
    for worker_id, engine in ((1, fleet.a), (2, fleet.b)):
        assert fleet.held(worker_id, prompt + [7]) * BLOCK == engine.complete(prompt + [7]) == 0
        # Its first batch (seq 0) is a restart seen from the start: stale until the next in order.
        until(lambda w=worker_id: fleet.verdict(w)["restarts"] == 1, "the restart")  # type: ignore[misc]
        assert fleet.verdict(worker_id)["state"] == "stale"
        engine.complete(tokens(12500 + 100 * worker_id, 70))
        until(lambda w=worker_id: fleet.verdict(w)["state"] == "ok", "ok again")  # type: ignore[misc]
        probe = prompt + [9]
        assert fleet.held(worker_id, probe) * BLOCK == engine.complete(probe) == 96


def test_an_engine_gone_for_good_is_no_events(fleet: Fleet) -> None:
    fleet.b.kill()
    until(lambda: fleet.verdict(2)["state"] == "stale", "the lost connection")
    fleet.ok("POST", "/reservations", {"model_name": "tiny", "worker_id": 2, "token_ids": tokens(15000, 70),
                                       "reservation_id": "gone-1"})
    until(lambda: fleet.verdict(2)["state"] == "no_events", "no_events", WINDOW + 10)
    assert fleet.ok("GET", "/health") == {"status": "ok"}
