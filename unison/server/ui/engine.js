// The engine view: /get_server_info about once a second (the core's engine-wide state, the same
// whichever HTTP worker answers), drawn as it is now, with the last minute's rates as charts.
// A server of several models lists them, each with its core; the one picked is drawn below.

import { json } from "./api.js";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;
const WINDOW_S = 60;

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

function cell(tag, text) {
  const node = document.createElement(tag);
  node.textContent = text;
  return node;
}

function definitions(dl, pairs) {
  dl.replaceChildren(...pairs.flatMap(([term, value]) =>
    [cell("dt", term), value instanceof Node ? wrap(value) : cell("dd", String(value))]));
}

function wrap(node) {
  const dd = document.createElement("dd");
  dd.append(node);
  return dd;
}

const percent = (part, whole) => (whole > 0 ? `${((100 * part) / whole).toFixed(1)} %` : "n/a");
const mib = (bytes) => `${(bytes / 2 ** 20).toFixed(0)} MiB`;

export class EngineView {
  constructor() {
    this.samples = []; // {t, generated, ttftSum, ttftCount, hits, queries}, the last minute's
    this.model = null; // several models: the one drawn (the controls act on it)
    $("pause").addEventListener("click", () =>
      this.control("/pause_generation", { mode: $("pause-mode").value }));
    $("continue").addEventListener("click", () => this.control("/continue_generation"));
    $("flush").addEventListener("click", () => this.control("/flush_cache"));
  }

  start() {
    this.poll();
  }

  async poll() {
    await this.refresh();
    setTimeout(() => this.poll(), POLL_MS); // after the answer: polls never pile up
  }

  async refresh() {
    const error = $("engine-error");
    try {
      this.show(await json("/get_server_info"));
      error.hidden = true;
    } catch (e) {
      error.textContent = `The engine did not answer: ${e.message}`;
      error.hidden = false;
    }
  }

  async control(path, body) {
    const result = $("control-result");
    try {
      const named = this.model ? { ...body, model: this.model } : body;
      result.textContent = (await json(path, { method: "POST", body: named })).message || "done";
    } catch (e) {
      result.textContent = e.message;
    }
    await this.refresh();
  }

  show(info) {
    if (info.models) {
      info = this.showModels(info.models);
      $("engine-detail").hidden = !info;
      if (!info) return;
    }
    // Data parallel: one state per replica in internal_states; the counters are their sums.
    const states = info.internal_states;
    const sum = (key) => states.reduce((total, s) => total + s.stats[key], 0);
    const ttft = info.histograms.time_to_first_token_seconds;
    const t = performance.now() / 1000;
    this.samples.push({ t, generated: sum("generation_tokens"), ttftSum: ttft.sum, ttftCount: ttft.count,
      hits: sum("prefix_cache_hits"), queries: sum("prefix_cache_queries") });
    while (t - this.samples[0].t > WINDOW_S) this.samples.shift();
    this.showCore(info);
    this.showLoad(info, states.length);
    this.showFrontends(info);
    this.showReplicas(info.replicas);
    this.showCharts();
  }

  showCore(info) {
    const kinds = {};
    for (const kind of Object.values(info.weights)) kinds[kind] = (kinds[kind] ?? 0) + 1;
    const weights = Object.entries(kinds).map(([kind, n]) => `${kind} ×${n}`).join(", ");
    const state = cell("span", info.paused ? `paused (${info.pause_mode})` : "serving");
    state.className = `state ${info.paused ? "paused" : "serving"}`;
    const path = info.internal_states[0].model_path ?? info.model_dir;
    const model = cell("span", path.split("/").filter(Boolean).at(-1));
    model.title = path;
    definitions($("core"), [
      ["pid", info.core_pid],
      ["model", model],
      ["weights", `${weights} · ${mib(info.weights_bytes)}`],
      ["KV cache", `${info.kv_cache_dtype} · ${info.block_size}-token blocks`],
      ["weights version", info.weights_version],
      ["state", state],
    ]);
  }

  showLoad(info, replicas) {
    const total = info.num_blocks * replicas;
    const [first, last] = [this.samples[0], this.samples.at(-1)];
    drawGauge($("kv-gauge"), info.kv_blocks_used / total, info.kv_blocks_cached / total);
    definitions($("load"), [
      ["running", info.num_running],
      ["waiting", info.num_waiting],
      ["KV blocks", `${info.kv_blocks_used} used, ${info.kv_blocks_cached} cached, of ${total}`],
      ["prefix-cache hits", percent(last.hits, last.queries)],
      ["hits, last minute", percent(last.hits - first.hits, last.queries - first.queries)],
    ]);
  }

  showFrontends(info) {
    const rows = [...info.frontends].sort((a, b) => a.worker_id - b.worker_id).map((f) => {
      const tr = document.createElement("tr");
      // behind: its requests are parked until it catches up (the core's lag guard)
      tr.append(cell("td", f.worker_id), cell("td", f.pid),
        cell("td", f.behind ? `${f.requests_in_flight} (parked: behind)` : f.requests_in_flight),
        cell("td", f.remote ? "over TCP" : "local (IPC)"));
      return tr;
    });
    $("frontends").tBodies[0].replaceChildren(...rows);
    $("frontend-count").textContent = `${rows.length} attached, room for ${info.tokenizer_worker_num}`;
  }

  // Several models: a row each; the server info of the one picked (the first loaded at first).
  showModels(models) {
    $("models-card").hidden = false;
    const loaded = models.filter((m) => m.server_info);
    const picked = loaded.find((m) => m.name === this.model) ?? loaded[0];
    this.model = picked?.name ?? null;
    if (this.model !== this.drawn) this.samples = []; // another core: its own rates
    this.drawn = this.model;
    $("models").tBodies[0].replaceChildren(...models.map((m) => {
      const tr = document.createElement("tr");
      // a model of the pool named by its Hugging Face id shows its download while it loads
      const state = m.state === "loading" && m.progress != null ? `loading ${Math.floor(m.progress * 100)} %` : m.state;
      tr.append(cell("td", m.name), cell("td", state), cell("td", m.task), cell("td", m.core_pid ?? ""),
        cell("td", m.holders), cell("td", m.error ?? ""));
      if (m.server_info) {
        tr.className = m.name === this.model ? "picked" : "pickable";
        tr.addEventListener("click", () => { this.model = m.name; this.refresh(); });
      }
      return tr;
    }));
    return picked?.server_info;
  }

  showReplicas(replicas) {
    $("replicas-card").hidden = !replicas;
    if (!replicas) return;
    $("replicas").tBodies[0].replaceChildren(...replicas.map((r) => {
      const tr = document.createElement("tr");
      tr.append(cell("td", r.index), cell("td", r.pid), cell("td", r.host), cell("td", r.state.num_running),
        cell("td", r.state.num_waiting), cell("td", r.state.kv_blocks_used),
        cell("td", r.state.paused ? "paused" : "serving"));
      return tr;
    }));
  }

  // Per poll interval: tokens generated per second, and the mean TTFT of the requests whose first
  // token came in it (none: a gap in the line).
  showCharts() {
    const tps = [];
    const ttft = [];
    for (let i = 1; i < this.samples.length; i++) {
      const [a, b] = [this.samples[i - 1], this.samples[i]];
      tps.push([b.t, (b.generated - a.generated) / (b.t - a.t)]);
      const n = b.ttftCount - a.ttftCount;
      ttft.push([b.t, n > 0 ? (1000 * (b.ttftSum - a.ttftSum)) / n : null]);
    }
    const now = this.samples.at(-1).t;
    drawChart($("tps-chart"), tps, now);
    drawChart($("ttft-chart"), ttft, now);
    $("tps-now").textContent = summary(tps, "tok/s", 1);
    $("ttft-now").textContent = summary(ttft, "ms", 0);
  }
}

function summary(series, unit, digits) {
  const values = series.map(([, v]) => v).filter((v) => v !== null);
  if (!values.length) return "no requests yet";
  const fmt = (v) => `${v.toFixed(digits)} ${unit}`;
  return `latest ${fmt(values.at(-1))} · peak ${fmt(Math.max(...values))}`;
}

// A 300x80 chart of the last minute: x is time (now at the right), y from 0 to the peak.
function drawChart(chart, series, now) {
  const peak = Math.max(1e-9, ...series.map(([, v]) => v ?? 0));
  const x = (t) => (300 * (t - now + WINDOW_S)) / WINDOW_S;
  const y = (v) => 76 - (70 * v) / peak;
  const lines = [[]];
  for (const [t, v] of series) {
    if (v === null) lines.push([]);
    else lines.at(-1).push(`${x(t).toFixed(1)},${y(v).toFixed(1)}`);
  }
  chart.replaceChildren(svg("line", { x1: 0, y1: 76, x2: 300, y2: 76, class: "axis" }),
    ...lines.filter((l) => l.length).map((points) =>
      points.length === 1
        ? svg("circle", { cx: points[0].split(",")[0], cy: points[0].split(",")[1], r: 2, class: "dot" })
        : svg("polyline", { points: points.join(" "), class: "line" })));
}

// A half-circle gauge: blocks held by requests, then blocks held only by the prefix cache.
function drawGauge(gauge, used, cached) {
  const point = (f) => {
    const angle = Math.PI * (1 - f);
    return `${(60 + 50 * Math.cos(angle)).toFixed(2)} ${(62 - 50 * Math.sin(angle)).toFixed(2)}`;
  };
  const arc = (from, to, cls) =>
    svg("path", { d: `M ${point(from)} A 50 50 0 0 1 ${point(to)}`, class: cls });
  const label = svg("text", { x: 60, y: 58, class: "gauge-label" });
  label.textContent = `${Math.round(100 * used)} %`;
  const parts = [arc(0, 1, "track")];
  if (cached > 0) parts.push(arc(used, Math.min(1, used + cached), "cached"));
  if (used > 0) parts.push(arc(0, used, "used"));
  gauge.replaceChildren(...parts, label);
}
