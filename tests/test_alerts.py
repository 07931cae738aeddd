"""The alert rules and the dashboard that ship with the service (deploy/prometheus/alerts.yaml,
deploy/grafana/selection-proto.json, docs/VERDICT.md): the rules' `promtool` unit tests pass, every metric
the rules and the panels read is one `/metrics` declares, and a real Prometheus (Debian's
`prometheus`) scraping a running `serve` reads the verdict, loads the rules healthy, evaluates
every panel's query and shows prefill/decode plans made through `serve` in the P/D panels; the
rules' severities and docs/VERDICT.md's table of alerts agree. Without `promtool` and `prometheus`
on the PATH these tests fail (README's test command installs them)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from test_http import Server, api_call
from test_subscriptions import free_port

from selection_proto.core.base.metrics import FAMILIES
from selection_proto.core.fleet.verdict import SEVERITY, SEVERITY_ORDER, STATES
from selection_proto.core.status_page import PAGE

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "selection-proto.json"


def panel_queries(title_prefix: str = "") -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"].startswith(title_prefix)
            for t in p["targets"]]


def tool(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} is not installed: apt-get install prometheus (README's test command does)"
    return found


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    checked = subprocess.run([tool("promtool"), "check", "rules", str(RULES / "alerts.yaml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    tested = subprocess.run([tool("promtool"), "test", "rules", "alerts_test.yaml"], cwd=RULES,
                            capture_output=True, text=True, timeout=60)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_metric_a_rule_or_a_panel_reads_is_served() -> None:
    rules = yaml.safe_load((RULES / "alerts.yaml").read_text())["groups"][0]["rules"]
    exprs = [rule["expr"] for rule in rules] + panel_queries()
    read = {re.sub(r"_(bucket|sum|count)$", "", name) for e in exprs for name in re.findall(r"\b(selection_proto_[a-z_]+)", e)}
    assert len(read) >= 15 and read <= set(FAMILIES), read - set(FAMILIES)


def _rule_states(expr: str) -> set[str]:
    """The verdict states a rule on `selection_proto_kv_routing_state` fires for."""
    matcher = re.search(r'selection_proto_kv_routing_state\{state(=~|=)"([^"]+)"\}', expr)
    if matcher is None:
        return set()
    op, value = matcher.groups()
    return {s for s in STATES if (re.fullmatch(value, s) if op == "=~" else s == value)}


def _doc_table(path: Path, header: str) -> list[list[str]]:
    """The rows of the markdown table under `header` (its first line), cells stripped of backticks."""
    lines = path.read_text().splitlines()
    start = lines.index(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.replace("`", "").strip() for cell in line.strip("|").split("|")])
    return rows


def test_severity_is_one_scale_for_the_page_the_alerts_and_the_docs() -> None:
    """Each verdict state has one severity: the status snapshot's (the page colours by it), the
    `severity` label of the rule that alerts on it, and docs/VERDICT.md's and docs/STATUS.md's."""
    rules = yaml.safe_load((RULES / "alerts.yaml").read_text())["groups"][0]["rules"]
    alerted: dict[str, str] = {}
    for rule in rules:
        for state in _rule_states(rule["expr"]):
            assert state not in alerted, f"{state} has two rules"
            alerted[state] = rule["labels"]["severity"]
    # Every state worse than info pages someone, at its severity; info and ok never alert.
    assert alerted == {s: v for s, v in SEVERITY.items() if v in ("warning", "critical")}
    # The rules on other numbers (plans orphaned, the queue timing out, ...) use the same scale.
    assert {rule["labels"]["severity"] for rule in rules} <= set(SEVERITY_ORDER) - {"ok"}
    verdict_doc = {row[0]: row[1] for row in _doc_table(ROOT / "docs" / "VERDICT.md",
                                                         "| state | severity | when | what to do |")}
    assert {s.removesuffix(", restarting"): v for s, v in verdict_doc.items()} == SEVERITY
    status_doc = {state.strip(): row[0] for row in _doc_table(ROOT / "docs" / "STATUS.md",
                                                                        "| severity | states | colour |")
                  for state in row[1].split(",")}
    assert status_doc == SEVERITY
    page = PAGE.decode()
    assert "no_events" not in page and "critical" in page  # colours come from the snapshot's severity


def test_every_rule_is_in_the_docs_with_its_severity() -> None:
    """docs/VERDICT.md's table of alerts names every rule, at the severity the rule pages with."""
    rules = yaml.safe_load((RULES / "alerts.yaml").read_text())["groups"][0]["rules"]
    documented = {row[0]: row[2] for row in _doc_table(ROOT / "docs" / "VERDICT.md", "| alert | when | severity |")}
    assert documented == {rule["alert"]: rule["labels"]["severity"] for rule in rules}


def query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.request.quote(expr)}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        body = json.loads(answer.read())
    assert body["status"] == "success", body
    return body["data"]["result"]  # type: ignore[no-any-return]


EXPIRY = 1.0  # seconds: `serve --active-request-expiry-secs`, so that an unended plan is an orphan soon


def _plan_round(port: int, n: int) -> None:
    """On key `pd`, a remote plan handed off and ended, three local plans ended and a remote plan
    left unended (an orphan, expired by a later round's plans); on key `pd-local` (no prefill
    worker), a local plan ended (docs/PD.md)."""
    for i, (model, path) in enumerate((("pd", "remote"), ("pd", "local"), ("pd", "local"), ("pd", "local"),
                                       ("pd-local", "local"), ("pd", "remote"))):
        plan_id = f"{n}-{i}"
        status, plan = api_call(port, "POST", "/select_pd_and_reserve", {
            "model_name": model, "token_ids": list(range(1, 41)), "plan_id": plan_id, "pd": {"mode": path}})
        assert status == 200 and plan["path"] == path, plan
        if i == 5:
            break  # the orphan
        if path == "remote":
            assert api_call(port, "POST", f"/plans/{plan_id}/handoff")[1]["released"] == ["prefill"]
        assert api_call(port, "DELETE", f"/plans/{plan_id}")[0] == 200


def _eventually(port: int, expr: str, wanted: dict[tuple[tuple[str, str], ...], float | None],
                deadline: float) -> None:
    """Wait until `expr` answers `wanted`, {labels: value} (None: any value above 0), for the keys
    `pd` and `pd-local`."""
    while True:
        found = {tuple(sorted(r["metric"].items())): float(r["value"][1])
                 for r in query(port, expr) if r["metric"].get("model_name", "").startswith("pd")}
        if found.keys() == wanted.keys() and all(
                value > 0 if (expected := wanted[labels]) is None else abs(value - expected) < 1e-9
                for labels, value in found.items()):
            return
        assert time.monotonic() < deadline, (expr, found)
        time.sleep(0.5)


def _the_pd_panels_show_plans(service: int, port: int) -> None:
    """The P/D panels, evaluated by Prometheus, show plans by path and decider, the remote share
    (0 on a key whose plans are all local), handoffs and ends beside the plans booked, and orphans
    expired; no compensation."""
    for wid, model, role in ((8, "pd", "prefill"), (9, "pd", "both"), (10, "pd-local", "both")):
        assert api_call(service, "POST", "/workers", {"worker_id": wid, "model_name": model, "block_size": 4,
                                                      "endpoint": f"http://w{wid}", "role": role})[0] == 201
    pd, pd_local = ("model_name", "pd"), ("model_name", "pd-local")
    deadline = time.monotonic() + 90
    # A rate needs a series to grow after its first scrape: a round, its counts scraped, the
    # expiry passed (the next round's plans expire the round's orphan), the next round.
    for n in (1, 2, 3):
        _plan_round(service, n)
        if n < 3:
            started = time.monotonic()
            _eventually(port, "sum by (model_name, path) (selection_proto_pd_plans_total)",
                        {(pd, ("path", "local")): 3 * n, (pd, ("path", "remote")): 2 * n,
                         (pd_local, ("path", "local")): n}, deadline)
            time.sleep(max(0.0, started + EXPIRY + 0.1 - time.monotonic()))
    plans, share, events, failures = (panel_queries(title) for title in (
        "P/D plans", "P/D remote share", "P/D handoffs", "P/D orphans"))
    # A forced path's decider is the default, isl_bounding.
    _eventually(port, plans[0], {(("decider", "isl_bounding"), pd, ("path", "local")): None,
                                 (("decider", "isl_bounding"), pd, ("path", "remote")): None,
                                 (("decider", "isl_bounding"), pd_local, ("path", "local")): None}, deadline)
    _eventually(port, share[0], {(pd,): 0.4, (pd_local,): 0.0}, deadline)
    _eventually(port, events[0], {(("event", "ended"), pd): None, (("event", "handoff"), pd): None,
                                  (("event", "ended"), pd_local): None}, deadline)
    _eventually(port, events[1], {(pd, ("path", "local")): None, (pd, ("path", "remote")): None,
                                  (pd_local, ("path", "local")): None}, deadline)
    _eventually(port, failures[0], {(("event", "orphan_expired"), pd): None}, deadline)


def test_a_real_prometheus_scrapes_the_verdict_and_loads_the_rules(tmp_path: Path) -> None:
    server = Server("--active-request-expiry-secs", str(EXPIRY), mode="push")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES / "alerts.yaml")],
        "scrape_configs": [{"job_name": "selection-proto", "static_configs": [
            {"targets": [f"127.0.0.1:{server.port}"]}]}]}))
    prometheus = subprocess.Popen([tool("prometheus"), f"--config.file={config}",
                                   f"--storage.tsdb.path={tmp_path / 'data'}",
                                   f"--web.listen-address=127.0.0.1:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert api_call(server.port, "POST", "/workers", {"worker_id": 7, "model_name": "m", "block_size": 4,
                                                          "endpoint": "http://w7"})[0] == 201
        deadline = time.monotonic() + 60
        while True:
            try:
                found = query(port, 'selection_proto_kv_routing_state{worker_id="7"} == 1')
                if found:
                    break
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline and prometheus.poll() is None, "no verdict scraped"
            time.sleep(0.5)
        assert [r["metric"]["state"] for r in found] == ["waiting"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=10) as answer:
            groups = json.loads(answer.read())["data"]["groups"]
        rules = {r["name"]: r["health"] for g in groups for r in g["rules"]}
        assert len(rules) == 12 and set(rules.values()) == {"ok"}, rules
        for expr in panel_queries():  # each parses and evaluates (raises on an error)
            query(port, expr)
        _the_pd_panels_show_plans(server.port, port)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
        server.stop()
