// The status page: static HTML and JavaScript that polls /status.json every
// second and redraws its charts with the Chart.js served at /chart.js.
#include "status/server.h"

namespace limbo::status {

const std::string& page_html() {
  static const std::string html = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Limbo job</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font-family:system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
 h1{font-size:20px;margin:0 0 8px}
 #facts{display:flex;flex-wrap:wrap;gap:8px;margin-bottom:12px}
 .fact{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px 10px;min-width:90px}
 .fact b{display:block;font-size:18px}
 .fact span{font-size:12px;color:#666}
 #grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
 .card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px;height:240px}
 .hidden{display:none}
 #events{font-size:12px;max-height:120px;overflow:auto;background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px;margin-top:12px}
 #error{color:#b00}
 #pace{font-size:12px;background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px;margin-top:12px}
</style></head>
<body data-updates="0" data-charts="0">
<h1>Limbo: <span id="job">…</span> job <small id="error"></small></h1>
<div id="facts">
 <div class="fact"><b id="members">–</b><span>members</span></div>
 <div class="fact"><b id="sps">–</b><span>samples/s</span></div>
 <div class="fact"><b id="samples">–</b><span>samples</span></div>
 <div class="fact"><b id="epoch">–</b><span>epoch</span></div>
 <div class="fact"><b id="loss">–</b><span>train loss</span></div>
 <div class="fact"><b id="acc">–</b><span>test accuracy</span></div>
 <div class="fact ppl"><b id="ppl">–</b><span>perplexity</span></div>
 <div class="fact"><b id="lr">–</b><span>learning rate</span></div>
 <div class="fact"><b id="mult">–</b><span>LR multiplier</span></div>
 <div class="fact"><b id="batch">–</b><span>global batch</span></div>
 <div class="fact ps"><b id="dropped">–</b><span>dropped / refused</span></div>
 <div class="fact isgd"><b id="triggers">–</b><span>ISGD triggers</span></div>
 <div class="fact diloco"><b id="outer">–</b><span>outer steps</span></div>
 <div class="fact diloco"><b id="util">–</b><span>compute share</span></div>
</div>
<div id="grid">
 <div class="card"><canvas id="c_members"></canvas></div>
 <div class="card"><canvas id="c_sps"></canvas></div>
 <div class="card"><canvas id="c_loss"></canvas></div>
 <div class="card"><canvas id="c_lr"></canvas></div>
 <div class="card"><canvas id="c_batch"></canvas></div>
 <div class="card gnorm"><canvas id="c_gnorm"></canvas></div>
 <div class="card ppl"><canvas id="c_ppl"></canvas></div>
 <div class="card ps"><canvas id="c_stale"></canvas></div>
 <div class="card ps"><canvas id="c_ups"></canvas></div>
 <div class="card ps"><canvas id="c_shards"></canvas></div>
 <div class="card isgd"><canvas id="c_isgd"></canvas></div>
 <div class="card diloco"><canvas id="c_diloco"></canvas></div>
</div>
<div id="pace" class="hidden"></div>
<div id="events"></div>
<script src="/chart.js"></script>
<script>
"use strict";
const charts = {};
const eventColor = {start:"#888", join:"#2a2", leave:"#27c", crash:"#d22", hang:"#e80", change:"#888"};
function fmt(v, d) { return v === null || v === undefined ? "–" : (typeof v === "number" ? v.toFixed(d) : v); }
function chart(id, type, datasets, opts) {
  if (charts[id]) return charts[id];
  const scales = opts.scales || {x: {type: "linear", title: {display: true, text: "seconds"}}};
  charts[id] = new Chart(document.getElementById(id), {
    type: type, data: {labels: [], datasets: datasets},
    options: {animation: false, responsive: true, maintainAspectRatio: false, parsing: true,
              plugins: {title: {display: true, text: opts.title}, legend: {display: datasets.length > 1}},
              scales: scales}});
  document.body.dataset.charts = Object.keys(charts).length;
  return charts[id];
}
function xy(t, ys) { const out = []; for (let i = 0; i < t.length; i++) if (ys[i] !== null) out.push({x: t[i], y: ys[i]}); return out; }
function line(label, color, data, extra) { return Object.assign({label: label, borderColor: color, backgroundColor: color, data: data, pointRadius: 0, borderWidth: 1.5}, extra || {}); }
function show(cls, on) { document.querySelectorAll("." + cls).forEach(e => e.classList.toggle("hidden", !on)); }
function render(s) {
  const S = s.series, t = S.t;
  document.getElementById("job").textContent = s.job;
  document.getElementById("members").textContent = s.members;
  document.getElementById("sps").textContent = fmt(s.samples_per_second, 0);
  document.getElementById("samples").textContent = s.samples_total;
  document.getElementById("epoch").textContent = fmt(s.epoch, 2);
  document.getElementById("loss").textContent = fmt(s.loss, 4);
  document.getElementById("acc").textContent = s.test_accuracy === null ? "–" : (100 * s.test_accuracy).toFixed(2) + "%";
  document.getElementById("lr").textContent = fmt(s.lr, 5);
  document.getElementById("mult").textContent = fmt(s.lr_multiplier, 3);
  document.getElementById("batch").textContent = fmt(s.batch_size, 0);
  show("ps", s.ps !== null);
  show("isgd", s.isgd !== null);
  show("diloco", s.diloco !== null);
  show("gnorm", s.grad_norm !== null);
  show("ppl", s.test_perplexity !== null);
  const pace = document.getElementById("pace");
  pace.classList.toggle("hidden", !s.shares);
  if (s.shares)
    pace.innerHTML = "<b>shares of the batch by pace</b> " + s.shares.map((x, r) => "rank " + r + ": " +
        (100 * x).toFixed(1) + "%" + (s.paces && s.paces[r] !== undefined ? " at " + Math.round(s.paces[r]) +
        " samples/s" : "")).join(" &middot; ");
  document.getElementById("ppl").textContent = fmt(s.test_perplexity, 3);
  const ev = s.events.map(e => ({x: e.t, y: e.members, kind: e.kind}));
  let c = chart("c_members", "line", [line("members", "#333", [], {stepped: true}),
      line("events", "#d22", [], {showLine: false, pointRadius: 5})], {title: "members (events marked)"});
  c.data.datasets[0].data = xy(t, S.members);
  c.data.datasets[1].data = ev;
  c.data.datasets[1].pointBackgroundColor = ev.map(e => eventColor[e.kind] || "#888");
  c.update("none");
  c = chart("c_sps", "line", [line("samples/s", "#27c", [])], {title: "samples / s"});
  c.data.datasets[0].data = xy(t, S.samples_per_second); c.update("none");
  c = chart("c_loss", "line", [line("train loss", "#c52", [], {yAxisID: "y"}), line("test accuracy", "#2a2", [], {yAxisID: "y1", pointRadius: 2})],
      {title: "training loss and test accuracy", scales: {x: {type: "linear"}, y: {position: "left"}, y1: {position: "right", min: 0, max: 1, grid: {drawOnChartArea: false}}}});
  c.data.datasets[0].data = xy(t, S.loss); c.data.datasets[1].data = xy(s.accuracy.t, s.accuracy.test_accuracy); c.update("none");
  c = chart("c_lr", "line", [line("learning rate", "#75c", [], {yAxisID: "y"}), line("LR multiplier (Dynamic SGD)", "#e80", [], {yAxisID: "y1"})],
      {title: "learning rate and its multiplier", scales: {x: {type: "linear"}, y: {position: "left"}, y1: {position: "right", grid: {drawOnChartArea: false}}}});
  c.data.datasets[0].data = xy(t, S.lr); c.data.datasets[1].data = xy(t, S.lr_multiplier); c.update("none");
  c = chart("c_batch", "line", [line("global batch", "#333", [], {stepped: true})], {title: "global batch size"});
  c.data.datasets[0].data = xy(t, S.batch_size); c.update("none");
  if (s.ps !== null) {
    document.getElementById("dropped").textContent = s.ps.gradients_dropped + " / " + s.ps.gradients_rejected;
    const h = s.ps.staleness_hist, taus = Object.keys(h).map(Number).sort((a, b) => a - b);
    c = chart("c_stale", "bar", [{label: "gradients", backgroundColor: "#27c", data: []}],
        {title: "staleness histogram (shard 0)", scales: {x: {title: {display: true, text: "staleness τ"}}}});
    c.data.labels = taus; c.data.datasets[0].data = taus.map(k => h[k]); c.update("none");
    c = chart("c_ups", "line", [line("updates/s", "#2a2", [])], {title: "updates / s (all shards)"});
    c.data.datasets[0].data = xy(t, S.updates_per_second); c.update("none");
    c = chart("c_shards", "bar", [{label: "busy fraction", backgroundColor: "#c52", data: []}],
        {title: "load per shard", scales: {x: {title: {display: true, text: "shard"}}, y: {min: 0, max: 1}}});
    c.data.labels = s.ps.shards.map(x => x.shard); c.data.datasets[0].data = s.ps.shards.map(x => x.busy_fraction); c.update("none");
  }
  if (s.grad_norm !== null) {
    c = chart("c_gnorm", "line", [line("gradient norm before clipping", "#c52", [])], {title: "gradient norm"});
    c.data.datasets[0].data = xy(t, S.grad_norm); c.update("none");
  }
  if (s.test_perplexity !== null) {
    c = chart("c_ppl", "line", [line("validation perplexity", "#2a2", [], {pointRadius: 2})], {title: "perplexity (exp test loss)"});
    c.data.datasets[0].data = xy(s.accuracy.t, s.accuracy.test_perplexity); c.update("none");
  }
  if (s.diloco !== null) {
    document.getElementById("outer").textContent = s.diloco.outer_steps;
    document.getElementById("util").textContent = s.diloco.compute_share === null ? "–" : (100 * s.diloco.compute_share).toFixed(1) + "%";
    c = chart("c_diloco", "line", [line("pseudo-gradient norm", "#c52", [], {yAxisID: "y"}), line("compute share", "#27c", [], {yAxisID: "y1"})],
        {title: "DiLoCo: pseudo-gradient norm and compute share", scales: {x: {type: "linear"}, y: {position: "left"}, y1: {position: "right", min: 0, max: 1, grid: {drawOnChartArea: false}}}});
    c.data.datasets[0].data = xy(t, S.pseudo_gradient_norm); c.data.datasets[1].data = xy(t, S.compute_share); c.update("none");
  }
  if (s.isgd !== null) {
    document.getElementById("triggers").textContent = s.isgd.triggers_total;
    c = chart("c_isgd", "line", [line("ISGD triggers (total)", "#e80", [], {stepped: true})], {title: "ISGD triggers"});
    c.data.datasets[0].data = xy(t, S.isgd_triggers); c.update("none");
  }
  document.getElementById("events").innerHTML = s.events.slice().reverse().map(e =>
      "<div>" + e.t.toFixed(1) + " s: <b style='color:" + (eventColor[e.kind] || "#888") + "'>" + e.kind +
      "</b> → " + e.members + " members " + (e.detail ? "(" + e.detail.replace(/</g, "&lt;") + ")" : "") + "</div>").join("");
  document.body.dataset.updates = Number(document.body.dataset.updates) + 1;
  document.body.dataset.members = s.members;
  document.body.dataset.points = t.length;
  document.body.dataset.events = s.events.map(e => e.kind).join(",");
}
async function tick() {
  try {
    const r = await fetch("/status.json", {cache: "no-store"});
    render(await r.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = "(no answer: " + e + ")";
  }
  setTimeout(tick, 1000);
}
tick();
</script></body></html>
)HTML";
  return html;
}

}  // namespace limbo::status
