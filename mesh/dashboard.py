"""`GET /dashboard`: one self-contained HTML page (no build step, nothing loaded from elsewhere).

It polls the mesh's own `/workers`, `/kv/ledger` and `/metrics` every 2 s. When the mesh has an
admin token, open it as `/dashboard#token=<admin token>` (the fragment never leaves the browser).
"""

from __future__ import annotations

from aiohttp import web

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Atomesh</title>
<style>
 body{font:14px system-ui,sans-serif;margin:24px;color:#1d2330;background:#f6f7f9}
 h1{font-size:20px;margin:0 0 4px} h2{font-size:15px;margin:22px 0 8px}
 .sub{color:#667} table{border-collapse:collapse;background:#fff;min-width:640px}
 th,td{padding:6px 10px;border-bottom:1px solid #e3e6ea;text-align:left} th{background:#eef0f3}
 .ok{color:#137333;font-weight:600} .bad{color:#b3261e;font-weight:600} .stat{display:inline-block;
 background:#fff;border:1px solid #e3e6ea;border-radius:6px;padding:10px 16px;margin-right:10px}
 .stat b{display:block;font-size:20px}
</style></head><body>
<h1>Atomesh</h1><div class="sub" id="meta">loading...</div>
<div style="margin-top:14px"><span class="stat"><b id="rps">-</b>requests/s</span>
<span class="stat"><b id="lat">-</b>mean latency (ms)</span><span class="stat"><b id="held">-</b>KV transfers held</span>
<span class="stat"><b id="err">-</b>upstream errors</span></div>
<h2>Prefill pipelines</h2><table id="prefill"></table>
<h2>Decode engines</h2><table id="decode"></table>
<h2>KV held per pipeline</h2><table id="kv"></table>
<script>
const token = (location.hash.match(/token=([^&]+)/) || [])[1];
const headers = token ? {Authorization: "Bearer " + decodeURIComponent(token)} : {};
let last = null;
const esc = s => String(s).replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
function table(id, cols, rows) {
  const t = document.getElementById(id);
  t.innerHTML = "<tr>" + cols.map(c => "<th>" + c + "</th>").join("") + "</tr>" +
    (rows.length ? rows.map(r => "<tr>" + r.map(v => "<td>" + v + "</td>").join("") + "</tr>").join("")
                 : "<tr><td colspan=" + cols.length + ">none</td></tr>");
}
function metric(text, name) {
  let sum = 0;
  for (const line of text.split("\n")) if (line.startsWith(name)) sum += parseFloat(line.split(" ").pop()) || 0;
  return sum;
}
async function tick() {
  try {
    const [w, l, m] = await Promise.all([fetch("/workers", {headers}).then(r => r.json()),
      fetch("/kv/ledger", {headers}).then(r => r.json()), fetch("/metrics").then(r => r.text())]);
    if (w.error) throw new Error(w.error.message);
    document.getElementById("meta").textContent = w.mesh_id + " - " + w.mode.toUpperCase() + " mode - " +
      w.workers.length + " workers";
    const health = x => x.kv_unaccounted ? '<span class="bad">KV leak: ' + x.kv_unaccounted + ' blocks unaccounted</span>'
      : x.healthy ? '<span class="ok">healthy</span>' : '<span class="bad">unhealthy</span>';
    table("prefill", ["id", "model", "stages (layers)", "health", "draining", "in flight", "held", "free blocks"],
      w.workers.filter(x => x.role === "prefill").map(x => [esc(x.id), esc(x.model),
        (x.record.stages || []).map(s => s.pp_rank + ": " + s.layers.join("-")).join(", ") || "pp=" + x.record.pp_size,
        health(x), x.draining ? "yes" : "no", x.in_flight, x.load ? x.load.held_transfers : "-",
        x.load ? x.load.free_blocks + " / " + x.load.num_blocks : "-"]));
    table("decode", ["id", "model", "tp", "health", "draining", "in flight"],
      w.workers.filter(x => x.role !== "prefill").map(x => [esc(x.id), esc(x.model), x.record.tp_size, health(x),
        x.draining ? "yes" : "no", x.in_flight]));
    table("kv", ["pipeline", "transfers", "blocks", "oldest (s)"],
      Object.entries(l.held).map(([k, v]) => [esc(k), v.transfers, v.blocks, v.oldest_age_s]));
    const now = {t: Date.now() / 1000, n: metric(m, "atomesh_requests_total"),
                 s: metric(m, "atomesh_request_duration_seconds_sum"), c: metric(m, "atomesh_request_duration_seconds_count")};
    if (last) {
      const dt = now.t - last.t, dn = now.c - last.c;
      document.getElementById("rps").textContent = ((now.n - last.n) / dt).toFixed(1);
      document.getElementById("lat").textContent = dn > 0 ? (1000 * (now.s - last.s) / dn).toFixed(1) : "-";
    }
    last = now;
    document.getElementById("held").textContent = Object.values(l.held).reduce((a, v) => a + v.transfers, 0);
    document.getElementById("err").textContent = metric(m, "atomesh_upstream_errors_total");
  } catch (e) {
    document.getElementById("meta").textContent = "cannot read the mesh: " + e.message;
  }
}
tick(); setInterval(tick, 2000);
</script></body></html>
"""


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html",
                        headers={"Cache-Control": "no-store", "Content-Security-Policy": "default-src 'self' "
                                 "'unsafe-inline'; connect-src 'self'"})
