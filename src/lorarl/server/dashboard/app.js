// lorarl dashboard: the job list and, for one job, reward (with eval accuracy) / KL / sync-time
// curves as inline SVG, and its newest sample completions.
// No libraries and nothing from the network but this server's /v1 API.
"use strict";

const REFRESH_MS = 3000;
const ACTIVE = new Set(["Pending", "Starting", "Running", "Restarting", null, undefined]);
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART = { width: 420, height: 180, left: 48, right: 12, top: 10, bottom: 24 };
const CHARTS = [
  { id: "chart-reward", key: "rewardMean" },
  { id: "chart-kl", key: "kl" },
  { id: "chart-sync", key: "syncSeconds" },
];

let timer = null;

function $(id) { return document.getElementById(id); }

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  return Math.abs(value) >= 1000 || Number.isInteger(value) ? String(value)
    : String(Number(value.toPrecision(digits || 3)));
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 120) return `${Math.round(seconds)}s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)}m`;
  if (seconds < 172800) return `${Math.round(seconds / 3600)}h`;
  return `${Math.round(seconds / 86400)}d`;
}

class Unauthorized extends Error {}

async function api(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem("lorarl-token");
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(path, { headers });
  if (response.status === 401) throw new Unauthorized("sign in with a bearer token");
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.detail || `${path}: HTTP ${response.status}`);
  return body;
}

function selectedJob() {
  const id = new URLSearchParams(window.location.search).get("job");
  if (!id || !id.includes("/")) return null;
  const cut = id.indexOf("/");
  return { namespace: id.slice(0, cut), name: id.slice(cut + 1), id };
}

function jobPath(job) {
  return `/v1/jobs/${encodeURIComponent(job.namespace)}/${encodeURIComponent(job.name)}`;
}

function renderJobs(items) {
  const body = $("jobs").querySelector("tbody");
  body.replaceChildren();
  const current = selectedJob();
  for (const job of items) {
    const id = `${job.namespace}/${job.name}`;
    const row = el("tr", null, { "data-job": id });
    if (current && current.id === id) row.classList.add("selected");
    row.append(
      el("td", job.namespace), el("td", job.name),
      el("td", job.phase || "–", { class: `phase-${job.phase}` }),
      el("td", job.totalSteps ? `${job.step ?? 0}/${job.totalSteps}` : fmt(job.step)),
      el("td", fmt(job.rewardMean)), el("td", fmt(job.lastSyncSeconds)),
      el("td", age(job.ageSeconds)),
    );
    row.addEventListener("click", () => {
      history.pushState(null, "", `?job=${encodeURIComponent(id)}`);
      refresh();
    });
    body.append(row);
  }
  $("no-jobs").hidden = items.length > 0;
}

// Eval accuracy on data.valFiles by step: the eval before training (step 0), then each step's.
function evalPoints(status, steps) {
  const evals = steps.map((s) => s.eval).filter(Boolean);
  if (status.baselineEval) evals.unshift(status.baselineEval);
  return evals.map((e) => ({ step: e.step, accuracy: e.accuracy }));
}

function drawChart(node, steps, key, second) {
  const points = steps.filter((s) => typeof s[key] === "number");
  const extra = second ? second.points : [];
  const { width, height, left, right, top, bottom } = CHART;
  node.replaceChildren();
  node.setAttribute("width", width);
  node.setAttribute("height", height);
  node.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const x0 = left, x1 = width - right, y0 = height - bottom, y1 = top;
  node.append(svg("line", { class: "axis", x1: x0, y1: y0, x2: x1, y2: y0 }));
  node.append(svg("line", { class: "axis", x1: x0, y1: y0, x2: x0, y2: y1 }));
  if (points.length === 0 && extra.length === 0) {
    const empty = svg("text", { x: (x0 + x1) / 2, y: (y0 + y1) / 2, "text-anchor": "middle" });
    empty.textContent = "no data yet";
    node.append(empty);
    return;
  }
  const stepsDrawn = [...points, ...extra].map((p) => p.step);
  const sMin = Math.min(...stepsDrawn), sMax = Math.max(...stepsDrawn);
  const values = [...points.map((p) => p[key]), ...extra.map((p) => p[second.key])];
  let vMin = Math.min(...values);
  let vMax = Math.max(...values);
  if (vMin === vMax) { vMin -= 0.5; vMax += 0.5; }
  const sx = (s) => (sMax === sMin ? (x0 + x1) / 2 : x0 + ((s - sMin) / (sMax - sMin)) * (x1 - x0));
  const sy = (v) => y0 - ((v - vMin) / (vMax - vMin)) * (y0 - y1);
  const coords = points.map((p) => `${sx(p.step).toFixed(1)},${sy(p[key]).toFixed(1)}`);
  node.append(svg("polyline", { class: "line", points: coords.join(" ") }));
  for (const p of points) {
    const dot = svg("circle", {
      class: "point", cx: sx(p.step).toFixed(1), cy: sy(p[key]).toFixed(1), r: 2.5,
      "data-step": p.step, "data-value": p[key],
    });
    const tip = svg("title");
    tip.textContent = `step ${p.step}: ${fmt(p[key], 4)}`;
    dot.append(tip);
    node.append(dot);
  }
  if (extra.length) {
    const line = extra.map((p) => `${sx(p.step).toFixed(1)},${sy(p[second.key]).toFixed(1)}`);
    node.append(svg("polyline", { class: "line second", points: line.join(" ") }));
    for (const p of extra) {
      const dot = svg("circle", {
        class: "point second", cx: sx(p.step).toFixed(1), cy: sy(p[second.key]).toFixed(1), r: 3,
        "data-eval-step": p.step, "data-value": p[second.key],
      });
      const tip = svg("title");
      tip.textContent = `${second.label} at step ${p.step}: ${fmt(p[second.key], 4)}`;
      dot.append(tip);
      node.append(dot);
    }
  }
  const label = (text, attrs) => { const t = svg("text", attrs); t.textContent = text; return t; };
  node.append(
    label(fmt(vMax), { x: x0 - 4, y: y1 + 8, "text-anchor": "end" }),
    label(fmt(vMin), { x: x0 - 4, y: y0, "text-anchor": "end" }),
    label(`step ${sMin}`, { x: x0, y: height - 6 }),
    label(`step ${sMax}`, { x: x1, y: height - 6, "text-anchor": "end" }),
  );
}

function renderDetail(detail, metrics) {
  $("detail").hidden = false;
  $("detail-title").textContent = `${detail.namespace}/${detail.name}`;
  const notes = [detail.detail, metrics.detail].filter(Boolean);
  $("detail-note").hidden = notes.length === 0;
  $("detail-note").textContent = notes.join(" — ");
  const status = detail.status || {};
  const spec = detail.spec || {};
  const facts = [
    ["Phase", status.phase], ["Step", `${status.step ?? 0}/${status.totalSteps ?? "?"}`],
    ["Model", spec.model], ["Algorithm", spec.algorithm],
    ["LoRA", spec.loraRank ? `r=${spec.loraRank}, alpha=${spec.loraAlpha}` : null],
    ["Trainer / rollout", spec.trainerReplicas ? `${spec.trainerReplicas} / ${spec.rolloutReplicas}`
      : null],
    ["Engine", spec.engine ? `${spec.engine} (${spec.syncMode})` : null],
    ["Adapter", status.adapterPath],
  ];
  const dl = $("detail-facts");
  dl.replaceChildren();
  for (const [k, v] of facts) {
    if (v === null || v === undefined) continue;
    dl.append(el("dt", k), el("dd", v));
  }
  const evals = {
    points: evalPoints(status, metrics.steps), key: "accuracy", label: "eval accuracy",
  };
  for (const chart of CHARTS) {
    drawChart($(chart.id), metrics.steps, chart.key, chart.id === "chart-reward" ? evals : null);
  }
  $("eval-legend").hidden = evals.points.length === 0;
  const body = $("conditions").querySelector("tbody");
  body.replaceChildren();
  for (const c of detail.conditions || []) {
    const row = el("tr");
    row.append(el("td", c.type), el("td", c.status), el("td", c.reason), el("td", c.message));
    body.append(row);
  }
}

// The newest sample completions, newest first; texts as text (never HTML).
function renderSamples(reply) {
  const samples = reply && Array.isArray(reply.samples) ? reply.samples : [];
  $("samples-block").hidden = samples.length === 0;
  const body = $("samples").querySelector("tbody");
  body.replaceChildren();
  const text = (value) => {
    const td = el("td");
    td.append(el("div", value, { class: "text" }));
    return td;
  };
  for (const s of [...samples].reverse()) {
    const row = el("tr", null, { "data-step": s.step });
    row.append(
      el("td", s.step), el("td", fmt(s.reward)), el("td", fmt(s.advantage)),
      el("td", s.finishReason), text(s.prompt), text(s.completion),
    );
    body.append(row);
  }
}

async function refresh() {
  clearTimeout(timer);
  let active = false;
  try {
    const list = await api("/v1/jobs");
    renderJobs(list.items);
    active = list.items.some((j) => ACTIVE.has(j.phase));
    const job = selectedJob();
    if (job) {
      const [detail, metrics, samples] = await Promise.all([
        api(jobPath(job)), api(`${jobPath(job)}/metrics`),
        api(`${jobPath(job)}/samples`).catch(() => null), // optional: never blocks the charts
      ]);
      renderDetail(detail, metrics);
      renderSamples(samples);
      active = ACTIVE.has(detail.status && detail.status.phase);
    } else {
      $("detail").hidden = true;
    }
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.loaded = "true";
  } catch (err) {
    if (err instanceof Unauthorized) {
      $("login").hidden = false;
      active = false;
    } else {
      active = true; // transient: try again
    }
    $("status").textContent = err.message;
  }
  if (active) timer = setTimeout(refresh, REFRESH_MS);
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("lorarl-token", $("token").value.trim());
  $("login").hidden = true;
  refresh();
});
window.addEventListener("popstate", refresh);
refresh();
