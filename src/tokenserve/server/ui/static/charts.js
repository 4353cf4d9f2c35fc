// A small time-series line chart on <canvas>: a few series, y from 0 to the visible maximum,
// gaps where a value is null, the latest values in the legend. Each chart records how many
// points it has drawn, the largest and the latest values in data-points / data-max /
// data-latest (for tests).

const PAD = { left: 48, right: 10, top: 22, bottom: 18 };
const MIN_SPAN_S = 60;  // a young chart shows at least the last minute

function formatValue(value) {
  if (value === null || value === undefined) return "–";
  const size = Math.abs(value);
  if (size === 0) return "0";
  if (size >= 100) return value.toFixed(0);
  if (size >= 1) return value.toFixed(2);
  if (size >= 0.001) return value.toFixed(4);
  return value.toExponential(1);
}

export class LineChart {
  /**
   * @param {HTMLCanvasElement} canvas
   * @param {{label: string, color: string}[]} series
   * @param {number} spanSeconds the most history the x axis shows (less while there is less)
   */
  constructor(canvas, series, spanSeconds) {
    this.canvas = canvas;
    this.series = series;
    this.spanSeconds = spanSeconds;
  }

  /** @param {{t: number, values: (number|null)[]}[]} points t in seconds, oldest first */
  draw(points) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width, height = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(width * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const now = points.length ? points[points.length - 1].t : 0;
    const span = Math.min(this.spanSeconds,
      Math.max(MIN_SPAN_S, points.length ? now - points[0].t : 0));
    const visible = points.filter((p) => p.t >= now - span);
    let max = 0;
    for (const p of visible) for (const v of p.values) if (v !== null && v > max) max = v;
    const dataMax = max;
    max = max > 0 ? max * 1.15 : 1;
    const plotW = width - PAD.left - PAD.right, plotH = height - PAD.top - PAD.bottom;
    const x = (t) => PAD.left + plotW * (1 - (now - t) / span);
    const y = (v) => PAD.top + plotH * (1 - v / max);

    g.font = "11px system-ui, sans-serif";
    g.strokeStyle = "#ddd";
    g.fillStyle = "#666";
    g.lineWidth = 1;
    for (const fraction of [0, 0.5, 1]) {
      const value = max * fraction;
      g.beginPath();
      g.moveTo(PAD.left, y(value));
      g.lineTo(width - PAD.right, y(value));
      g.stroke();
      g.textAlign = "right";
      g.fillText(formatValue(value), PAD.left - 4, y(value) + 4);
    }
    g.textAlign = "left";
    g.fillText(span >= 120 ? `-${Math.round(span / 60)} min` : `-${Math.round(span)} s`,
      PAD.left, height - 4);
    g.textAlign = "right";
    g.fillText("now", width - PAD.right, height - 4);

    let drawn = 0;
    const latest = this.series.map(() => null);
    this.series.forEach((s, index) => {
      g.strokeStyle = s.color;
      g.lineWidth = 1.75;
      g.beginPath();
      let open = false;
      for (const p of visible) {
        const v = p.values[index];
        if (v === null || v === undefined) { open = false; continue; }
        drawn += 1;
        latest[index] = v;
        if (open) g.lineTo(x(p.t), y(v));
        else { g.moveTo(x(p.t), y(v)); open = true; }
      }
      g.stroke();
      g.fillStyle = s.color;  // a dot per point, so a lone point shows too
      for (const p of visible) {
        const v = p.values[index];
        if (v !== null && v !== undefined) g.fillRect(x(p.t) - 1.5, y(v) - 1.5, 3, 3);
      }
    });

    let legendX = PAD.left;
    g.textAlign = "left";
    this.series.forEach((s, index) => {
      const text = `${s.label} ${formatValue(latest[index])}`;
      g.fillStyle = s.color;
      g.fillRect(legendX, 8, 10, 3);
      g.fillStyle = "#333";
      g.fillText(text, legendX + 14, 13);
      legendX += g.measureText(text).width + 30;
    });
    canvas.dataset.points = String(drawn);
    canvas.dataset.max = String(dataMax);
    canvas.dataset.latest = JSON.stringify(latest);
  }
}
