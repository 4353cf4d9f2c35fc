// The dashboard: every 2 s one GET /ui/api/stats (cumulative counters and histogram buckets,
// as in /metrics); rates come from consecutive snapshots, percentiles and the prefix-cache hit
// rate from the change over the last 60 s (like Prometheus' rate and histogram_quantile).
import { apiFetch, showError } from "./api.js";
import { LineChart } from "./charts.js";

const POLL_MS = 2000;
const WINDOW_S = 60;       // percentiles and hit rate over this much history
const SPAN_S = 300;        // what the charts show
const QUEUE_FULL = "queue_full";

const $ = (id) => document.getElementById(id);

// Prometheus' histogram_quantile: linear inside the bucket the rank falls in.
export function quantile(q, edges, counts) {
  const total = counts[counts.length - 1];
  if (!total) return null;
  const rank = q * total;
  const i = counts.findIndex((count) => count >= rank);
  if (edges[i] === "+Inf") return i > 0 ? edges[i - 1] : null;
  const lower = i > 0 ? edges[i - 1] : 0, below = i > 0 ? counts[i - 1] : 0;
  const inBucket = counts[i] - below;
  return inBucket > 0 ? lower + (edges[i] - lower) * (rank - below) / inBucket : edges[i];
}

const increase = (now, before) => Math.max(0, now - before);  // 0 across a restart

function bucketIncrease(now, before) {
  if (!before || before.counts.length !== now.counts.length) return now.counts;
  return now.counts.map((count, i) => increase(count, before.counts[i]));
}

const sum = (object, skip) => Object.entries(object || {})
  .filter(([key]) => key !== skip).reduce((total, [, value]) => total + value, 0);

export class Dashboard {
  constructor() {
    this.snapshots = [];   // [{t, metrics}], oldest first
    this.points = { tps: [], ttft: [], itl: [], requests: [], cache: [], errors: [] };
    this.visible = false;
    this.timer = null;
    this.charts = {
      tps: new LineChart($("chart-tps"), [{ label: "tok/s", color: "#268bd2" }], SPAN_S),
      ttft: new LineChart($("chart-ttft"), [{ label: "P50", color: "#2aa198" },
        { label: "P99", color: "#d33682" }], SPAN_S),
      itl: new LineChart($("chart-itl"), [{ label: "P50", color: "#2aa198" },
        { label: "P99", color: "#d33682" }], SPAN_S),
      requests: new LineChart($("chart-requests"), [{ label: "running", color: "#859900" },
        { label: "waiting", color: "#b58900" }], SPAN_S),
      cache: new LineChart($("chart-cache"), [{ label: "KV cache", color: "#6c71c4" },
        { label: "prefix hits", color: "#cb4b16" }], SPAN_S),
      errors: new LineChart($("chart-errors"), [{ label: "429/s", color: "#dc322f" },
        { label: "refused/s", color: "#93a1a1" }], SPAN_S),
    };
  }

  start() {
    this.poll();
    this.timer = setInterval(() => this.poll(), POLL_MS);
  }

  setVisible(visible) {
    this.visible = visible;
    if (visible) this.draw();
  }

  async poll() {
    let stats;
    try {
      stats = await (await apiFetch("/ui/api/stats")).json();
    } catch (error) {
      if (this.visible) showError(error);
      $("dashboard-updated").textContent = "(not updating: see the error above)";
      return;
    }
    this.add(stats.time, stats.metrics);
    this.renderModels(stats.models);
    const updated = new Date(stats.time * 1000).toLocaleTimeString();
    $("dashboard-updated").textContent = `Updated ${updated}.`;
    if (this.visible) this.draw();
  }

  add(t, metrics) {
    const previous = this.snapshots[this.snapshots.length - 1];
    this.snapshots.push({ t, metrics });
    while (this.snapshots.length > 2 && this.snapshots[1].t <= t - SPAN_S - WINDOW_S) {
      this.snapshots.shift();
    }
    if (!previous) return;
    const dt = t - previous.t;
    if (dt <= 0) return;
    // the oldest snapshot inside the window (the previous one if none but this one is)
    const windowStart = this.snapshots.find((s) => s.t >= t - WINDOW_S);
    const before = windowStart.t < t ? windowStart : previous;
    const old = before.metrics, prev = previous.metrics;
    const rate = (now, then) => increase(now, then) / dt;
    const percentiles = (key) => {
      const counts = bucketIncrease(metrics[key], old[key]);
      return [quantile(0.5, metrics[key].le, counts), quantile(0.99, metrics[key].le, counts)];
    };
    const queries = increase(metrics.num_prefix_cache_queries, old.num_prefix_cache_queries);
    const hits = increase(metrics.num_prefix_cache_hits, old.num_prefix_cache_hits);
    const push = (name, values) => {
      const series = this.points[name];
      series.push({ t, values });
      while (series.length && series[0].t < t - SPAN_S) series.shift();
    };
    push("tps", [rate(metrics.num_generation_tokens, prev.num_generation_tokens)]);
    push("ttft", percentiles("ttft"));
    push("itl", percentiles("itl"));
    push("requests", [metrics.num_running, metrics.num_waiting]);
    push("cache", [metrics.kv_cache_usage === null ? null : 100 * metrics.kv_cache_usage,
      queries > 0 ? 100 * hits / queries : null]);
    push("errors", [rate(metrics.rejected[QUEUE_FULL] || 0, prev.rejected[QUEUE_FULL] || 0),
      rate(sum(metrics.rejected, QUEUE_FULL), sum(prev.rejected, QUEUE_FULL))]);
  }

  draw() {
    for (const [name, chart] of Object.entries(this.charts)) chart.draw(this.points[name]);
  }

  renderModels(models) {
    const rows = [];
    for (const model of models) {
      const labelsOf = (version) => Object.entries(model.labels)
        .filter(([, v]) => v === version).map(([label]) => label).join(", ");
      if (!model.model_version_status.length) {
        rows.push([model.name, "–", "–", model.error || "no versions", ""]);
      }
      for (const status of model.model_version_status) {
        const error = status.status || {};
        const text = error.error_message ? `${error.error_code}: ${error.error_message}`
          : error.error_code || "OK";
        rows.push([model.name, status.version, status.state, text, labelsOf(status.version)]);
      }
    }
    $("models-table").tBodies[0].replaceChildren(...rows.map((cells) => {
      const row = document.createElement("tr");
      for (const cell of cells) {
        const td = document.createElement("td");
        td.textContent = cell;
        row.append(td);
      }
      row.dataset.state = cells[2];
      return row;
    }));
  }
}
