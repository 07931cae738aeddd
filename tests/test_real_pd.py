"""Real prefill/decode pairs end to end (docs/PD.md, docs/REAL_ENGINES.md): two vLLM engines on the
CPU with the `ExampleConnector` (P a producer, D a consumer, KV through one shared folder),
registered with their roles; a real Envoy with the picker in front; and a small sidecar before D
playing llm-d's routing sidecar (a request naming `x-prefiller-host-port` is prefilled there with
`max_tokens=1`, then sent to D as it came). The decode engine's own counters say whether a
prompt's KV was transferred or computed. Without an engine these fail, never skip."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from engines.vllm import VllmEngine
from gateway import Gateway
from test_real_engines import tokens, until

from selection_proto.adapters.ext_proc import PREFILLER

BLOCK = 32
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
EXTERNAL = (BY_SOURCE, 'source="external_kv_transfer"')
COMPUTED = (BY_SOURCE, 'source="local_compute"')
PROMPT_TOKENS = ("vllm:prompt_tokens_total", "")
EXTERNAL_HITS = ("vllm:external_prefix_cache_hits_total", "")


class Sidecar:
    """llm-d's routing sidecar in miniature, on D's registered endpoint: what it was sent, it sends
    to the decode engine; first, when the request names a prefiller, the same request with
    `max_tokens=1` to that prefiller (whose connector writes the prompt's KV for D to load)."""

    def __init__(self, decode_port: int) -> None:
        self.prefillers: list[str | None] = []  # the header of each request it received
        self.prefilled: list[dict[str, Any]] = []  # the prefillers' answers
        sidecar = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self._body()
                prefiller = self.headers.get(PREFILLER)
                sidecar.prefillers.append(prefiller)
                if prefiller is not None:
                    host, port = prefiller.rsplit(":", 1)
                    first = {**json.loads(body), "max_tokens": 1, "stream": False}
                    status, _, answer = _post(host, int(port), self.path, json.dumps(first).encode())
                    assert status == 200, answer
                    sidecar.prefilled.append(json.loads(answer))
                status, content_type, answer = _post("127.0.0.1", decode_port, self.path, body)
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def _body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("content-length", "0")))
                out = b""
                while (size := int(self.rfile.readline().split(b";")[0], 16)) != 0:
                    out += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return out

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _post(host: str, port: int, path: str, body: bytes) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request("POST", path, body, {"content-type": "application/json"})
    response = conn.getresponse()
    answer = response.read()
    conn.close()
    return response.status, response.getheader("content-type") or "application/json", answer


def counter(text: str, metric: tuple[str, str]) -> float:
    """The sum of a metric's samples (its name, and a label its lines must carry)."""
    name, label = metric
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")) and label in line)


class PdFleet:
    def __init__(self, folder: Path, model: Path) -> None:
        shared = folder / "kv"
        shared.mkdir()
        self.p = VllmEngine(model, folder, "prefill", core=0, replay=False, kv_role="kv_producer", kv_folder=shared)
        self.d = VllmEngine(model, folder, "decode", core=1, replay=False, kv_role="kv_consumer", kv_folder=shared)
        self.engines = [self.p, self.d]
        self.sidecar: Sidecar | None = None
        self.gateway: Gateway | None = None
        for engine in self.engines:
            engine.start()
        for engine in self.engines:
            engine.healthy_or_retried()
        # Warm both (a first request took 14.5 s here), with prompts of their own: each engine's
        # connector writes what it computed and loads what it finds, whatever its role.
        self.p.complete(tokens(1, 40))
        self.d.complete(tokens(2, 40))
        self.sidecar = Sidecar(self.d.http_port)
        self.gateway = Gateway(mode="subscribe", records=[
            self.d.worker(1, endpoint=self.sidecar.url, role="decode", local_prefill=True),
            self.p.worker(2, role="prefill")])
        until(lambda: all(any(r["worker_id"] == w and r["open_streams"] for r in self.scores([1])["freshness"])
                          for w in (1, 2)), "the subscriptions to both engines")

    def scores(self, prompt: list[int]) -> Any:
        status, answer = self.gateway_api("POST", "/overlap_scores", {"model_name": "tiny", "token_ids": prompt})
        assert status == 200, answer
        return answer

    def gateway_api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        assert self.gateway is not None
        return self.gateway.api(method, path, body)

    def service_metrics(self) -> str:
        assert self.gateway is not None
        conn = http.client.HTTPConnection("127.0.0.1", self.gateway.server.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return text

    def active(self) -> int:
        return sum(load["active_requests"] for key in self.gateway_api("GET", "/loads")[1] for load in key["loads"])

    def through_gateway(self, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
        assert self.gateway is not None
        status, _, payload = self.gateway.request("/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=180)
        assert status == 200, payload
        answer: dict[str, Any] = json.loads(payload)
        return answer

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        if self.sidecar is not None:
            self.sidecar.stop()
        for engine in self.engines:
            engine.kill()


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[PdFleet]:
    fleet = PdFleet(tmp_path_factory.mktemp("pd"), tiny_model)
    yield fleet
    fleet.stop()


def test_a_remote_plan_transfers_the_prompts_kv_to_the_decode_engine(pd: PdFleet) -> None:
    prompt = tokens(100, 500)  # 15 whole blocks and a tail of 20
    d_before, p_before = pd.d.metrics(), pd.p.metrics()
    answer = pd.through_gateway(prompt)
    d_after, p_after = pd.d.metrics(), pd.p.metrics()
    assert pd.sidecar is not None and pd.sidecar.prefillers == [f"127.0.0.1:{pd.p.http_port}"]
    # P computed the whole prompt for one token; D loaded its 15 blocks and computed the tail only.
    assert counter(p_after, PROMPT_TOKENS) - counter(p_before, PROMPT_TOKENS) == 500
    assert pd.sidecar.prefilled[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 15 * BLOCK
    assert counter(d_after, EXTERNAL) - counter(d_before, EXTERNAL) == 15 * BLOCK
    assert counter(d_after, COMPUTED) - counter(d_before, COMPUTED) == 500 - 15 * BLOCK
    assert counter(d_after, EXTERNAL_HITS) - counter(d_before, EXTERNAL_HITS) == 15 * BLOCK
    # D's first token is the one P computed from the same KV.
    assert answer["choices"][0]["text"].startswith(pd.sidecar.prefilled[-1]["choices"][0]["text"])
    until(lambda: pd.active() == 0, "the plan's end to free both legs")
    metrics = pd.service_metrics()
    assert counter(metrics, ("selection_proto_pd_plans_total", 'path="remote"')) == 1
    assert counter(metrics, ("selection_proto_pd_events_total", 'event="handoff"')) == 1
    assert counter(metrics, ("selection_proto_pd_events_total", 'event="ended"')) == 1


def test_a_local_plan_computes_on_the_decode_engine(pd: PdFleet) -> None:
    """D holds the prompt's first 15 blocks (its own events say so): the plan is local, the sidecar
    names no prefiller, P sees nothing, and D computes the tail from its own cache."""
    prefix = tokens(200, 15 * BLOCK)
    pd.d.complete(prefix + [7])
    until(lambda: next((r["device_blocks"] for r in pd.scores(prefix)["workers"] if r["worker_id"] == 1), 0) == 15,
          "D's stored events")
    prompt = prefix + tokens(300, 40)
    d_before, p_before = pd.d.metrics(), pd.p.metrics()
    answer = pd.through_gateway(prompt)
    d_after, p_after = pd.d.metrics(), pd.p.metrics()
    assert pd.sidecar is not None and pd.sidecar.prefillers[-1] is None
    assert counter(p_after, PROMPT_TOKENS) == counter(p_before, PROMPT_TOKENS)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 15 * BLOCK  # D's own cache
    assert counter(d_after, EXTERNAL) == counter(d_before, EXTERNAL)
    assert counter(d_after, COMPUTED) - counter(d_before, COMPUTED) == 40
    until(lambda: pd.active() == 0, "the plan's end")
    assert counter(pd.service_metrics(), ("selection_proto_pd_plans_total", 'path="local"')) == 1
