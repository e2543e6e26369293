// The status page served at / (server/status_http.h): plain HTML, CSS and JavaScript with no
// external asset, so it works on a cluster without internet access. It polls /status.json.
#include "server/status_http.h"

namespace dbs {

const char kStatusPageHtml[] = R"HTML(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>dbs_ps status</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  .sub { color: #666; margin-bottom: 16px; }
  table { border-collapse: collapse; margin-bottom: 20px; }
  th, td { padding: 4px 10px; text-align: left; border-bottom: 1px solid #eee; }
  th { font-weight: 600; }
  .bar { height: 12px; display: inline-block; vertical-align: middle; }
  .share { background: #4a7bd0; }
  .compute { background: #3a9b5c; }
  .wait { background: #e0a030; }
  .cell { width: 240px; }
  .charts { display: flex; gap: 24px; flex-wrap: wrap; }
  .chart h2 { font-size: 15px; margin: 0 0 4px; }
  svg { background: #fafafa; border: 1px solid #ddd; }
  .legend span { margin-right: 12px; }
  .bad { color: #b00; }
</style>
</head>
<body>
<h1>dbs_ps</h1>
<div class="sub" id="headline">loading...</div>
<table id="workers">
  <thead><tr><th>worker</th><th>device</th><th>batch now</th><th class="cell">share</th>
  <th class="cell">compute / wait (last epoch)</th><th>speed</th></tr></thead>
  <tbody></tbody>
</table>
<div class="charts">
  <div class="chart"><h2>Imbalance (slowest / fastest compute) per epoch</h2>
    <svg id="imbalance" width="420" height="180"></svg></div>
  <div class="chart"><h2>Loss and accuracy per epoch</h2>
    <svg id="progress" width="420" height="180"></svg>
    <div class="legend"><span style="color:#c0392b">&#9632; train loss</span>
    <span style="color:#2e86c1">&#9632; test accuracy</span></div></div>
</div>
<script>
"use strict";
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function bar(cls, fraction) {
  return el("span", {class: "bar " + cls,
                     style: "width:" + Math.max(0, Math.min(1, fraction)) * 220 + "px"});
}
function fmt(x, d) { return x === null || x === undefined ? "-" : Number(x).toFixed(d); }
function plot(svg, series) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.width.baseVal.value, H = svg.height.baseVal.value, P = 28;
  const ns = "http://www.w3.org/2000/svg";
  let n = 0;
  for (const s of series) n = Math.max(n, s.values.length);
  const axis = document.createElementNS(ns, "path");
  axis.setAttribute("d", `M${P},${P / 2} V${H - P} H${W - P / 2}`);
  axis.setAttribute("stroke", "#999"); axis.setAttribute("fill", "none");
  svg.appendChild(axis);
  for (const s of series) {
    if (!s.values.length) continue;
    const hi = s.max !== undefined ? s.max : Math.max(...s.values) * 1.1 || 1;
    const lo = s.min !== undefined ? s.min : 0;
    const pts = s.values.map((v, i) => {
      const x = P + (n > 1 ? i / (n - 1) : 0.5) * (W - 1.5 * P);
      const y = H - P - (v - lo) / (hi - lo || 1) * (H - 1.5 * P);
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("stroke", s.color); line.setAttribute("fill", "none");
    line.setAttribute("stroke-width", "2");
    svg.appendChild(line);
    for (const p of pts) {
      const [cx, cy] = p.split(",");
      const dot = document.createElementNS(ns, "circle");
      dot.setAttribute("cx", cx); dot.setAttribute("cy", cy); dot.setAttribute("r", "3");
      dot.setAttribute("fill", s.color);
      svg.appendChild(dot);
    }
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", 4); label.setAttribute("y", s.labelY || 14);
    label.setAttribute("fill", s.color); label.setAttribute("font-size", "11");
    label.textContent = s.label + " max " + fmt(Math.max(...s.values), 3);
    svg.appendChild(label);
  }
  const xl = document.createElementNS(ns, "text");
  xl.setAttribute("x", W / 2); xl.setAttribute("y", H - 6);
  xl.setAttribute("font-size", "11"); xl.textContent = "epoch (" + n + ")";
  svg.appendChild(xl);
}
function render(s) {
  const live = s.live || {};
  const eta = live.eta_seconds === null || live.eta_seconds === undefined ? "-" :
      Math.round(live.eta_seconds) + " s";
  const headline = document.getElementById("headline");
  headline.textContent = `policy ${s.policy}, ${s.workers} workers, global batch ` +
      `${s.global_batch} - epoch ${live.epoch}/${s.epochs_planned}, step ${live.step}/` +
      `${live.num_steps} - elapsed ${Math.round(live.elapsed_seconds || 0)} s, ETA ${eta}` +
      ` - ${s.state === "running" ? "running" : s.state === "finished" ?
                                 "finished (status ok)" : "ended: " + s.status}`;
  headline.className = "sub" + (s.state === "failed" ? " bad" : "");
  const epochs = s.epochs || [];
  const current = epochs.length ? epochs[epochs.length - 1] : null;
  let lastDone = null;
  for (const e of epochs) if (e.audit) lastDone = e;
  const done = {};
  let most = 0;
  if (lastDone) for (const w of lastDone.workers) {
    done[w.id] = w;
    most = Math.max(most, (w.compute_seconds || 0) + (w.wait_seconds || 0));
  }
  const names = {};
  for (const w of s.worker_info || []) names[w.id] = w;
  const tbody = document.querySelector("#workers tbody");
  tbody.textContent = "";
  for (const w of (current ? current.workers : [])) {
    const info = names[w.id] || {};
    const d = done[w.id] || {};
    const tr = el("tr", {class: "worker"});
    tr.appendChild(el("td", {}, info.name || ("worker " + w.id)));
    tr.appendChild(el("td", {}, (info.device || "") +
                                    (info.cpu_limit_cores > 0
                                         ? " (CPU limit " + fmt(info.cpu_limit_cores, 2) + ")"
                                         : "")));
    // The plan's batch as first laid out; mid-epoch re-plans move the share, so show both.
    tr.appendChild(el("td", {}, Math.round(w.share * s.global_batch) + " (planned " +
                                    w.batch_size + ")"));
    const share = el("td", {class: "cell"});
    share.appendChild(bar("share", w.share));
    share.appendChild(el("span", {}, " " + fmt(100 * w.share, 1) + "%"));
    tr.appendChild(share);
    const cw = el("td", {class: "cell"});
    if (d.compute_seconds !== undefined && most > 0) {
      cw.appendChild(bar("compute", d.compute_seconds / most));
      cw.appendChild(bar("wait", d.wait_seconds / most));
      cw.appendChild(el("span", {}, ` ${fmt(d.compute_seconds, 1)} / ${fmt(d.wait_seconds, 1)} s`));
    } else {
      cw.textContent = "(first epoch running)";
    }
    tr.appendChild(cw);
    tr.appendChild(el("td", {}, d.compute_seconds ?
        fmt(d.samples / d.compute_seconds, 0) + " samples/s" : "-"));
    tbody.appendChild(tr);
  }
  const complete = epochs.filter(e => e.audit);
  plot(document.getElementById("imbalance"), [
    {values: complete.map(e => e.compute_seconds_max_over_min), color: "#8e44ad",
     label: "max/min", min: 1}]);
  plot(document.getElementById("progress"), [
    {values: complete.map(e => e.train_loss), color: "#c0392b", label: "loss"},
    {values: complete.map(e => e.test_accuracy), color: "#2e86c1", label: "accuracy",
     min: 0, max: 1, labelY: 28}]);
}
function refresh() {
  fetch("status.json").then(r => r.json()).then(render).catch(err => {
    document.getElementById("headline").textContent = "dbs_ps unreachable: " + err;
  });
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
)HTML";

}  // namespace dbs
