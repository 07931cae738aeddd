"""The live status page `GET /status` serves (docs/STATUS.md): one self-contained HTML document,
nothing fetched from elsewhere, that follows `GET /status/events` (with the viewer's filter and the
worker it opened) and redraws the fleet from each snapshot (status.py): the summary first, the
workers worst first, one worker's ranks on demand, the decisions in words. Text from the service
(model names, endpoints, reasons) is only ever set as text, and the page's own script and style are
the only ones its Content-Security-Policy lets run."""

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
.state{font-weight:600;padding:0 .35em;border-radius:3px;margin-right:.3em}.ok{background:#dafbe1;color:#116329}
.info{background:#eaeef2;color:#424a53}.critical{background:#ffebe9;color:#a40e26}.warning{background:#fff8c5;color:#7d4e00}
.why{color:#57606a;font-size:12px}.empty{color:#57606a;font-style:italic}
#summary{display:flex;flex-wrap:wrap;gap:.8em}.card{border:1px solid #d0d7de;border-radius:6px;padding:.5em .8em;min-width:14em}
.card b{display:block;font-size:12px;color:#57606a;font-weight:600}.big{font-size:18px;font-weight:600}
#workers tr{cursor:pointer}#workers tr.open{background:#f6f8fa}#filter{font:inherit;padding:.2em .4em;width:24em}
"""

_SCRIPT: Final = """
"use strict";
const el = (tag, text, cls) => { const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text); if (cls) e.className = cls; return e; };
const num = (v, digits) => v === null || v === undefined ? "-" :
  (digits === undefined ? Number(v).toLocaleString("en") : Number(v).toFixed(digits));
const pct = (v) => v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%";
const age = (s) => s === null || s === undefined ? "never" : s < 60 ? s.toFixed(1) + " s" :
  s < 3600 ? (s / 60).toFixed(1) + " min" : (s / 3600).toFixed(1) + " h";
const rank = (w, r) => "worker " + w + ", rank " + r;
const secs = (v) => v === null || v === undefined ? "-" : Number(v).toFixed(3) + " s";
function row(cells) { const tr = document.createElement("tr");
  for (const c of cells) { const td = c instanceof Node ? c : el("td", c);
    if (!(c instanceof Node) && typeof c === "number") td.className = "n"; tr.append(td); } return tr; }
function fill(id, rows, columns, empty) { const body = document.getElementById(id);
  body.replaceChildren(...(rows.length ? rows : [row([Object.assign(el("td", empty, "empty"),
    {colSpan: columns})])])); }
function badge(state, severity) { return el("span", state, "state kv " + severity); }
function card(title, lines) { const c = el("div", null, "card"); c.append(el("b", title));
  lines.forEach((l, i) => c.append(el("div", l, i === 0 ? "big" : "why"))); return c; }
function lost(map) { const parts = Object.entries(map).filter(([, v]) => v > 0).map(([k, v]) => k + " " + num(v));
  return parts.length ? "lost: " + parts.join(", ") : "nothing lost"; }
function shadowText(sh, policy) { return sh ? policy + " disagrees on " + pct(sh.disagreement_rate) + " of " +
  num(sh.scored) : "-"; }
function summary(s) { const m = s.summary, w = m.workers; const bySev = w.by_severity;
  const states = Object.entries(w.by_state).filter(([, n]) => n > 0).map(([k, n]) => k + " " + n).join(", ");
  const cards = [
    card("workers", [num(w.total), Object.entries(w.by_lifecycle).map(([k, n]) => k + " " + n).join(", "),
      "critical " + bySev.critical + ", warning " + bySev.warning + ", info " + bySev.info + ", ok " + bySev.ok,
      states]),
    card("last " + Math.round(m.window_secs) + " s", [num(m.selections_per_sec, 2) + " selections/s",
      num(m.refusals_per_sec, 2) + " refusals/s", num(m.errors_per_sec, 2) + " errors/s",
      num(m.pending_count) + " queued"]),
    card("cached tokens: achieved / achievable", [pct(m.achieved_hit_rate) + " / " + pct(m.achievable_hit_rate),
      "routing kept " + pct(m.routing_efficiency) + " of what was cached", lost(m.lost_cached_tokens)]),
    card("engines' own hit rate", [pct(m.engine_hit_rate), m.engine_workers_reporting + " workers report one",
      "observed / predicted cached: " + pct(m.observed_hit_rate)])];
  if (s.shadow_policy) { const sh = m.shadow;
    cards.push(card("shadow policy " + s.shadow_policy, [sh ? pct(sh.disagreement_rate) + " disagree" : "-",
      sh ? "of " + num(sh.scored) + " selections" : "no selection yet",
      sh ? "mean predicted TTFT: " + s.policy + " " + secs(sh.mean_predicted_ttft_secs.acting) + ", " +
        s.shadow_policy + " " + secs(sh.mean_predicted_ttft_secs.shadow) : ""])); }
  document.getElementById("summary").replaceChildren(...cards);
  fill("keys", s.keys.map((k) => { const lanes = el("td", k.pending_count);
    for (const l of k.lanes) lanes.append(el("div", "priority " + l.priority + " " + l.policy_class + ": " + l.queued +
      " queued, " + num(l.queued_uncached_tokens) + " tokens, " + l.fairness_ids + " fairness IDs", "why"));
    const hits = el("td", pct(k.achieved_hit_rate) + " / " + pct(k.achievable_hit_rate));
    hits.append(el("div", lost(k.lost_cached_tokens), "why"));
    return row([k.model_name + " / " + k.tenant_id, num(k.selections_per_sec, 2), num(k.refusals_per_sec, 2), hits,
      pct(k.routing_efficiency), pct(k.engine_hit_rate), shadowText(k.shadow, s.shadow_policy), lanes,
      k.active_reservations]); }), 9, "no schedulable workers");
}
function verdict(v) { const td = el("td"); td.append(badge(v.state, v.severity));
  for (const r of v.reasons) td.append(el("div", r, "why"));
  if (v.more_reasons) td.append(el("div", "and " + v.more_reasons + " more (open the worker)", "why"));
  if (v.restarts) td.append(el("div", v.restarts + " engine restart(s) seen", "why")); return td; }
function workers(s) {
  document.getElementById("shown").textContent = "showing " + s.workers.length + " of " + s.workers_matched +
    (s.filter.q ? " matching" : "") + " (" + s.summary.workers.total + " in all), worst first";
  fill("workers", s.workers.map((w) => { const e = w.engine || {}; const life = el("td", w.lifecycle, "lifecycle");
    for (const r of w.not_schedulable_reasons) life.append(el("div", r, "why"));
    const id = el("td", w.worker_id); id.append(el("div", w.endpoint, "why"));
    const v = w.kv_routing;
    const tr = row([id, w.model_name + " / " + w.tenant_id, life, verdict(v), w.dp_size,
      w.active_requests, w.prefill_tokens, w.decode_blocks,
      w.engine ? num(e.running_requests) + " / " + num(e.waiting_requests) : "-",
      e.kv_usage === null || e.kv_usage === undefined ? "-" : (100 * e.kv_usage).toFixed(0) + "%",
      pct(e.prefix_cache_hit_rate),
      v.observations ? num(v.observed_cached_tokens) + " / " + num(v.predicted_cached_tokens) : "-",
      w.index_blocks, age(v.last_event_age_secs)]);
    tr.dataset.worker = w.worker_id; tr.dataset.state = v.state; tr.dataset.severity = v.severity;
    if (w.worker_id === detail) tr.className = "open"; return tr; }), 14, "no workers");
}
function details(d) { const box = document.getElementById("detail");
  if (!d) { box.replaceChildren(detail === null ? el("p", "click a worker to see its ranks", "empty") :
    el("p", "worker " + detail + " is not in the catalog", "empty")); return; }
  const t = el("table"); const head = el("tr");
  for (const h of ["rank", "KV routing", "requests", "prefill tokens", "decode blocks", "index blocks"]) head.append(el("th", h));
  t.append(head);
  for (const r of d.ranks) { const v = el("td"); v.append(badge(r.state, r.severity));
    for (const x of r.reasons) v.append(el("div", x, "why"));
    t.append(row([rank(d.worker_id, r.dp_rank), v, r.active_requests, r.prefill_tokens, r.decode_blocks, r.index_blocks])); }
  box.replaceChildren(el("h3", "worker " + d.worker_id + ": " + d.ranks.length + " rank(s)"), t); }
function decisions(s) {
  fill("decisions", s.decisions.map((d) => { const r = d.runner_up;
    const chosen = el("td", rank(d.worker_id, d.dp_rank), "chosen");
    if (d.predicted_ttft_secs !== null) chosen.append(el("div", "predicted TTFT " + secs(d.predicted_ttft_secs), "why"));
    if (d.plan) chosen.append(el("div", d.plan.path + " plan" + (d.plan.prefill ? ", prefill on " +
      rank(d.plan.prefill.worker_id, d.plan.prefill.dp_rank) : "") + ": " + d.plan.reason, "why"));
    const cached = el("td", num(d.cached_tokens) + " of " + num(d.achievable_cached_tokens) + " achievable");
    if (d.loss_reason) cached.append(el("div", "fewer because of " + d.loss_reason, "why"));
    let runner = "none", margin = "-";
    if (r) { runner = rank(r.worker_id, r.dp_rank) + " (" + r.cached_tokens + " cached)";
      margin = r.tied ? "tie: the same cost (" + d.margin_unit + "); the choice among equals went to the rank " +
        "with fewest cached blocks, then at random" : r.margin > 0 ? "costs " + num(r.margin, 4) + " " +
        d.margin_unit + " more" : "costs " + num(-r.margin, 4) + " " + d.margin_unit + " less (drawn at temperature > 0)"; }
    const sh = d.shadow; let shadow = "-";
    if (sh) shadow = sh.agrees ? s.shadow_policy + " agrees" : s.shadow_policy + " would choose " +
      rank(sh.worker_id, sh.dp_rank) + " (" + sh.cached_tokens + " cached), predicted TTFT " +
      secs(sh.predicted_ttft_secs) + " against " + secs(d.predicted_ttft_secs);
    const tr = row([age(d.age_secs) + " ago", d.model_name + " / " + d.tenant_id, d.request_id === null ? "-" : d.request_id,
      d.isl_tokens, chosen, cached, el("td", runner, "runner"), el("td", margin, "margin"), el("td", shadow, "shadow"),
      d.candidates.map((c) => rank(c.worker_id, c.dp_rank) + ": " + c.cached_tokens + " cached, cost " +
        num(c.logit, 4) + (c.predicted_wait_secs === null ? "" : ", wait " + secs(c.predicted_wait_secs))).join("; ") +
        (d.candidate_count > d.candidates.length ? " (of " + d.candidate_count + ")" : "")]);
    tr.dataset.worker = d.worker_id; return tr; }), 10, "no selection yet");
}
let last = 0, detail = null, source = null;
function render(s) {
  document.getElementById("meta").textContent = "version " + s.version + " · policy " + s.policy +
    (s.shadow_policy ? " · shadow " + s.shadow_policy : "") + " · KV events " + s.kv_events + " · " +
    (s.ready ? "ready" : "not ready") + (s.serving ? "" : " · draining");
  summary(s); workers(s); details(s.detail); decisions(s); last = Date.now();
}
function live(on) { const b = document.getElementById("live"); b.className = on ? "on" : "off";
  b.textContent = on ? "live" : "reconnecting"; }
function follow() { if (source) source.close();
  const q = document.getElementById("filter").value.trim();
  const params = new URLSearchParams(); if (q) params.set("q", q); if (detail !== null) params.set("detail", detail);
  source = new EventSource("status/events" + (params.toString() ? "?" + params : ""));
  source.onmessage = (m) => { live(true); render(JSON.parse(m.data)); };
  source.onerror = () => live(false); }
let typing = 0;
document.getElementById("filter").addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(follow, 300); });
document.getElementById("workers").addEventListener("click", (e) => { const tr = e.target.closest("tr[data-worker]");
  if (!tr) return; const id = Number(tr.dataset.worker); detail = detail === id ? null : id; follow(); });
follow();
setInterval(() => { if (last && Date.now() - last > 5000) live(false); }, 1000);
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE: Final = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>selection-proto status</title>
<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_STYLE}</style></head>
<body><h1>selection-proto <span id="live" class="off">connecting</span></h1><div id="meta"></div>
<h2>Summary</h2><div id="summary"></div>
<h2>Keys</h2><table><thead><tr><th>model / tenant</th><th>selections/s</th><th>refusals/s</th>
<th>cached tokens achieved / achievable</th><th>routing kept</th><th>engines' hit rate</th><th>shadow</th>
<th>queued, by lane</th><th>reservations</th></tr></thead><tbody id="keys"></tbody></table>
<h2>Workers</h2><p><input id="filter" type="search" placeholder="filter: id, endpoint, model, state, severity"
aria-label="filter workers"> <span id="shown" class="why"></span></p>
<table><thead><tr><th>worker</th><th>model / tenant</th><th>lifecycle</th><th>KV routing</th><th>ranks</th>
<th>requests</th><th>prefill tokens</th><th>decode blocks</th><th>engine running / waiting</th><th>engine KV use</th>
<th>engine hit rate</th><th>observed / predicted cached</th><th>index blocks</th><th>last event</th></tr></thead>
<tbody id="workers"></tbody></table><div id="detail"></div>
<h2>Recent decisions</h2><table><thead><tr><th>when</th><th>model / tenant</th><th>request</th><th>prompt tokens</th>
<th>chosen</th><th>cached tokens</th><th>runner-up</th><th>margin</th><th>shadow</th><th>cheapest candidates</th></tr></thead>
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
