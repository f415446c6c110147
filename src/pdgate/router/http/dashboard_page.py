"""The HTML of the router's `/dashboard` page: inline CSS and JS, no external assets.

It polls `state` next to its own path (`/dashboard/state`, also behind a path prefix) every
two seconds and renders with `textContent` and SVG attributes only, so engine URLs are never
parsed as HTML. The history charts are inline SVG step lines (one step per sampling
interval), one unit per chart, whose x axis spans the points collected so far: up to the
history span (15 minutes), and a single interval on a router just started.
"""

from __future__ import annotations

__all__ = ["PAGE"]

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>pdgate router</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2430; background: #f6f7f9; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 15px; margin: 20px 0 8px; }
  #about { color: #5b6574; margin-bottom: 16px; }
  .cards { display: flex; gap: 12px; flex-wrap: wrap; margin-bottom: 16px; }
  .card { background: #fff; border: 1px solid #dde1e7; border-radius: 6px; padding: 10px 14px;
          min-width: 120px; }
  .card .label { color: #5b6574; font-size: 12px; }
  .card .value { font-size: 20px; font-weight: 600; }
  table { border-collapse: collapse; background: #fff; width: 100%; max-width: 1100px; }
  th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #e5e8ec; }
  th { font-size: 12px; color: #5b6574; }
  .ok { color: #137333; font-weight: 600; }
  .bad { color: #b3261e; font-weight: 600; }
  .drain { color: #a15c00; font-weight: 600; }
  .charts { display: flex; gap: 12px; flex-wrap: wrap; }
  .chart { background: #fff; border: 1px solid #dde1e7; border-radius: 6px; padding: 8px; }
  .chart .label { color: #5b6574; font-size: 12px; }
  .chart svg { width: 260px; height: 70px; display: block; }
  .chart polyline { fill: none; stroke: #1a73e8; stroke-width: 1.5; }
  .chart line { stroke: #e5e8ec; stroke-width: 1; }
  #history-note { color: #5b6574; font-size: 12px; margin: -4px 0 8px; }
  .tables { display: flex; gap: 12px; flex-wrap: wrap; align-items: flex-start; }
  .tables table { width: auto; min-width: 320px; }
  #error { color: #b3261e; margin-top: 12px; }
</style>
</head>
<body>
<h1>pdgate router</h1>
<div id="about">...</div>
<div class="cards">
  <div class="card"><div class="label">Status</div><div class="value" id="ready">...</div></div>
  <div class="card"><div class="label">Requests / s</div><div class="value" id="rps">-</div></div>
  <div class="card"><div class="label">Errors / s</div><div class="value" id="eps">-</div></div>
  <div class="card"><div class="label">429 / s</div><div class="value" id="rejected">-</div></div>
  <div class="card"><div class="label">Tokens / s</div><div class="value" id="tps">-</div></div>
  <div class="card"><div class="label">KV transfers / s</div>
    <div class="value" id="kvps">-</div></div>
  <div class="card"><div class="label">Fallbacks / s</div>
    <div class="value" id="fps">-</div></div>
  <div class="card"><div class="label">Prefill usable</div>
    <div class="value" id="prefill-count">-</div></div>
  <div class="card"><div class="label">Decode usable</div>
    <div class="value" id="decode-count">-</div></div>
  <div class="card"><div class="label">In flight</div>
    <div class="value" id="in-flight">-</div></div>
  <div class="card"><div class="label" id="ttft-label">TTFT (recent)</div>
    <div class="value" id="ttft">-</div></div>
</div>
<table>
  <thead><tr><th>Role</th><th>Engine</th><th>Status</th><th>Breaker</th><th>In flight</th>
    <th>Failed in a row</th><th>KV-event batches</th><th>Model</th>
    <th>Engine queue (waiting / running)</th><th>Engine KV used</th></tr></thead>
  <tbody id="engines"></tbody>
</table>
<h2 id="history-title">Last 15 minutes</h2>
<div id="history-note">-</div>
<div class="charts" id="charts"></div>
<h2>KV and fallbacks (since start)</h2>
<div class="tables">
  <table>
    <thead><tr><th>KV figure</th><th>Total</th></tr></thead>
    <tbody id="kv"></tbody>
  </table>
  <table>
    <thead><tr><th>Fallback reason</th><th>Total</th></tr></thead>
    <tbody id="fallbacks"></tbody>
  </table>
</div>
<div id="error"></div>
<script>
"use strict";
const stateUrl = location.pathname.replace(/\\/$/, "") + "/state";
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
function ms(seconds) {
  return seconds === null ? "-" : (seconds * 1000).toFixed(1) + " ms";
}
function rate(x) {
  return x === null || x === undefined ? "-" : (x < 10 ? x.toFixed(2) : x.toFixed(0));
}
function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}
const STATUS_CLASS = {"healthy": "ok", "draining": "drain", "half-open": "drain"};
// [key in each history point, chart title]
const CHARTS = [["requests", "requests / s"], ["errors", "errors / s"],
  ["rejected", "429 / s"], ["tokens", "tokens / s"], ["kv_transfers", "KV transfers / s"],
  ["fallbacks", "fallbacks / s"]];
function buildCharts() {
  for (const [key] of CHARTS) {
    const box = document.createElement("div");
    box.className = "chart";
    const label = document.createElement("div");
    label.className = "label";
    label.id = "chart-" + key + "-label";
    const svg = document.createElementNS(SVG, "svg");
    svg.id = "chart-" + key;
    svg.setAttribute("viewBox", "0 0 260 70");
    svg.setAttribute("preserveAspectRatio", "none");
    box.append(label, svg);
    $("charts").appendChild(box);
  }
}
function chart(key, title, s) {
  // One step per sampling interval: the interval's rate from its start to its end.
  const svg = $("chart-" + key);
  const points = s.history;
  const values = points.map((p) => p[key]);
  const top = Math.max(1e-9, ...values);
  $("chart-" + key + "-label").textContent = title + " (max "
    + rate(values.length ? Math.max(...values) : null) + ")";
  const base = document.createElementNS(SVG, "line");
  for (const [k, v] of [["x1", 0], ["y1", 68.5], ["x2", 260], ["y2", 68.5]]) {
    base.setAttribute(k, v);
  }
  svg.replaceChildren(base);
  if (!points.length) return;
  const first = points[0].t - s.history_every_s;
  const width = Math.max(points[points.length - 1].t - first, 1e-9);
  const x = (t) => ((Math.max(t, first) - first) / width * 260).toFixed(1);
  const y = (v) => (68 - v / top * 66).toFixed(1);
  const xy = [];
  points.forEach((p, i) => {
    const start = i ? points[i - 1].t : p.t - s.history_every_s;
    xy.push(x(start) + "," + y(p[key]), x(p.t) + "," + y(p[key]));
  });
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", xy.join(" "));
  svg.appendChild(line);
}
function rows(id, pairs, empty) {
  const body = $(id);
  body.replaceChildren();
  for (const [name, n] of pairs.length ? pairs : [[empty, "-"]]) {
    const row = body.insertRow();
    cell(row, name);
    cell(row, String(n));
  }
}
function render(s) {
  $("about").textContent = "version " + s.version + " \\u00b7 mode " + s.mode
    + " \\u00b7 policies " + s.policies.prefill + " / " + s.policies.decode
    + " \\u00b7 discovery " + s.discovery + " \\u00b7 up " + Math.round(s.uptime_s) + " s";
  $("ready").textContent = s.ready ? "ready" : "not ready";
  $("ready").className = "value " + (s.ready ? "ok" : "bad");
  const now = s.now || {};
  $("rps").textContent = rate(now.requests);
  $("eps").textContent = rate(now.errors);
  $("rejected").textContent = rate(now.rejected);
  $("tps").textContent = rate(now.tokens);
  $("kvps").textContent = rate(now.kv_transfers);
  $("fps").textContent = rate(now.fallbacks);
  const usable = (role) => s.engines.filter(
    (e) => e.role === role && e.status === "healthy").length;
  $("prefill-count").textContent = usable("prefill");
  $("decode-count").textContent = usable("decode");
  $("in-flight").textContent = s.engines.reduce((n, e) => n + e.in_flight, 0);
  $("ttft-label").textContent = "TTFT p50 / p95 from arrival, last "
    + Math.round(s.ttft.window_s) + " s (" + s.ttft.count + " streams)";
  $("ttft").textContent = ms(s.ttft.p50_s) + " / " + ms(s.ttft.p95_s);
  const body = $("engines");
  body.replaceChildren();
  for (const e of s.engines) {
    const row = body.insertRow();
    row.className = "engine";
    row.dataset.role = e.role;
    cell(row, e.role);
    cell(row, e.url, "url");
    cell(row, e.status, STATUS_CLASS[e.status] || "bad");
    cell(row, e.breaker, e.breaker === "closed" ? "" : "bad");
    cell(row, String(e.in_flight));
    cell(row, String(e.consecutive_errors));
    cell(row, e.kv_event_batches === null ? "-" : String(e.kv_event_batches));
    cell(row, e.model);
    cell(row, e.waiting === null ? "-" : e.waiting + " / " + e.running);
    cell(row, e.kv_usage === null ? "-" : Math.round(e.kv_usage * 100) + " %");
  }
  $("history-title").textContent = "Last " + Math.round(s.history_span_s / 60) + " minutes";
  const h = s.history;
  $("history-note").textContent = (h.length ? Math.round(h[h.length - 1].t - h[0].t
    + s.history_every_s) : 0) + " s collected so far, one point every "
    + s.history_every_s + " s; the charts span what was collected";
  for (const [key, title] of CHARTS) chart(key, title, s);
  const kv = [["KV transfers (prefill legs that handed KV to decode)", s.kv.kv_transfers]];
  for (const [index, n] of Object.entries(s.kv.prefix_index_entries)) {
    kv.push(["prefix index " + index + " entries", n]);
  }
  for (const [result, n] of Object.entries(s.kv.kv_aborts)) {
    kv.push(["KV frees asked (" + result + ")", n]);
  }
  rows("kv", kv, "");
  rows("fallbacks", Object.entries(s.kv.fallbacks), "none");
  $("error").textContent = "";
  document.body.dataset.loaded = "true";
}
async function refresh() {
  try {
    const reply = await fetch(stateUrl, {cache: "no-store"});
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    render(await reply.json());
  } catch (err) {
    $("error").textContent = "cannot load the router state: " + err.message;
  }
}
buildCharts();
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"""
