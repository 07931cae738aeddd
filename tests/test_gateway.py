"""The endpoint picker behind a real Envoy (docs/GATEWAY.md): Envoy's ext_proc filter in FULL_DUPLEX_STREAMED
mode both ways with trailers SEND asks our `serve --ext-proc-port` where each OpenAI request goes,
and an ORIGINAL_DST cluster sends it to that engine (tests/gateway.py has the parts)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from gateway import Gateway


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway()
    try:
        yield gw
    finally:
        gw.stop()


def assert_serving(gw: Gateway) -> None:
    """Envoy and the picker both alive, a request routed and answered, nothing left booked."""
    assert gw.envoy.poll() is None and gw.server.proc.poll() is None
    assert gw.api("GET", "/health") == (200, {"status": "ok"})
    status, _, body = gw.request("/v1/completions", {"model": "m", "prompt": [7, 7, 7, 7, 7]})
    assert status == 200, body
    assert gw.wait_idle() == 0


def test_a_streamed_completion_of_token_ids_reaches_the_picked_engine_whole(gateway: Gateway) -> None:
    seen = [len(e.requests) for e in gateway.engines]
    events = list(gateway.stream_events({"model": "m", "prompt": list(range(100, 140)), "stream": True}))
    assert events[-1] == b"data: [DONE]" and len(events) == 5
    ports = {json.loads(e[len(b"data: "):])["port"] for e in events[:-1]}
    assert len(ports) == 1  # one engine streamed all of it
    engine = gateway.engine_of(str(ports.pop()))
    assert [len(e.requests) - n for e, n in zip(gateway.engines, seen, strict=True)] == [int(i == engine) for i in range(2)]
    path, headers, body = gateway.engines[engine].requests[-1]
    assert path == "/v1/completions" and json.loads(body)["prompt"] == list(range(100, 140))
    chosen = gateway.engines[engine]
    assert headers["x-gateway-destination-endpoint"] == f"{chosen.host}:{chosen.port}"
    assert gateway.wait_idle() == 0  # the booking ended with the stream


def test_requests_sharing_a_prefix_land_on_one_engine(gateway: Gateway) -> None:
    prefix = list(range(1000, 1064))
    first = gateway.request("/v1/completions", {"model": "m", "prompt": prefix + [1]})
    assert first[0] == 200
    engine = gateway.engine_of(str(json.loads(first[2])["port"]))
    for tail in range(2, 8):
        status, _, body = gateway.request("/v1/completions", {"model": "m", "prompt": prefix + [tail]})
        assert status == 200 and gateway.engine_of(str(json.loads(body)["port"])) == engine
    # A text prompt without a tokenizer is routed on its text tokens, the same way.
    text = "You are a helpful assistant. " * 20
    first = gateway.request("/v1/completions", {"model": "m", "prompt": text + "first"})
    engine = gateway.engine_of(str(json.loads(first[2])["port"]))
    for tail in ("second", "third", "fourth"):
        status, _, body = gateway.request("/v1/completions", {"model": "m", "prompt": text + tail})
        assert status == 200 and gateway.engine_of(str(json.loads(body)["port"])) == engine
    assert gateway.wait_idle() == 0


def test_bad_bodies_and_unknown_models_get_openai_errors_and_the_next_request_is_served(gateway: Gateway) -> None:
    status, headers, body = gateway.request("/v1/completions", b'{"model": "m", "prompt": [1, 2')
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    status, _, body = gateway.request("/v1/completions", {"model": "nope", "prompt": [1, 2, 3]})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    status, _, body = gateway.request("/v1/chat/completions", {"model": "m", "messages": "hi"})
    assert status == 400 and "messages" in json.loads(body)["error"]["message"]
    status, _, body = gateway.request("/v1/completions", b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert status == 400
    assert_serving(gateway)


def test_a_body_over_8_mib_is_refused_413_while_envoy_still_streams_it(gateway: Gateway) -> None:
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
        size = 9 << 20
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % size)
        try:
            sock.sendall(b'{"model": "m", "prompt": "' + b"a" * (size - 28) + b'"}')
        except OSError:
            pass  # Envoy answered and closed before taking it all
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert_serving(gateway)


def slow_engines(gw: Gateway, delay: float) -> None:
    for engine in gw.engines:
        engine.delay = delay


def test_sse_events_are_echoed_as_they_come_not_buffered(gateway: Gateway) -> None:
    slow_engines(gateway, 0.4)
    try:
        started = time.monotonic()
        arrivals = [time.monotonic() - started for _ in gateway.stream_events(
            {"model": "m", "prompt": list(range(30)), "stream": True})]
    finally:
        slow_engines(gateway, 0.02)
    assert len(arrivals) == 5 and arrivals[0] < 0.35 and arrivals[-1] > 1.5, arrivals
    assert gateway.wait_idle() == 0


def test_a_client_leaving_mid_stream_frees_its_booking(gateway: Gateway) -> None:
    slow_engines(gateway, 2.0)  # the stream would end on its own only after 8 s
    try:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as sock:
            body = json.dumps({"model": "m", "prompt": list(range(50)), "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            received = b""
            while b"data: " not in received:  # the stream has begun
                received += sock.recv(65536)
            assert gateway.active_requests() == 1
        left = time.monotonic()
        assert gateway.wait_idle(timeout=3) == 0  # freed when Envoy reset the stream
        assert time.monotonic() - left < 2.0
    finally:
        slow_engines(gateway, 0.02)
    assert_serving(gateway)


def test_large_bodies_pass_whole_in_pieces_under_64_kib(gateway: Gateway) -> None:
    prompt = list(range(150_000))  # about 1 MB of JSON: Envoy's duplicate end-of-stream zone
    status, _, body = gateway.request("/v1/completions", {"model": "m", "prompt": prompt})
    assert status == 200
    engine = gateway.engines[gateway.engine_of(str(json.loads(body)["port"]))]
    assert json.loads(engine.requests[-1][2])["prompt"] == prompt
    assert gateway.wait_idle() == 0


def test_a_queued_selection_holds_the_request_until_a_rank_frees_and_a_full_queue_answers_429() -> None:
    """Queueing on: both engines busy prefilling, a third request waits in the picker's queue (Envoy
    waits for its header reply), a fourth finds the queue full; the third runs once a prefill ends."""
    gw = Gateway("--queue-threshold", "0.5", "--queue-max-pending", "1", first_delay=1.0,
                 worker={"max_num_batched_tokens": 16})
    try:
        results: dict[int, tuple[int, bytes]] = {}

        def send(n: int) -> None:
            status, _, body = gw.request("/v1/completions", {"model": "m", "prompt": [n] * 40, "stream": True})
            results[n] = (status, body)

        import threading

        threads = [threading.Thread(target=send, args=(n,)) for n in (1, 2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 5
        while gw.active_requests() < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        queued = threading.Thread(target=send, args=(3,))
        queued.start()
        time.sleep(0.2)
        status, _, body = gw.request("/v1/completions", {"model": "m", "prompt": [4] * 40})
        assert status == 429 and "queue is full" in json.loads(body)["error"]["message"]
        # A sheddable request (the Gateway API's priority < 0; docs/FLOW_CONTROL.md) is refused at once under
        # saturation, with when to come back; so is one that asked not to queue.
        for ask in ({"x-llm-d-inference-fairness-id": "team-b", "x-selection-priority": "-1"},
                    {"x-selection-do-not-queue": "true"}):
            status, answer_headers, body = gw.request("/v1/completions", {"model": "m", "prompt": [5] * 40},
                                                      headers=ask)
            assert status == 429 and int(answer_headers["retry-after"]) >= 1, body
            assert "refused: every candidate" in json.loads(body)["error"]["message"] or \
                "do_not_queue" in json.loads(body)["error"]["message"]
        for thread in (*threads, queued):
            thread.join(20)
        assert [results[n][0] for n in (1, 2, 3)] == [200, 200, 200]
        assert results[3][1].endswith(b"data: [DONE]\n\n")
        assert gw.wait_idle() == 0
        assert_serving(gw)
    finally:
        gw.stop()


def test_the_subset_hint_limits_the_pick_and_a_model_without_workers_answers_503() -> None:
    """A filter before the picker sets `envoy.lb.subset_hint` (forwarded by `metadata_options`):
    every request lands on the one engine it lists, whatever its prefix."""
    gw = Gateway(subset=["127.0.0.3:1"])  # the second engine's IP (any port: matched on the IP, as the reference)
    try:
        ports = {json.loads(gw.request("/v1/completions", {"model": "m", "prompt": [n] * 40})[2])["port"]
                 for n in range(12)}
        assert ports == {gw.engines[1].port}
        # A model whose workers were all deleted is known but unavailable: 503.
        assert gw.api("POST", "/workers", {"worker_id": 9, "model_name": "gone", "block_size": 4,
                                           "endpoint": "http://127.0.0.1:9"})[0] == 201
        assert gw.api("DELETE", "/workers/9")[0] == 200
        status, _, body = gw.request("/v1/completions", {"model": "gone", "prompt": [1, 2, 3, 4]})
        assert status == 503 and json.loads(body)["error"]["type"] == "service_unavailable_error"
        assert_serving(gw)
    finally:
        gw.stop()
    other = Gateway(subset=["10.9.9.9:8000"])  # no engine of the pool is in the hint
    try:
        status, _, body = other.request("/v1/completions", {"model": "m", "prompt": [1, 2, 3, 4]})
        assert status == 503 and "subset" in json.loads(body)["error"]["message"]
    finally:
        other.stop()


def test_buffered_request_bodies_are_routed_too() -> None:
    """`request_body_mode: BUFFERED` (what kgateway's older plugin generated): the headers are
    answered at once, the destination rides on the body's reply."""
    gw = Gateway(body_mode="BUFFERED")
    try:
        prefix = list(range(500, 564))
        ports = {json.loads(gw.request("/v1/completions", {"model": "m", "prompt": prefix + [n]})[2])["port"]
                 for n in range(5)}
        assert len(ports) == 1
        events = list(gw.stream_events({"model": "m", "prompt": prefix, "stream": True}))
        assert events[-1] == b"data: [DONE]"
        assert gw.wait_idle() == 0
    finally:
        gw.stop()


@pytest.mark.parametrize("header_mode", ["SEND", "SKIP"])
def test_with_the_answer_streamed_past_the_picker_a_booking_lasts_as_long_as_its_request(header_mode: str) -> None:
    """`response_body_mode: NONE` with the trailers still `SEND` (docs/GATEWAY.md, "Measured"), the
    answer's headers sent to the picker or not: the answer goes from the engine to the client
    without the picker, whole; the booking is held while it streams and freed when Envoy ends the
    picker's stream with the request. (With the trailers `SKIP` too, Envoy ends that stream at the
    response headers and the booking with it.)"""
    gw = Gateway(chunks=6, delay=0.15, response_body_mode="NONE", response_header_mode=header_mode)
    try:
        prefix = list(range(700, 764))
        events: list[bytes] = []
        reader = threading.Thread(target=lambda: events.extend(
            gw.stream_events({"model": "m", "prompt": prefix, "stream": True})))
        reader.start()
        time.sleep(0.4)  # mid-stream: six chunks 0.15 s apart
        assert reader.is_alive() and gw.active_requests() == 1
        reader.join(10)
        assert events[-1] == b"data: [DONE]" and len(events) == 7
        assert gw.wait_idle() == 0
    finally:
        gw.stop()
