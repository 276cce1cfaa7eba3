// lorarl dashboard: the job list (with a check box per job: plot it), the metric charts of every
// plotted run (charts.js), and the selected job's facts, conditions and newest samples.
// Nothing from the network but this server's /v1 API; texts are always set as text, never HTML.
"use strict";

const REFRESH_MS = 3000;
const ACTIVE = new Set(["Pending", "Starting", "Running", "Restarting", null, undefined]);

let timer = null;

function $(id) { return document.getElementById(id); }

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
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

function parseJob(id) {
  if (!id || !id.includes("/")) return null;
  const cut = id.indexOf("/");
  return { namespace: id.slice(0, cut), name: id.slice(cut + 1), id };
}

// The page's state lives in its URL: ?job=<ns/name> (the selected job) and &plot=<ns/name> for
// every other run on the charts.
function urlState() {
  const query = new URLSearchParams(window.location.search);
  return { job: parseJob(query.get("job")), plot: query.getAll("plot").filter(parseJob) };
}

function setUrl(job, plot) {
  const query = new URLSearchParams();
  if (job) query.set("job", job);
  for (const id of plot) if (id !== job) query.append("plot", id);
  history.pushState(null, "", `?${query}`);
  refresh();
}

function jobPath(job) {
  return `/v1/jobs/${encodeURIComponent(job.namespace)}/${encodeURIComponent(job.name)}`;
}

// The runs on the charts, in job-list order (which fixes each run's colour).
function plottedIds(items) {
  const { job, plot } = urlState();
  const wanted = new Set(plot);
  if (job) wanted.add(job.id);
  return items.map((j) => `${j.namespace}/${j.name}`).filter((id) => wanted.has(id));
}

function renderJobs(items, plotted) {
  const body = $("jobs").querySelector("tbody");
  body.replaceChildren();
  const { job: current, plot } = urlState();
  items.forEach((job, index) => {
    const id = `${job.namespace}/${job.name}`;
    const row = el("tr", null, { "data-job": id });
    if (current && current.id === id) row.classList.add("selected");
    const box = el("input", null, { type: "checkbox", "data-plot": id, title: "plot this run" });
    box.checked = plotted.includes(id);
    box.disabled = Boolean(current && current.id === id); // the selected job is always plotted
    box.addEventListener("click", (event) => event.stopPropagation());
    box.addEventListener("change", () => {
      const rest = plot.filter((p) => p !== id);
      setUrl(current && current.id, box.checked ? [...rest, id] : rest);
    });
    const pick = el("td", null, { class: "pick" });
    const swatch = el("span", null, { class: "swatch" });
    swatch.style.background = box.checked ? runColour(index) : "transparent";
    pick.append(box, swatch);
    row.append(
      pick, el("td", job.namespace), el("td", job.name),
      el("td", job.phase || "–", { class: `phase-${job.phase}` }),
      el("td", job.totalSteps ? `${job.step ?? 0}/${job.totalSteps}` : fmt(job.step)),
      el("td", fmt(job.rewardMean)), el("td", fmt(job.lastSyncSeconds)),
      el("td", age(job.ageSeconds)),
    );
    row.addEventListener("click", () => setUrl(id, urlState().plot));
    body.append(row);
  });
  $("no-jobs").hidden = items.length > 0;
}

// Eval accuracy on data.valFiles by step: the eval before training (step 0), then each step's.
function evalPoints(status, steps) {
  const evals = steps.map((s) => s.eval).filter(Boolean);
  if (status.baselineEval) evals.unshift(status.baselineEval);
  return evals.map((e) => ({ step: e.step, accuracy: e.accuracy }));
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

// One plotted run's history; a run that fails to load is drawn empty and named in the note.
async function loadRun(id, colour, label) {
  const job = parseJob(id);
  try {
    const [detail, metrics] = await Promise.all([
      api(jobPath(job)), api(`${jobPath(job)}/metrics`),
    ]);
    return { id, label, colour, steps: metrics.steps, detail, metrics,
      evals: evalPoints(detail.status || {}, metrics.steps),
      active: ACTIVE.has(detail.status && detail.status.phase) };
  } catch (err) {
    if (err instanceof Unauthorized) throw err;
    return { id, label, colour, steps: [], evals: [], active: true,
      error: `${id}: ${err.message}` };
  }
}

async function renderCharts(items, plotted) {
  const names = plotted.map((id) => parseJob(id));
  const oneNamespace = new Set(names.map((j) => j.namespace)).size <= 1;
  const order = items.map((j) => `${j.namespace}/${j.name}`);
  const runs = await Promise.all(plotted.map((id, i) => loadRun(
    id, runColour(order.indexOf(id)), oneNamespace ? names[i].name : id)));
  $("charts-section").hidden = runs.length === 0;
  const errors = runs.filter((r) => r.error).map((r) => r.error);
  $("charts-note").hidden = errors.length === 0;
  $("charts-note").textContent = errors.join(" — ");
  if (runs.length) drawCharts($("charts"), runs);
  return runs;
}

async function refresh() {
  clearTimeout(timer);
  let active = false;
  try {
    const list = await api("/v1/jobs");
    const plotted = plottedIds(list.items);
    renderJobs(list.items, plotted);
    active = list.items.some((j) => ACTIVE.has(j.phase));
    const job = urlState().job;
    const [runs, samples] = await Promise.all([
      renderCharts(list.items, plotted),
      job ? api(`${jobPath(job)}/samples`).catch(() => null) : null, // never blocks the charts
    ]);
    if (job) {
      const own = runs.find((r) => r.id === job.id && !r.error);
      const [detail, metrics] = own ? [own.detail, own.metrics]
        : await Promise.all([api(jobPath(job)), api(`${jobPath(job)}/metrics`)]);
      renderDetail(detail, metrics);
      renderSamples(samples);
    } else {
      $("detail").hidden = true;
    }
    active = active || runs.some((r) => r.active);
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

$("charts").append(...chartFigures());
$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("lorarl-token", $("token").value.trim());
  $("login").hidden = true;
  refresh();
});
window.addEventListener("popstate", refresh);
let resizing = null;
window.addEventListener("resize", () => { // redraw at the new width once resizing stops
  clearTimeout(resizing);
  resizing = setTimeout(() => { if (!$("charts-section").hidden) refresh(); }, 200);
});
refresh();
