"""The live status page `GET /status` serves (issue 33): one self-contained HTML document, nothing
fetched from elsewhere, that follows `GET /status/events` and redraws the fleet from each snapshot
(status.py). Text from the service (model names, endpoints, reasons) is only ever set as text, and
the page's own script and style are the only ones its Content-Security-Policy lets run."""

from __future__ import annotations

import base64
import hashlib
from typing import Final

__all__ = ["PAGE", "PAGE_HEADERS"]

_STYLE: Final = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f24;background:#fff}
h1{font-size:20px;margin:0 0 .2em}h2{font-size:16px;margin:1.4em 0 .4em}
#meta{color:#57606a}#live{font-weight:600;padding:0 .4em;border-radius:3px}
#live.on{background:#dafbe1;color:#116329}#live.off{background:#ffebe9;color:#a40e26}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:.25em .6em;border-bottom:1px solid #d0d7de;
vertical-align:top}th{background:#f6f8fa;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.state{font-weight:600;padding:0 .35em;border-radius:3px}.ok{background:#dafbe1;color:#116329}
.waiting{background:#eaeef2;color:#424a53}.bad{background:#ffebe9;color:#a40e26}.warn{background:#fff8c5;color:#7d4e00}
.why{color:#57606a;font-size:12px}.empty{color:#57606a;font-style:italic}
"""

_SCRIPT: Final = """
"use strict";
const BAD = new Set(["block_size_mismatch", "stale", "misses"]);
const el = (tag, text, cls) => { const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text); if (cls) e.className = cls; return e; };
const num = (v, digits) => v === null || v === undefined ? "-" :
  (digits === undefined ? String(v) : Number(v).toFixed(digits));
const age = (s) => s === null || s === undefined ? "never" : s < 60 ? s.toFixed(1) + " s" :
  s < 3600 ? (s / 60).toFixed(1) + " min" : (s / 3600).toFixed(1) + " h";
function row(cells) { const tr = document.createElement("tr");
  for (const c of cells) { const td = c instanceof Node ? c : el("td", c);
    if (!(c instanceof Node) && typeof c === "number") td.className = "n"; tr.append(td); } return tr; }
function fill(id, rows, columns, empty) { const body = document.getElementById(id);
  body.replaceChildren(...(rows.length ? rows : [row([Object.assign(el("td", empty, "empty"),
    {colSpan: columns})])])); }
function verdict(v) { const td = el("td"); const cls = v.state === "ok" ? "ok" : v.state === "waiting" ?
    "waiting" : BAD.has(v.state) ? "bad" : "warn";
  td.append(el("span", v.state, "state kv " + cls));
  for (const r of v.reasons) td.append(el("div", r, "why"));
  if (v.restarts) td.append(el("div", v.restarts + " engine restart(s) seen", "why")); return td; }
function workers(list) {
  fill("workers", list.map((w) => { const sum = (f) => w.ranks.reduce((a, r) => a + r[f], 0);
    const e = w.engine || {}; const life = el("td", w.lifecycle, "lifecycle");
    for (const r of w.not_schedulable_reasons) life.append(el("div", r, "why"));
    const id = el("td", w.worker_id); id.append(el("div", w.endpoint, "why"));
    const tr = row([id, w.model_name + " / " + w.tenant_id, life, verdict(w.kv_routing),
      sum("active_requests"), sum("prefill_tokens"), sum("decode_blocks"),
      w.engine ? num(e.running_requests) + " / " + num(e.waiting_requests) : "-",
      e.kv_usage === null || e.kv_usage === undefined ? "-" : (100 * e.kv_usage).toFixed(0) + "%",
      sum("index_blocks"), age(w.kv_routing.last_event_age_secs)]);
    tr.dataset.worker = w.worker_id; tr.dataset.state = w.kv_routing.state; return tr; }), 11, "no workers");
}
function queues(list) {
  fill("queues", list.map((q) => row([q.model_name + " / " + q.tenant_id, q.pending_count,
    q.pending_isl_tokens, q.active_reservations])), 4, "no schedulable workers");
}
function decisions(list) {
  fill("decisions", list.map((d) => { const r = d.runner_up;
    const tr = row([age(d.age_secs) + " ago", d.model_name + " / " + d.tenant_id, d.isl_tokens,
      d.worker_id + ":" + d.dp_rank + (d.plan ? " (" + d.plan.path + (d.plan.prefill ? ", prefill " +
        d.plan.prefill.worker_id + ":" + d.plan.prefill.dp_rank : "") + ": " + d.plan.reason + ")" : ""),
      d.cached_tokens,
      r ? r.worker_id + ":" + r.dp_rank + " (" + r.cached_tokens + " cached)" : "none", r ? num(r.margin, 4) : "-",
      d.candidates.map((c) => c.worker_id + ":" + c.dp_rank + " " + c.cached_tokens + " cached" +
        (c.predicted_wait_secs === null ? "" : ", wait " + num(c.predicted_wait_secs, 3) + " s")).join("; ") +
        (d.candidate_count > d.candidates.length ? " (of " + d.candidate_count + ")" : "")]);
    tr.dataset.worker = d.worker_id; return tr; }), 8, "no selection yet");
}
let last = 0;
function render(s) {
  document.getElementById("meta").textContent = "version " + s.version + " · policy " + s.policy +
    " · KV events " + s.kv_events + " · " + (s.ready ? "ready" : "not ready") + (s.serving ? "" : " · draining");
  workers(s.workers); queues(s.queues); decisions(s.decisions); last = Date.now();
}
function live(on) { const b = document.getElementById("live"); b.className = on ? "on" : "off";
  b.textContent = on ? "live" : "reconnecting"; }
const source = new EventSource("status/events");
source.onmessage = (m) => { live(true); render(JSON.parse(m.data)); };
source.onerror = () => live(false);
setInterval(() => { if (last && Date.now() - last > 5000) live(false); }, 1000);
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE: Final = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>selection-proto status</title>
<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_STYLE}</style></head>
<body><h1>selection-proto <span id="live" class="off">connecting</span></h1><div id="meta"></div>
<h2>Workers</h2><table><thead><tr><th>worker</th><th>model / tenant</th><th>lifecycle</th><th>KV routing</th>
<th>requests</th><th>prefill tokens</th><th>decode blocks</th><th>engine running / waiting</th><th>engine KV use</th>
<th>index blocks</th><th>last event</th></tr></thead><tbody id="workers"></tbody></table>
<h2>Queues</h2><table><thead><tr><th>model / tenant</th><th>queued</th><th>queued prompt tokens</th>
<th>reservations</th></tr></thead><tbody id="queues"></tbody></table>
<h2>Recent decisions</h2><table><thead><tr><th>when</th><th>model / tenant</th><th>prompt tokens</th>
<th>chosen</th><th>cached tokens</th><th>runner-up</th><th>margin</th><th>cheapest candidates</th></tr></thead>
<tbody id="decisions"></tbody></table>
<script>{_SCRIPT}</script></body></html>
""".encode()

# Only this page's script and style run, and it may talk only to the service that served it.
PAGE_HEADERS: Final = (
    ("content-security-policy", f"default-src 'none'; script-src {_sha256(_SCRIPT)}; style-src {_sha256(_STYLE)}; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
)
