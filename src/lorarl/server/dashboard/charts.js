// lorarl dashboard charts: one uPlot chart per metric over steps, every plotted run one colour.
// uPlot (MIT) is vendored in vendor/ (scripts/update_dashboard_vendor.sh): nothing loads from
// the network. A missing value (null in the step history) is a gap in the line, never a zero.
"use strict";

const PALETTE = ["#1a6fd1", "#d9822b", "#1d8a4a", "#c62828", "#7b4fc9", "#00838f", "#8d6e00",
  "#ad1457"];
const DASHED = [6, 4];
// Each chart: its y axis label and, per run, one series per metric key. `sparse` series (the
// evals) are drawn only where they exist, joined by a dashed line with their points shown. A
// series with `scale: "y2"` uses the right axis (`y2`). A chart with `onlyWith` is shown only
// when some plotted run reports that metric (the critic: ppo runs only; episodes: multi-turn).
const CHART_SPECS = [
  { id: "reward", title: "Reward (mean) and eval accuracy", y: "reward / accuracy",
    series: [{ key: "rewardMean", label: "reward" },
      { key: "evalAccuracy", label: "eval accuracy", dash: DASHED, sparse: true }] },
  { id: "kl", title: "KL to the reference", y: "KL", series: [{ key: "kl", label: "KL" }] },
  { id: "entropy", title: "Entropy (per token)", y: "entropy",
    series: [{ key: "entropy", label: "entropy" }] },
  { id: "length", title: "Response length (mean)", y: "tokens",
    series: [{ key: "responseLengthMean", label: "tokens" }] },
  { id: "clip", title: "Clip fractions", y: "fraction of tokens", fraction: true,
    series: [{ key: "clipFraction", label: "clip" },
      { key: "clipFractionFirstUpdate", label: "clip, first update", dash: DASHED },
      { key: "tisClipFrac", label: "rollout correction", dash: [2, 3] }] },
  { id: "critic", title: "Critic (ppo): value loss and explained variance", y: "value loss",
    y2: "explained variance", onlyWith: "valueLoss",
    series: [{ key: "valueLoss", label: "value loss" },
      { key: "explainedVariance", label: "explained variance", dash: DASHED, scale: "y2" }] },
  { id: "episodes", title: "Episodes (spec.environment): turns and tool calls", y: "turns",
    y2: "tool calls", onlyWith: "turnsMean",
    series: [{ key: "turnsMean", label: "turns per episode" },
      { key: "toolCalls", label: "tool calls", dash: DASHED, scale: "y2" },
      { key: "toolErrors", label: "tool errors", dash: [2, 3], scale: "y2" }] },
  { id: "sync", title: "Weight sync time", y: "seconds",
    series: [{ key: "syncSeconds", label: "sync s" }] },
  { id: "tps", title: "Throughput", y: "tokens/s",
    series: [{ key: "tokensPerSecond", label: "tokens/s" }] },
];
const CHART_HEIGHT = 210;
const MIN_CHART_WIDTH = 420;

// The uPlot instances by chart id; the browser tests read them (series, axes, data).
window.lorarlCharts = {};

function formatValue(value) {
  if (value === null || value === undefined) return "–";
  if (Math.abs(value) >= 1000 || Number.isInteger(value)) return String(value);
  return String(Number(value.toPrecision(4)));
}

// [steps, values]: one (x, y) table for uPlot.join; null where the record has no number.
function seriesTable(run, key) {
  if (key === "evalAccuracy") {
    const points = run.evals.filter((e) => typeof e.accuracy === "number");
    return [points.map((e) => e.step), points.map((e) => e.accuracy)];
  }
  return [run.steps.map((s) => s.step),
    run.steps.map((s) => (typeof s[key] === "number" ? s[key] : null))];
}

// uPlot's data (steps joined over all tables: a step one run lacks is `undefined`, which uPlot
// bridges, while an explicit null stays a gap) and its series options.
function chartData(spec, runs) {
  const tables = [];
  const series = [{ label: "step", value: (u, v) => formatValue(v) }];
  for (const run of runs) {
    for (const s of spec.series) {
      const table = seriesTable(run, s.key);
      if (s.sparse && table[0].length === 0) continue; // a run without evals: no eval series
      tables.push(table);
      const label = spec.series.length > 1 ? `${run.label} ${s.label}` : run.label;
      series.push({
        label, stroke: run.colour, width: 1.5, dash: s.dash, spanGaps: Boolean(s.sparse),
        scale: s.scale || "y",
        points: s.sparse ? { show: true, size: 6, fill: run.colour } : {},
        value: (u, v) => formatValue(v),
      });
    }
  }
  if (tables.length === 0) return { data: [[]], series };
  return { data: uPlot.join(tables), series };
}

function chartOptions(spec, series, width) {
  return {
    width, height: CHART_HEIGHT, series,
    // A fraction's axis starts at 0 and shows at least 0-0.05 (uPlot would span 0-100 for zeros).
    scales: { x: { time: false },
      ...(spec.fraction ? { y: { range: (u, min, max) => [0, Math.max(max || 0, 0.05) * 1.05] } }
        : {}) },
    axes: [
      { label: "step", labelSize: 18, size: 32 },
      { label: spec.y, labelSize: 18, size: 56, values: (u, ticks) => ticks.map(formatValue) },
      ...(spec.y2 ? [{ scale: "y2", side: 1, label: spec.y2, labelSize: 18, size: 56,
        grid: { show: false }, values: (u, ticks) => ticks.map(formatValue) }] : []),
    ],
    // Values at exactly the hovered step (uPlot would show a sparse series' nearest point).
    cursor: { sync: { key: "lorarl-steps" }, drag: { x: false, y: false },
      dataIdx: (u, seriesIdx, hoveredIdx) => hoveredIdx },
    legend: { live: true },
  };
}

function chartWidth(container) {
  const gap = 16;
  // 20 px to spare: a scroll bar may appear once the charts make the page taller.
  const total = Math.max(container.clientWidth - 20, MIN_CHART_WIDTH);
  const columns = Math.max(1, Math.floor((total + gap) / (MIN_CHART_WIDTH + gap)));
  return Math.floor((total - gap * (columns - 1)) / columns) - 2;
}

// Draws (or updates in place, keeping the hover) every chart for `runs`:
// [{id, label, colour, steps, evals}].
function drawCharts(container, runs) {
  const width = chartWidth(container);
  for (const spec of CHART_SPECS) {
    const figure = document.getElementById(`chart-${spec.id}`);
    const shown = !spec.onlyWith
      || runs.some((run) => run.steps.some((s) => typeof s[spec.onlyWith] === "number"));
    figure.hidden = !shown;
    if (!shown) { // no run reports it: no chart at all (not an empty one)
      if (window.lorarlCharts[spec.id]) window.lorarlCharts[spec.id].destroy();
      delete window.lorarlCharts[spec.id];
      continue;
    }
    const { data, series } = chartData(spec, runs);
    const signature = JSON.stringify(series.map((s) => [s.label, s.stroke]));
    let plot = window.lorarlCharts[spec.id];
    if (plot && plot.lorarlSignature === signature) {
      plot.setData(data);
      if (plot.width !== width) plot.setSize({ width, height: CHART_HEIGHT });
    } else {
      if (plot) plot.destroy();
      const target = figure.querySelector(".plot");
      target.replaceChildren();
      plot = new uPlot(chartOptions(spec, series, width), data, target);
      plot.lorarlSignature = signature;
      window.lorarlCharts[spec.id] = plot;
    }
    const empty = data.slice(1).every((ys) => ys.every((v) => v === null || v === undefined));
    figure.classList.toggle("empty", empty);
  }
}

function chartFigures() {
  return CHART_SPECS.map((spec) => {
    const figure = document.createElement("figure");
    figure.id = `chart-${spec.id}`;
    figure.hidden = Boolean(spec.onlyWith); // until a plotted run reports the metric
    const caption = document.createElement("figcaption");
    caption.textContent = spec.title;
    const none = document.createElement("span");
    none.className = "no-data";
    none.textContent = " (no data)";
    caption.append(none);
    const plot = document.createElement("div");
    plot.className = "plot";
    figure.append(caption, plot);
    return figure;
  });
}

function runColour(index) { return PALETTE[index % PALETTE.length]; }
