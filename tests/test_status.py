"""The live status page (docs/STATUS.md): `GET /status` in a real headless Chromium following the fleet over
server-sent events, behind the API's token; the snapshot's contents; the feed's bounds over real sockets."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Client, stored
from test_http import Server, api_call
from websockets.sync.client import connect

from selection_proto.core.base.hashing import block_hashes
from selection_proto.transports.status import MAX_VIEWERS

TOKEN = "s3cret-token"
BEARER = {"authorization": f"Bearer {TOKEN}"}
WORKER = {"model_name": "m", "block_size": 4, "endpoint": "http://e"}


class Browser:
    """Headless Chromium driven over the DevTools protocol (a WebSocket), one page."""

    def __init__(self, profile: Path) -> None:
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if exe is None:
            pytest.fail("chromium is missing: .ci/run installs Debian's chromium")
        self.proc = subprocess.Popen([exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.exists() and len(active.read_text().split()) == 2):
            assert time.monotonic() < deadline and self.proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = active.read_text().split()[0]
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in targets if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=20, legacy=True)
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # events (no id) are not needed here
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return dict(message["result"])

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20) -> Any:
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"never true: {expression}\n" + str(
                self.evaluate("document.body.innerText"))
            time.sleep(0.2)
        return value

    def close(self) -> None:
        self.ws.close()
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[Server]:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    server = Server("--auth-token-file", str(token), "--kv-verdict-window-secs", "1", "--shadow-policy", "ttft")
    yield server
    server.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    chromium = Browser(tmp_path / "profile")
    yield chromium
    chromium.close()


def call(server: Server, method: str, path: str, body: Any = None) -> Any:
    status, answer = api_call(server.port, method, path, body, headers=BEARER)
    assert 200 <= status < 300, (status, answer)
    return answer


def row(worker: int, selector: str = "") -> str:
    return f"document.querySelector('#workers tr[data-worker=\"{worker}\"]{selector}')"


def test_the_page_follows_the_fleet_live_in_chromium(guarded: Server, browser: Browser) -> None:
    call(guarded, "POST", "/workers", {"worker_id": 1, **WORKER})
    # What a browser user does: the token as the password of the Basic challenge /status answers with.
    browser.call("Page.navigate", url=f"http://viewer:{TOKEN}@127.0.0.1:{guarded.port}/status")
    browser.wait_for("document.getElementById('live')?.textContent === 'live'")  # its script ran, the feed flows
    assert browser.wait_for(row(1, " .kv") + "?.textContent") == "waiting"

    # Registered after the page opened: it appears without a reload; so does a decision, explained.
    hostile = "<img src=x onerror=\"window.pwned=1\">"
    call(guarded, "POST", "/workers", {"worker_id": 2, **WORKER, "endpoint": hostile})
    call(guarded, "POST", "/workers", {"worker_id": 3, **WORKER, "model_name": "other"})
    browser.wait_for(row(2) + " !== null")
    answer = call(guarded, "POST", "/select_and_reserve", {"model_name": "m", "token_ids": list(range(12))})
    chosen = answer["worker_id"]
    runner = 3 - chosen
    text = browser.wait_for("document.querySelector('#decisions tr[data-worker]')?.innerText")
    # Worker and rank named, the booking's id to match a complaint with, the tie said as a tie.
    assert f"worker {chosen}, rank 0" in text and f"worker {runner}, rank 0 (0 cached)" in text, text
    assert answer["reservation_id"] in text and "tie: the same cost (blocks)" in text, text

    # A state change shows: the booking brought no event within the window; then one arrives.
    assert browser.wait_for(row(chosen, " .kv") + "?.textContent === 'no_events'")
    assert "no KV event" in browser.evaluate(row(chosen) + ".innerText")
    # in the colour of its severity, the alert rules' (test_severity_is_one_scale...)
    assert browser.evaluate(row(chosen, " .kv") + ".classList.contains('critical')")
    assert browser.evaluate(row(chosen) + " === document.querySelector('#workers tr')")  # worst first
    call(guarded, "POST", f"/kv_events?worker_id={chosen}", {"event_id": 1, "data": "cleared"})
    assert browser.wait_for(row(chosen, " .kv") + "?.textContent === 'ok'")
    call(guarded, "DELETE", "/workers/3")
    assert browser.wait_for(row(3, " .lifecycle") + "?.textContent.startsWith('unschedulable')")

    # Text from the service is shown as text, never run.
    assert hostile in browser.evaluate(row(2) + ".innerText")
    assert browser.evaluate("window.pwned === undefined && !document.querySelector('#workers img')")


def test_the_status_routes_are_behind_the_token_and_say_how_to_give_it(guarded: Server) -> None:
    for path in ("/status", "/status/snapshot", "/status/events"):
        for headers in ({}, {"authorization": "Basic " + base64.b64encode(b"viewer:wrong").decode()},
                        {"authorization": "Basic %%%not-base64"}, {"authorization": f"Bearer {TOKEN}x"}):
            sock = guarded.connect()
            sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n".encode()
                         + "".join(f"{n}: {v}\r\n" for n, v in headers.items()).encode() + b"\r\n")
            head = sock.recv(65536).decode()
            sock.close()
            assert head.startswith("HTTP/1.1 401"), (path, headers, head)
            assert 'www-authenticate: Basic realm="selection-proto"' in head  # a browser prompts for it
    assert api_call(guarded.port, "GET", "/workers")[0] == 401
    basic = {"authorization": "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()}
    status, snapshot = api_call(guarded.port, "GET", "/status/snapshot", headers=basic)
    assert status == 200 and snapshot["workers"] == [] and snapshot["serving"] is True
    assert api_call(guarded.port, "GET", "/status/snapshot", headers=BEARER)[0] == 200
    assert api_call(guarded.port, "GET", "/health") == (200, {"status": "ok"})


def _open_feed(server: Server) -> socket.socket:
    sock = server.connect()
    sock.sendall(f"GET /status/events HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode())
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def test_feeds_are_capped_and_viewers_that_never_read_hold_up_nothing(guarded: Server) -> None:
    call(guarded, "POST", "/workers", {"worker_id": 1, **WORKER})
    first = _open_feed(guarded)
    head = _read_until(first, b"\n\n").decode()
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head
    assert '"worker_id":1' in head  # the first event comes at once
    second = _read_until(first, b"data:")  # and the next a second later
    assert b"retry:" in second
    # The others never read a byte of what they are sent.
    silent = [_open_feed(guarded) for _ in range(MAX_VIEWERS - 1)]
    time.sleep(1.5)
    extra = _open_feed(guarded)
    refused = _read_until(extra, b"}").decode()
    assert refused.startswith("HTTP/1.1 503") and "too many status page viewers; retry later" in refused
    for _ in range(20):
        started = time.monotonic()
        assert api_call(guarded.port, "GET", "/health") == (200, {"status": "ok"})
        assert time.monotonic() - started < 0.5
    for sock in silent:
        sock.close()
    deadline = time.monotonic() + 10
    while True:  # their places come back once a send finds them gone
        again = _open_feed(guarded)
        answer = _read_until(again, b"\r\n")
        again.close()
        if answer.startswith(b"HTTP/1.1 200"):
            break
        assert time.monotonic() < deadline, answer
        time.sleep(0.3)
    first.close()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{guarded.port}/metrics", timeout=10).read().decode()
    assert 'selection_proto_limit_rejections_total{limit="status_viewers"}' in metrics


def test_the_snapshot_explains_decisions_and_shows_loads_queues_and_index(make_client: Any) -> None:
    client: Client = make_client(router_policy="ttft")
    for worker_id in (1, 2):
        client.ok("POST", "/workers", {"worker_id": worker_id, **WORKER}, status=201)
    first, second = block_hashes(list(range(12)), 4)[:2]
    client.ok("POST", "/kv_events", [stored(2, 1, [(101, first), (102, second)])])
    picks = [client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": list(range(12))})
             for _ in range(3)]
    status, events = client.call("GET", "/status/events")
    assert status == 200 and events.startswith("retry: 2000\ndata: ") and events.endswith("\n\n")
    snapshot = json.loads(events.split("data: ", 1)[1])
    assert snapshot == client.ok("GET", "/status/snapshot")
    workers = {w["worker_id"]: w for w in snapshot["workers"]}
    assert [w["lifecycle"] for w in workers.values()] == ["schedulable", "schedulable"]
    booked = {w: workers[w]["active_requests"] for w in workers}
    assert booked == {w: sum(p["worker_id"] == w for p in picks) for w in (1, 2)}
    assert workers[2]["index_blocks"] >= 2 and workers[2]["kv_routing"]["state"] == "ok"
    [key] = snapshot["keys"]
    assert (key["model_name"], key["pending_count"], key["pending_isl_tokens"], key["active_reservations"],
            key["lanes"]) == ("m", 0, 0, 3, [])
    assert key["prompt_tokens"] == 36 and key["achieved_cached_tokens"] == sum(p["cached_tokens"] for p in picks)
    newest = snapshot["decisions"][0]
    assert len(snapshot["decisions"]) == 3 and newest["isl_tokens"] == 12
    assert (newest["worker_id"], newest["cached_tokens"]) == (picks[-1]["worker_id"], picks[-1]["cached_tokens"])
    assert {c["worker_id"] for c in newest["candidates"]} == {1, 2}
    assert all(c["predicted_wait_secs"] is not None for c in newest["candidates"])  # ttft predicts them
    assert newest["runner_up"]["worker_id"] != newest["worker_id"] and newest["runner_up"]["margin"] >= 0
    assert picks[0]["worker_id"] == 2 and snapshot["decisions"][-1]["cached_tokens"] == 8


def test_a_json_lines_router_reads_the_same_snapshot() -> None:
    from test_jsonl import rpc, run_session

    answers, _, code = run_session(rpc(1, "workers.create", worker_id=4, **WORKER)
                                   + rpc(2, "select_and_reserve", model_name="m", token_ids=list(range(8)))
                                   + rpc(3, "status") + rpc(4, "status", q="nothing-matches", detail=4))
    assert code == 0
    status = next(a["result"] for a in answers if a["id"] == 3)
    filtered = next(a["result"] for a in answers if a["id"] == 4)
    assert filtered["workers"] == [] and [r["dp_rank"] for r in filtered["detail"]["ranks"]] == [0]
    assert [w["worker_id"] for w in status["workers"]] == [4]
    assert status["decisions"][0]["worker_id"] == 4 and status["keys"][0]["active_reservations"] == 1


def test_a_viewer_watching_does_not_hold_up_a_graceful_stop() -> None:
    server = Server()
    feed = server.connect()
    feed.sendall(b"GET /status/events HTTP/1.1\r\nhost: x\r\n\r\n")
    assert _read_until(feed, b"data:").startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    assert server.stop() == 0 and time.monotonic() - started < 5
    feed.close()


def test_a_decision_keeps_only_its_cheapest_candidates(make_client: Any) -> None:
    client: Client = make_client(temperature=5.0)  # sampling: the chosen may be other than the cheapest
    for worker_id in range(1, 41):
        client.ok("POST", "/workers", {"worker_id": worker_id, **WORKER}, status=201)
    for _ in range(30):
        client.ok("POST", "/select_and_reserve", {"model_name": "m", "token_ids": list(range(40))})
    decisions = client.ok("GET", "/status/snapshot")["decisions"]
    assert len(decisions) == 20  # the newest, of 30
    for d in decisions:
        logits = [c["logit"] for c in d["candidates"]]
        assert d["candidate_count"] == 40 and len(logits) == 5 and logits == sorted(logits)
        margin = d["runner_up"]["margin"]  # how much more the runner-up cost than the chosen
        assert margin >= 0 if d["candidates"][0]["worker_id"] == d["worker_id"] else margin <= 0
    pool = client.service.pools[("m", "default")]
    assert all(len(d.cheapest) == 5 for d in pool.recent)  # what is kept, not only what is shown


def test_a_viewer_that_closes_gives_its_place_back_at_once(guarded: Server) -> None:
    feeds = [_open_feed(guarded) for _ in range(MAX_VIEWERS)]
    for sock in feeds:
        assert _read_until(sock, b"data:").startswith(b"HTTP/1.1 200")
    extra = _open_feed(guarded)
    assert _read_until(extra, b"}").startswith(b"HTTP/1.1 503")
    extra.close()
    feeds.pop().close()  # read to the end of what came: an orderly close
    closed_at = time.monotonic()
    while True:  # a send finding it gone took 2-3 s; its close is read at once
        again = _open_feed(guarded)
        answer = _read_until(again, b"\r\n")
        again.close()
        if answer.startswith(b"HTTP/1.1 200"):
            break
        assert time.monotonic() - closed_at < 1.0, answer
        time.sleep(0.05)
    for sock in feeds:
        sock.close()


def test_a_bad_filter_is_a_400_that_says_which(guarded: Server) -> None:
    for query, words in (("q=" + "x" * 257, "q: at most 256 characters"), ("detail=seven", "detail"),
                         ("detail=" + "9" * 5000, "detail"), ("q=a&q=b", "duplicate field `q`")):
        for path in ("/status/snapshot", "/status/events"):
            status, answer = api_call(guarded.port, "GET", f"{path}?{query}", headers=BEARER)
            assert status == 400 and words in answer["error"], (path, query, answer)
    assert api_call(guarded.port, "GET", "/status/snapshot?q=%F0%9F%A6%80&detail=1", headers=BEARER)[0] == 200


def test_the_snapshot_is_bounded_worst_first_filtered_with_one_workers_ranks(make_client: Any) -> None:
    from selection_proto.core.status import MAX_WORKER_ROWS

    client: Client = make_client(kv_verdict_window_secs=1)
    for worker_id in range(1, 301):
        client.ok("POST", "/workers", {"worker_id": worker_id, **WORKER, "data_parallel_size": 4,
                                       "endpoint": f"http://10.0.0.{worker_id}:8000"}, status=201)
    for n in range(40):  # bookings on some workers, and no event from them: no_events
        client.ok("POST", "/reservations", {"reservation_id": f"r{n}", "model_name": "m", "worker_id": 100 + n,
                                            "token_ids": list(range(16))}, status=201)
    client.now += 5
    whole = client.ok("GET", "/status/snapshot")
    assert len(whole["workers"]) == MAX_WORKER_ROWS and whole["workers_matched"] == 300
    assert whole["summary"]["workers"]["by_state"]["no_events"] == 40
    assert whole["summary"]["workers"]["by_severity"] == {"ok": 0, "info": 260, "warning": 0, "critical": 40}
    assert [w["worker_id"] for w in whole["workers"][:40]] == list(range(100, 140))  # worst first
    assert all(w["kv_routing"]["severity"] == "info" for w in whole["workers"][40:])
    assert "ranks" not in whole["workers"][0] and whole["workers"][0]["dp_size"] == 4
    found = client.ok("GET", "/status/snapshot", query="q=10.0.0.17:")
    assert [w["worker_id"] for w in found["workers"]] == [17] and found["workers_matched"] == 1
    critical = client.ok("GET", "/status/snapshot", query="q=CRITICAL")  # case does not matter
    assert critical["workers_matched"] == 40
    detail = client.ok("GET", "/status/snapshot", query="detail=100")["detail"]
    assert [(r["dp_rank"], r["severity"]) for r in detail["ranks"]][0] == (0, "critical")
    assert len(detail["ranks"]) == 4 and sum(r["active_requests"] for r in detail["ranks"]) == 1
    assert client.ok("GET", "/status/snapshot", query="detail=999")["detail"] is None


def _register(port: int, count: int, **extra: Any) -> None:
    """`count` workers over one keep-alive connection."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for worker_id in range(1, count + 1):
        body = json.dumps({"worker_id": worker_id, **WORKER, "endpoint": f"http://10.1.{worker_id // 250}."
                           f"{worker_id % 250}:8000", **extra})
        conn.request("POST", "/workers", body, {"content-type": "application/json", **BEARER})
        answer = conn.getresponse()
        assert answer.status == 201, answer.read()
        answer.read()
    conn.close()


def test_the_page_summarises_1000_workers_in_chromium(guarded: Server, browser: Browser) -> None:
    _register(guarded.port, 1000, data_parallel_size=2)
    for worker_id in (3, 500, 999):  # bookings that no event follows: no_events, critical, first
        call(guarded, "POST", "/reservations", {"reservation_id": f"r{worker_id}", "model_name": "m",
                                                "worker_id": worker_id, "token_ids": list(range(8))})
    call(guarded, "POST", "/select", {"model_name": "m", "token_ids": list(range(8)), "selection_id": "complaint-7"})
    browser.call("Page.navigate", url=f"http://viewer:{TOKEN}@127.0.0.1:{guarded.port}/status")
    browser.wait_for("document.querySelectorAll('#workers tr[data-worker]').length === 100")
    summary = browser.wait_for("(t => t.includes('critical 3') && t)(document.getElementById('summary').innerText)")
    assert "1,000" in summary and "schedulable 1000" in summary, summary
    severities = browser.evaluate("[...document.querySelectorAll('#workers tr')].map(r => r.dataset.severity)")
    assert severities[:3] == ["critical"] * 3 and set(severities[3:]) == {"info"}
    assert "showing 100 of 1000" in browser.evaluate("document.getElementById('shown').textContent")
    decided = browser.evaluate("document.getElementById('decisions').innerText")
    assert "complaint-7" in decided and ("ttft agrees" in decided or "ttft would choose" in decided), decided
    assert "shadow policy ttft" in summary and "achieved / achievable" in summary, summary
    # The filter keeps the matching rows; a click shows that worker's ranks.
    browser.evaluate("(f => { f.value = '10.1.3.227:'; f.dispatchEvent(new Event('input')); })"
                     "(document.getElementById('filter'))")
    browser.wait_for("document.querySelectorAll('#workers tr[data-worker]').length === 1")
    assert browser.evaluate(row(977) + " !== null")
    browser.evaluate(row(977) + ".click()")
    detail = browser.wait_for("(t => t.includes('2 rank(s)') && t)(document.getElementById('detail').innerText)")
    assert "worker 977, rank 1" in detail and "worker 977: 2 rank(s)" in detail, detail
    status, snapshot = api_call(guarded.port, "GET", "/status/snapshot", headers=BEARER)
    assert status == 200 and len(json.dumps(snapshot)) < 200_000
