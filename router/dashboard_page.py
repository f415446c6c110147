"""The HTML of the router's `/dashboard` page: inline CSS and JS, no external assets.

It polls `state` next to its own path (`/dashboard/state`, also behind a path prefix) every
two seconds and renders with `textContent` only, so engine URLs are never parsed as HTML.
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
  h1 { font-size: 20px; margin: 0 0 16px; }
  .cards { display: flex; gap: 12px; flex-wrap: wrap; margin-bottom: 16px; }
  .card { background: #fff; border: 1px solid #dde1e7; border-radius: 6px; padding: 10px 14px;
          min-width: 140px; }
  .card .label { color: #5b6574; font-size: 12px; }
  .card .value { font-size: 20px; font-weight: 600; }
  table { border-collapse: collapse; background: #fff; width: 100%; max-width: 960px; }
  th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #e5e8ec; }
  th { font-size: 12px; color: #5b6574; }
  .ok { color: #137333; font-weight: 600; }
  .bad { color: #b3261e; font-weight: 600; }
  .drain { color: #a15c00; font-weight: 600; }
  #error { color: #b3261e; margin-top: 12px; }
</style>
</head>
<body>
<h1>pdgate router</h1>
<div class="cards">
  <div class="card"><div class="label">Status</div><div class="value" id="ready">...</div></div>
  <div class="card"><div class="label">Prefill healthy</div>
    <div class="value" id="prefill-count">-</div></div>
  <div class="card"><div class="label">Decode healthy</div>
    <div class="value" id="decode-count">-</div></div>
  <div class="card"><div class="label">In flight</div>
    <div class="value" id="in-flight">-</div></div>
  <div class="card"><div class="label" id="ttft-label">TTFT (recent)</div>
    <div class="value" id="ttft">-</div></div>
</div>
<table>
  <thead><tr><th>Role</th><th>Engine</th><th>Health</th><th>In flight</th></tr></thead>
  <tbody id="engines"></tbody>
</table>
<div id="error"></div>
<script>
"use strict";
const stateUrl = location.pathname.replace(/\\/$/, "") + "/state";
const $ = (id) => document.getElementById(id);
function ms(seconds) {
  return seconds === null ? "-" : (seconds * 1000).toFixed(1) + " ms";
}
function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}
function render(s) {
  $("ready").textContent = s.ready ? "ready" : "not ready";
  $("ready").className = "value " + (s.ready ? "ok" : "bad");
  const usable = (role) => s.engines.filter(
    (e) => e.role === role && e.healthy && !e.draining).length;
  $("prefill-count").textContent = usable("prefill");
  $("decode-count").textContent = usable("decode");
  $("in-flight").textContent = s.engines.reduce((n, e) => n + e.in_flight, 0);
  $("ttft-label").textContent = "TTFT p50 / p95, last " + Math.round(s.ttft.window_s) + " s ("
    + s.ttft.count + " req)";
  $("ttft").textContent = ms(s.ttft.p50_s) + " / " + ms(s.ttft.p95_s);
  const body = $("engines");
  body.replaceChildren();
  for (const e of s.engines) {
    const row = body.insertRow();
    row.className = "engine";
    row.dataset.role = e.role;
    cell(row, e.role);
    cell(row, e.url, "url");
    if (e.draining) cell(row, "draining", "drain");
    else cell(row, e.healthy ? "healthy" : "unhealthy", e.healthy ? "ok" : "bad");
    cell(row, String(e.in_flight));
  }
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
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"""
