"use strict";
// The dilocod run dashboard. It polls the JSON API of the node that serves it (a bootstrap or a peer):
//   api/status  - this node (a peer's status includes its recent rounds),
//   api/run     - every live peer's latest status record, from this node's view of the DHT, the run's
//                 progress through its dataset, and the newest sample of what θ_global writes,
//   api/history - what this node has seen of the run over time (bounded, see dilocod/history.py),
//   metrics     - this node's Prometheus counters (bytes, bans, rejections),
// and draws everything itself as SVG: no libraries, no build step, nothing fetched from elsewhere.

const POLL_MS = 2000;
const STALE_SECONDS = 30;
const SVGNS = "http://www.w3.org/2000/svg";
const MAX_DOTS = 300; // a series longer than this is drawn as a line only
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
  "#bcbd22", "#7f7f7f"];

const $ = (id) => document.getElementById(id);
const isNum = (v) => typeof v === "number" && Number.isFinite(v);
const esc = (s) => String(s).replace(/[&<>"']/g,
  (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const fmt = (v, d = 3) => (isNum(v) ? v.toFixed(d) : "–");
const fmtInt = (v) => (isNum(v) ? Math.round(v).toLocaleString("en-US") : "–");
const shortId = (id) => (id ? "…" + String(id).slice(-10) : "–");
const sum = (xs) => xs.reduce((a, b) => a + (isNum(b) ? b : 0), 0);
const mean = (xs) => { const v = xs.filter(isNum); return v.length ? sum(v) / v.length : null; };

function fmtBytes(v) {
  if (!isNum(v)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtAge(seconds) {
  if (!isNum(seconds)) return "–";
  seconds = Math.max(0, seconds);
  if (seconds < 90) return `${seconds.toFixed(0)}s ago`;
  if (seconds < 5400) return `${(seconds / 60).toFixed(0)}m ago`;
  return `${(seconds / 3600).toFixed(1)}h ago`;
}

function fmtShort(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  return Number(v.toPrecision(3)).toString();
}

const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });

// Stable colours: a peer keeps the colour it got when first seen.
const colours = new Map();
function peerColour(id) {
  if (!colours.has(id)) {
    const i = colours.size;
    colours.set(id, i < PALETTE.length ? PALETTE[i] : `hsl(${(i * 137) % 360}, 60%, 45%)`);
  }
  return colours.get(id);
}

// ---- SVG charts ------------------------------------------------------------------------------------
function el(parent, name, attrs, text) {
  const node = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  parent.appendChild(node);
  return node;
}

function niceTicks(lo, hi, count) {
  const span = hi - lo;
  if (!(span > 0)) return [lo];
  const raw = span / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => span / s <= count) || 10 * mag;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

function extent(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  return [lo, hi];
}

/** series: [{name, colour, points: [[x, y]], dash?, dots?, width?}]; opts: {xTime, xInt, yZero, empty}. */
function drawChart(svg, series, opts = {}) {
  const W = 560, H = 240, L = 50, R = 12, T = 10, B = 28;
  svg.replaceChildren();
  const clean = series.map((s) => ({ ...s, points: s.points.filter((p) => isNum(p[0]) && isNum(p[1])) }));
  const all = clean.flatMap((s) => s.points);
  svg.dataset.points = String(all.length);
  if (!all.length) {
    el(svg, "text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, opts.empty || "no data yet");
    return;
  }
  let [x0, x1] = extent(all.map((p) => p[0]));
  let [y0, y1] = extent(all.map((p) => p[1]));
  if (opts.yZero) y0 = Math.min(0, y0);
  if (x0 === x1) { x0 -= opts.xTime ? 30 : 1; x1 += opts.xTime ? 30 : 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y1 += d; if (!opts.yZero || y0 !== 0) y0 -= d; }
  else { const pad = (y1 - y0) * 0.06; y1 += pad; if (!(opts.yZero && y0 === 0)) y0 -= pad; }
  if (opts.yZero && y0 < 0 && all.every((p) => p[1] >= 0)) y0 = 0;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  for (const t of niceTicks(y0, y1, 5)) {
    el(svg, "line", { x1: L, x2: W - R, y1: sy(t), y2: sy(t), class: "grid" });
    el(svg, "text", { x: L - 6, y: sy(t) + 4, "text-anchor": "end" }, opts.yFmt ? opts.yFmt(t) : fmtShort(t));
  }
  let xticks = niceTicks(x0, x1, opts.xTime ? 4 : 6);
  if (opts.xInt) xticks = xticks.filter(Number.isInteger);
  for (const t of xticks) {
    el(svg, "line", { x1: sx(t), x2: sx(t), y1: H - B, y2: H - B + 4, class: "axis" });
    el(svg, "text", { x: sx(t), y: H - B + 16, "text-anchor": "middle" }, opts.xTime ? clock(t) : fmtShort(t));
  }
  el(svg, "line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" });
  el(svg, "line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" });
  for (const s of clean) {
    const pts = [...s.points].sort((a, b) => a[0] - b[0]);
    if (pts.length > 1 && s.line !== false) {
      const d = "M" + pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("L");
      const attrs = { d, class: "line series", stroke: s.colour, "stroke-width": s.width || 1.8 };
      if (s.dash) attrs["stroke-dasharray"] = "5 4";
      el(el(svg, "path", attrs), "title", {}, s.name);
    }
    if (s.dots !== false && pts.length <= MAX_DOTS) {
      for (const p of pts) {
        const dot = el(svg, "circle", { cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: s.r || 2.6,
          fill: s.colour, class: "pt" });
        const x = opts.xTime ? clock(p[0]) : p[0];
        el(dot, "title", {}, `${s.name}: ${x} → ${opts.yFmt ? opts.yFmt(p[1]) : fmtShort(p[1])}`);
      }
    }
  }
}

function drawLegend(div, series) {
  const shown = series.filter((s) => s.points.some((p) => isNum(p[0]) && isNum(p[1])));
  const items = shown.slice(0, 12).map((s) => `<span style="--c:${esc(s.colour)}">${esc(s.name)}</span>`);
  if (shown.length > 12) items.push(`<span style="--c:transparent">+${shown.length - 12} more</span>`);
  div.innerHTML = items.join("");
}

function chart(name, series, opts) {
  drawChart($("chart-" + name), series, opts);
  drawLegend($("legend-" + name), series);
}

// ---- data --------------------------------------------------------------------------------------------
async function getJson(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function getText(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.text();
}

/** Prometheus text format → {metric name: value summed over its label sets}. */
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (m) out[m[1]] = (out[m[1]] || 0) + Number(m[3]);
  }
  return out;
}

/** Per peer: {outer step: value of field} from its history samples (the last sample of a step wins). */
function byStep(history, field) {
  const fields = history.peer_fields || [];
  const xi = fields.indexOf("outer_step"), yi = fields.indexOf(field);
  const out = {};
  for (const [peer, entry] of Object.entries(history.peers || {})) {
    if (entry.role !== "peer") continue;
    const steps = new Map();
    for (const row of entry.samples) if (isNum(row[xi]) && isNum(row[yi])) steps.set(row[xi], row[yi]);
    out[peer] = steps;
  }
  return out;
}

function peerSeries(perPeer, opts = {}) {
  return Object.entries(perPeer).map(([peer, steps]) => ({
    name: shortId(peer), colour: peerColour(peer), points: [...steps.entries()], ...opts,
  }));
}

function runColumn(history, field) {
  const fields = history.run_fields || [];
  const ti = fields.indexOf("time"), yi = fields.indexOf(field);
  return (history.run || []).map((row) => [row[ti], row[yi]]);
}

const ownCounters = []; // this node's byte counters over time, sampled by this page: [time, sent, received]

// ---- rendering ---------------------------------------------------------------------------------------
// The newest completion of the run's prompt from θ_global (api/run's sample), with the round it came from.
function renderSample(sample) {
  if (!sample) return;
  $("sample-prompt").textContent = sample.prompt;
  $("sample-text").textContent = sample.text;
  const agree = sample.peers_sampled > 1 ? ` · ${sample.peers_agreeing} of ${sample.peers_sampled} peers wrote it` : "";
  $("sample-sub").textContent = `(outer step ${sample.outer_step}, by peer ${shortId(sample.peer_id)}${agree})`;
  $("sample").dataset.step = String(sample.outer_step);
}

function render(status, records, history, metrics, now, dataset, scoring) {
  const self = status && status.peer_id;
  // A peer's own record may not be in the DHT yet: show it from its status.
  if (status && status.role === "peer" && status.peer_id && !records.some((r) => r.peer_id === status.peer_id)) {
    records = [{ ...status, time: now }, ...records];
  }
  const peers = records.filter((r) => r.role === "peer");
  const runId = (status && status.run_id) || (records[0] && records[0].run_id) || "";
  $("run-id").textContent = runId ? `run ${runId}` : "";
  document.title = runId ? `dilocod · ${runId}` : "dilocod run";
  $("served-by").textContent = status
    ? (status.role === "bootstrap" ? `served by bootstrap ${shortId(status.peer_id)}`
      : `served by peer ${shortId(status.peer_id)} (its view of the run)`)
    : "";

  // Cards.
  const relayed = peers.filter((p) => p.reachability === "private").length;
  const publicCount = peers.filter((p) => p.reachability === "public").length;
  $("card-peers").textContent = peers.length;
  $("card-roles").textContent = `${publicCount} public · ${relayed} relayed` +
    (peers.length - publicCount - relayed ? ` · ${peers.length - publicCount - relayed} unknown` : "");
  const tps = sum(peers.map((p) => p.tokens_per_second));
  $("card-tps").textContent = fmtInt(tps);
  $("card-tps-sub").textContent = peers.length ? `${fmtInt(tps / peers.length)} per peer` : "";
  const steps = peers.map((p) => p.outer_step);
  $("card-step").textContent = steps.length ? Math.max(...steps) : "–";
  $("card-step-sub").textContent = steps.length ? `slowest peer at ${Math.min(...steps)}` : "";
  $("card-loss").textContent = fmt(mean(peers.map((p) => p.loss)));
  const bpb = mean(peers.map((p) => p.eval_bits_per_byte));
  $("card-eval").textContent = `eval ${fmt(mean(peers.map((p) => p.eval_loss)))}` +
    (bpb === null ? "" : ` · ${fmt(bpb)} bits/byte`);
  // The run's progress through its dataset (the chunk schedule), as this node last heard it.
  $("card-data").textContent = dataset ? `${(100 * dataset.epoch_fraction).toFixed(1)}%` : "–";
  $("card-data-sub").textContent = dataset
    ? `epoch ${dataset.epoch} · ${fmtShort(dataset.tokens_trained)} tokens · ` +
      `${fmtInt(dataset.chunks_trained)} chunks of ${fmtInt(dataset.chunks_total)}`
    : "no chunk schedule heard of yet";
  const failed = sum(peers.map((p) => p.rounds_failed));
  $("card-rounds").textContent = `${fmtInt(sum(peers.map((p) => p.rounds_ok)))} / ${fmtInt(failed)}`;
  const lastRound = mean(peers.map((p) => p.last_round_seconds));
  $("card-rounds-sub").textContent = lastRound === null ? "" : `last round ${lastRound.toFixed(1)}s (mean)`;
  const byStepHashes = new Map();
  for (const p of peers) {
    if (!byStepHashes.has(p.outer_step)) byStepHashes.set(p.outer_step, new Set());
    byStepHashes.get(p.outer_step).add(p.global_sha256);
  }
  const split = [...byStepHashes.entries()].filter(([, hashes]) => hashes.size > 1);
  $("card-hash").textContent = peers.length ? (split.length ? "split" : "agree") : "–";
  $("card-hash").className = "value" + (split.length ? " bad" : "");
  $("card-hash-sub").textContent = split.length
    ? split.map(([step, h]) => `${h.size} hashes at step ${step}`).join(", ")
    : (peers.length ? "peers at the same step hold the same θ" : "");

  const trained = sum(peers.map((p) => p.tokens_trained));
  const reached = sum(peers.map((p) => p.tokens_contributed));
  $("card-useful").textContent = trained > 0 ? `${(100 * reached / trained).toFixed(0)}%` : "–";
  const idle = peers.filter((p) => p.contributing === false);
  $("card-useful-sub").textContent = trained > 0
    ? `${fmtShort(reached)} of ${fmtShort(trained)} tokens` + (idle.length ? ` · ${idle.length} not contributing` : "")
    : "";
  $("card-useful").className = "value" + (idle.length ? " bad" : "");

  // Charts over outer steps, from the history this node kept.
  const lossSteps = byStep(history, "loss");
  const runMean = new Map();
  for (const steps of Object.values(lossSteps)) {
    for (const [step, value] of steps) {
      if (!runMean.has(step)) runMean.set(step, []);
      runMean.get(step).push(value);
    }
  }
  chart("loss", [...peerSeries(lossSteps),
    { name: "run mean", colour: "#111", width: 2.4, dots: false, points: [...runMean].map(([s, v]) => [s, mean(v)]) }],
  { xInt: true, empty: "waiting for the first outer round…" });
  chart("eval", peerSeries(byStep(history, "eval_loss")), { xInt: true, empty: "no evaluation yet" });

  // Charts over time.
  const fields = history.peer_fields || [];
  const ti = fields.indexOf("time"), tpsi = fields.indexOf("tokens_per_second");
  const perPeerTps = Object.entries(history.peers || {}).filter(([, e]) => e.role === "peer").map(([peer, e]) => ({
    name: shortId(peer), colour: peerColour(peer), width: 1, dots: false,
    points: e.samples.map((row) => [row[ti], row[tpsi]]),
  }));
  chart("tps", [{ name: "swarm", colour: "#111", width: 2.4, points: runColumn(history, "tokens_per_second") },
    ...perPeerTps], { xTime: true, yZero: true, empty: "no samples yet" });
  chart("peers", [{ name: "training peers", colour: "#2a5bd7", points: runColumn(history, "peers") }],
    { xTime: true, yZero: true, empty: "no samples yet" });

  // Rounds: duration, group size, failures.
  chart("round", peerSeries(byStep(history, "last_round_seconds")),
    { xInt: true, yZero: true, yFmt: (v) => fmtShort(v) + "s", empty: "no round yet" });
  const runFields = history.run_fields || [];
  const si = runFields.indexOf("outer_step"), fi = runFields.indexOf("rounds_failed");
  chart("group", [...peerSeries(byStep(history, "group_size")),
    { name: "rounds failed (run)", colour: "#c0392b", dash: true, r: 2,
      points: (history.run || []).map((row) => [row[si], row[fi]]) }],
  { xInt: true, yZero: true, empty: "no round yet" });

  renderShare(history);
  renderBytes(history, metrics, now);
  renderTrust(peers, metrics, history);
  renderPeerTable(records, self, now, scoring);
  renderOwnRounds(status);
}

function renderShare(history) {
  const fields = history.peer_fields || [];
  const ti = fields.indexOf("time"), tri = fields.indexOf("tokens_trained"), ci = fields.indexOf("tokens_contributed");
  const series = Object.entries(history.peers || {}).filter(([, e]) => e.role === "peer").map(([peer, e]) => ({
    name: shortId(peer), colour: peerColour(peer), dots: false,
    points: e.samples.filter((row) => isNum(row[tri]) && row[tri] > 0).map((row) => [row[ti], row[ci] / row[tri]]),
  }));
  chart("share", series, { xTime: true, yZero: true, yFmt: (v) => `${Math.round(100 * v)}%`,
    empty: "no peer reports its tokens yet" });
}

function renderBytes(history, metrics, now) {
  const fields = history.peer_fields || [];
  const ti = fields.indexOf("time"), si = fields.indexOf("bytes_sent"), ri = fields.indexOf("bytes_received");
  const series = [];
  for (const [peer, entry] of Object.entries(history.peers || {})) {
    const sent = entry.samples.map((row) => [row[ti], row[si]]).filter((p) => isNum(p[1]));
    const received = entry.samples.map((row) => [row[ti], row[ri]]).filter((p) => isNum(p[1]));
    if (sent.length) series.push({ name: `${shortId(peer)} sent`, colour: peerColour(peer), points: sent, dots: false });
    if (received.length) {
      series.push({ name: `${shortId(peer)} received`, colour: peerColour(peer), points: received, dash: true, dots: false });
    }
  }
  const sent = metrics && metrics.dilocod_bytes_sent_total;
  const received = metrics && metrics.dilocod_bytes_received_total;
  if (isNum(sent) && isNum(received)) {
    ownCounters.push([now, sent, received]);
    if (ownCounters.length > 600) ownCounters.splice(0, ownCounters.length - 600);
  }
  const ownMoved = ownCounters.some((row) => row[1] > 0 || row[2] > 0);
  if (ownMoved) {
    series.push({ name: "this node sent", colour: "#111", dots: false, points: ownCounters.map((r) => [r[0], r[1]]) });
    series.push({ name: "this node received", colour: "#111", dash: true, dots: false,
      points: ownCounters.map((r) => [r[0], r[2]]) });
  }
  chart("bytes", series, { xTime: true, yZero: true, yFmt: fmtBytes,
    empty: "bytes on the wire: not reported yet" });
  $("note-bytes").textContent = series.length
    ? `This node: ${fmtBytes(sent)} sent, ${fmtBytes(received)} received (dilocod_bytes_*_total).`
    : "Placeholder: no node reports bytes yet. The chart fills from the peers' bytes_sent / bytes_received " +
      "status fields and from this node's dilocod_bytes_sent_total / dilocod_bytes_received_total counters " +
      "once the averaging layer counts them.";
}

function renderTrust(peers, metrics, history) {
  const rejected = byStep(history, "rejected_contributions"), bans = byStep(history, "bans");
  chart("trust", [...peerSeries(rejected), ...peerSeries(bans, { dash: true }).map((s) => ({ ...s, name: s.name + " bans" }))],
    { xInt: true, yZero: true, empty: "no peer reports rejections or bans" });
  const rows = [];
  const add = (label, value) => rows.push(
    `<div>${esc(label)}</div><div class="n${isNum(value) && value > 0 ? " bad" : ""}">${fmtInt(value)}</div>`);
  const m = metrics || {};
  add("invalid status records dropped (this node)", m.dilocod_invalid_records_total);
  add("contributions rejected (this node)", m.dilocod_rejected_contributions_total);
  add("peers banned (this node)", m.dilocod_bans_total);
  const reported = (field) => peers.filter((p) => isNum(p[field]));
  const rejectedBy = reported("rejected_contributions"), bannedBy = reported("bans");
  if (rejectedBy.length) add(`contributions rejected (${rejectedBy.length} peers report)`, sum(rejectedBy.map((p) => p.rejected_contributions)));
  if (bannedBy.length) add(`bans (${bannedBy.length} peers report)`, sum(bannedBy.map((p) => p.bans)));
  $("trust").innerHTML = rows.join("");
  $("note-trust").textContent = (rejectedBy.length || bannedBy.length) ? ""
    : "Counters of the node serving this page (from its /metrics). Run-wide counts appear here once the " +
      "peers' status records carry rejected_contributions / bans.";
}

// A peer's rating from the run's contribution scoring (api/run `scoring`): the value, "gated" below the gate,
// and its latest verdicts in the cell's title.
function ratingCell(scoring, peerId) {
  const entry = scoring && scoring.peers ? scoring.peers[peerId] : null;
  if (!entry) return `<td class="rating muted">${scoring ? "unscored" : "–"}</td>`;
  const verdicts = (entry.last_scores || []).map((v) =>
    `outer step ${v.outer_step}: ${v.passed ? "pass" : "FAIL"} by ${shortId(v.scorer)}`).join("\n");
  const source = scoring.verified ? "verdicts this node checked" : "verdicts as the scorers published them";
  const title = `rating from ${source}; below ${scoring.gate} a peer weighs 0\n${verdicts}`;
  return `<td class="rating${entry.gated ? " bad" : ""}" title="${esc(title)}">${
    isNum(entry.rating) ? entry.rating.toFixed(2) : "–"}${entry.gated ? " gated" : ""}</td>`;
}

function renderPeerTable(records, self, now, scoring) {
  const rows = records.map((r) => {
    const age = isNum(r.time) ? now - r.time : null;
    const classes = [r.peer_id === self ? "self" : "", age !== null && age > STALE_SECONDS ? "stale" : ""].join(" ");
    const reach = r.reachability === "private" ? "relayed" : (r.reachability || "unknown");
    return `<tr class="${classes}" data-peer="${esc(r.peer_id)}">
      <td class="mono" title="${esc(r.peer_id)}"><span class="sw" style="background:${esc(peerColour(r.peer_id))}"></span>${esc(shortId(r.peer_id))}${r.peer_id === self ? " (this node)" : ""}</td>
      <td>${esc(r.role)}${r.other_manifest ? ` <span class="badge other-manifest" title="runs manifest ${esc(String(r.manifest_hash || "(none)").slice(0, 12))}, not this node's: it never averages with the run">other manifest</span>` : ""}</td><td><span class="badge ${esc(reach)}">${esc(reach)}</span></td>
      <td>${fmtInt(r.outer_step)}</td><td>${fmtInt(r.inner_step)}</td><td>${fmt(r.loss)}</td><td>${fmt(r.eval_loss)}</td>
      <td>${fmtInt(r.tokens_per_second)}</td>
      <td>${isNum(r.compute_utilization) ? Math.round(100 * r.compute_utilization) + "%" : "–"}</td>
      <td class="${r.contributing === false ? "bad" : ""}" title="${r.contributing === false ? "not contributing: its /api/status says why" : ""}">${
        isNum(r.tokens_trained) && r.tokens_trained > 0 ? Math.round(100 * r.tokens_contributed / r.tokens_trained) + "%" : "–"}</td>
      <td>${fmtInt(r.group_size)}${r.alone ? " (alone)" : ""}</td>
      <td>${isNum(r.last_round_seconds) ? r.last_round_seconds.toFixed(1) + "s" : "–"}</td>
      <td>${fmtInt(r.rounds_ok)} / <span class="${r.rounds_failed > 0 ? "bad" : ""}">${fmtInt(r.rounds_failed)}</span></td>
      <td>${fmtInt(r.rejected_contributions)} / ${fmtInt(r.bans)}</td>
      ${r.role === "peer" ? ratingCell(scoring, r.peer_id) : "<td class=\"rating\">–</td>"}
      <td class="mono">${esc(String(r.global_sha256 || "").slice(0, 12))}</td><td>${fmtAge(age)}</td>
      <td>${esc(r.version || "")}</td></tr>`;
  });
  $("peers").innerHTML = rows.join("") || `<tr><td colspan="18" class="muted">no live peer records yet</td></tr>`;
  $("peers-sub").textContent = `${records.length} live record${records.length === 1 ? "" : "s"}`;
}

function renderOwnRounds(status) {
  const rounds = status && Array.isArray(status.rounds) ? status.rounds : null;
  $("own-rounds-section").hidden = !rounds;
  if (!rounds) return;
  $("rounds").innerHTML = rounds.slice(-30).reverse().map((r) => {
    const good = ["ok", "alone", "resynced", "caught_up"].includes(r.result);
    return `<tr><td>${fmtInt(r.outer_step)}</td><td class="${good ? "ok" : "bad"}">${esc(r.result)}</td>
      <td>${fmtInt(r.group_size)}</td><td>${fmt(r.seconds, 1)}</td>
      <td>${r.tokens ? `${fmtInt(r.tokens)} (${fmtInt(r.tokens_counted)})` : "–"}</td><td>${fmt(r.loss)}</td><td>${fmt(r.eval_loss)}</td>
      <td class="mono">${esc(String(r.global_sha256 || "").slice(0, 12))}</td><td>${isNum(r.time) ? clock(r.time) : "–"}</td></tr>`;
  }).join("") || `<tr><td colspan="9" class="muted">no round yet</td></tr>`;
}

// ---- polling -----------------------------------------------------------------------------------------
let polls = 0;
let historyCache = null, historyBytes = 0, historyPoll = -Infinity;
async function getHistory() {
  // A big run's history is megabytes: fetch it less often then (its charts move slowly anyway).
  const every = historyBytes > 4e6 ? 15 : historyBytes > 5e5 ? 5 : 1;
  if (historyCache === null || polls - historyPoll >= every) {
    const text = await getText("api/history");
    historyCache = JSON.parse(text);
    historyBytes = text.length;
    historyPoll = polls;
  }
  return historyCache;
}

async function refresh() {
  const conn = $("conn");
  try {
    const [status, run, history, metricsText] = await Promise.all([
      getJson("api/status"), getJson("api/run"), getHistory(), getText("metrics").catch(() => ""),
    ]);
    const now = Date.now() / 1000;
    render(status, run.peers || [], history, parseMetrics(metricsText), now, run.dataset, run.scoring);
    renderSample(run.sample);
    polls++;
    conn.className = "conn ok";
    conn.textContent = `live · updated ${clock(now)}`;
    document.body.dataset.polls = String(polls);
  } catch (e) {
    conn.className = "conn bad";
    conn.textContent = `cannot reach the API: ${e.message || e}`;
  }
}

refresh();
setInterval(refresh, POLL_MS);
