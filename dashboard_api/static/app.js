// fedatoms dashboard: polls /api/v1 and redraws. Rounds, bandwidth and interval histories are
// fetched incrementally (`after` the last closed round already held), so a long federation costs
// one small request per resource per poll. Every plotted series is exposed on
// window.fedatomsDashboard.series, and each chart element carries data-points / data-rounds.
"use strict";

(function () {
  const API = "/api/v1";
  const POLL_MS = Math.max(500, parseInt(document.body.dataset.pollMs, 10) || 3000);
  const PAGE = 1000;
  const CLIENT_PAGE = 50;
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f",
    "#a16207", "#475569", "#7c3aed", "#0f766e", "#b45309", "#1d4ed8", "#15803d", "#c026d3"];
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

  const state = {
    rounds: new Map(), // number → round
    bandwidth: [], // rounds with transfers, ascending (the open one included)
    intervalRounds: [], // closed rounds covered by the interval histories
    tensors: new Map(), // name → {name, ordinal, role, interval, version, history: []}
    clientOffset: 0,
    polls: 0,
  };
  const charts = {};
  // saving_ratio is FedAvg-equivalent ÷ moved: above 1 the federation moved fewer bytes than FedAvg would have
  function versusFedAvg(ratio) {
    return ratio >= 1 ? `${ratio.toFixed(2)}× fewer` : `${(1 / ratio).toFixed(2)}× more`;
  }
  const dashboard = { series: {}, polls: 0, lastError: null, versusFedAvg };
  window.fedatomsDashboard = dashboard;

  // ---------------------------------------------------------------- access

  const token = (function () {
    const m = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem("fedatoms-token", decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
    return sessionStorage.getItem("fedatoms-token");
  })();

  async function get(path) {
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = "Bearer " + token;
    const response = await fetch(API + path, { headers });
    if (!response.ok) {
      let detail = response.statusText;
      try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
      throw new Error(`${path}: ${response.status} ${typeof detail === "string" ? detail : JSON.stringify(detail)}`);
    }
    return response.json();
  }

  // ---------------------------------------------------------------- formatting

  const $ = (id) => document.getElementById(id);
  const pct = (v) => (v == null ? "–" : (100 * v).toFixed(1) + " %");
  const num = (v, d = 3) => (v == null ? "–" : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(2) : v.toFixed(d));
  function bytes(v) {
    if (v == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
  }
  function ago(iso) {
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (s < 90) return s.toFixed(0) + " s ago";
    if (s < 5400) return (s / 60).toFixed(0) + " min ago";
    if (s < 172800) return (s / 3600).toFixed(1) + " h ago";
    return (s / 86400).toFixed(0) + " d ago";
  }
  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }
  function dotCell(row, kind, text) {
    const td = cell(row, "");
    const dot = document.createElement("span");
    dot.className = "dot " + kind;
    td.appendChild(dot);
    td.appendChild(document.createTextNode(text));
  }

  // ---------------------------------------------------------------- fetching

  function stableAfter() {
    // the highest round such that it and every round before it can no longer change: a closed round still
    // gains its clients' evaluations (reported with their next calls) and evaluation fetches, so the two
    // newest closed rounds are fetched again, as fetchBandwidth does with its rows
    let after = 0;
    const numbers = [...state.rounds.keys()].sort((a, b) => a - b);
    for (const n of numbers) {
      if (n !== after + 1 || state.rounds.get(n).state === "open") break;
      after = n;
    }
    return Math.max(0, after - 2);
  }

  async function fetchRounds() {
    let after = stableAfter();
    for (;;) {
      const page = await get(`/rounds?after=${after}&limit=${PAGE}`);
      for (const r of page.items) state.rounds.set(r.number, r);
      if (page.items.length < PAGE) break;
      after = page.items[page.items.length - 1].number;
    }
  }

  async function fetchBandwidth() {
    let totals = null;
    // the newest rounds may still grow (an open round's pushes, evaluation fetches after a close): fetched again
    state.bandwidth.splice(Math.max(0, state.bandwidth.length - 2));
    for (;;) {
      const after = state.bandwidth.length ? state.bandwidth[state.bandwidth.length - 1].round : 0;
      const data = await get(`/bandwidth?after=${after}&limit=${PAGE}`);
      totals = data.totals;
      state.bandwidth.push(...data.rounds.items);
      if (data.rounds.items.length < PAGE) break;
    }
    return totals;
  }

  async function fetchIntervals() {
    for (;;) {
      const after = state.intervalRounds.length ? state.intervalRounds[state.intervalRounds.length - 1] : 0;
      const data = await get(`/intervals?after=${after}&limit=${PAGE}`);
      state.intervalRounds.push(...data.rounds);
      for (const t of data.tensors) {
        const held = state.tensors.get(t.name);
        if (held) {
          held.history.push(...t.history);
          Object.assign(held, { ordinal: t.ordinal, role: t.role, interval: t.interval, version: t.version });
        } else {
          state.tensors.set(t.name, t);
        }
      }
      if (data.rounds.length < PAGE) break;
    }
  }

  // ---------------------------------------------------------------- charts

  function expose(key, element, x, named) {
    dashboard.series[key] = { x, ...named };
    element.dataset.points = String(x.length);
    element.dataset.rounds = JSON.stringify(x);
  }

  function plot(key, elementId, x, series, opts = {}) {
    const element = $(elementId);
    const named = {};
    series.forEach((s) => { named[s.label] = s.values; });
    expose(key, element, x, named);
    const data = [x, ...series.map((s) => s.values)];
    const labels = series.map((s) => s.label).join("|");
    const existing = charts[key];
    if (existing && existing.labels === labels) {
      existing.plot.setData(data);
      return;
    }
    if (existing) existing.plot.destroy();
    const width = Math.max(300, element.clientWidth || 460);
    const plotOpts = {
      width,
      height: 240,
      scales: { x: { time: false }, y: opts.y || {} },
      axes: [
        { label: "round", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000] },
        { label: opts.yLabel || "", size: 70, values: opts.yValues },
      ],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      series: [
        { label: "round" },
        ...series.map((s, i) => ({
          label: s.label,
          stroke: s.color || COLORS[i % COLORS.length],
          width: 1.5,
          points: { show: x.length < 60 },
          paths: s.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined,
          value: opts.value,
          spanGaps: true,
        })),
      ],
    };
    charts[key] = { plot: new uPlot(plotOpts, data, element), labels };
  }

  const positive = (v) => (v != null && v > 0 ? v : null);
  const logTicks = (u, values) => values.map((v) => (v == null ? "" : v >= 1e-2 && v < 1e4 ? String(+v.toPrecision(3)) : v.toExponential(0)));

  function drawRounds() {
    const closed = [...state.rounds.values()].filter((r) => r.state === "closed").sort((a, b) => a.number - b.number);
    const x = closed.map((r) => r.number);
    // the global model cut to each tier below 1 (what those clients run), largest tier first
    const tiers = [...new Set(closed.flatMap((r) => Object.keys(r.tier_accuracy || {})))].sort((a, b) => b - a);
    plot("accuracy", "chart-accuracy", x, [
      { label: "global (server test set)", values: closed.map((r) => r.test_accuracy) },
      ...tiers.map((t) => ({ label: `cut to tier ${t} (server test set)`, values: closed.map((r) => (r.tier_accuracy || {})[t] ?? null) })),
      { label: "clients, global model", values: closed.map((r) => r.mean_client_accuracy) },
      { label: "clients, personalized", values: closed.map((r) => r.personalized_accuracy) },
    ], { y: { range: [0, 1] }, yLabel: "accuracy", value: (u, v) => pct(v) });
    plot("dispersion", "chart-dispersion", x, [
      { label: "client spread (within round)", values: closed.map((r) => positive(r.dispersion)) },
    ], { y: { distr: 3 }, yLabel: "client spread", yValues: logTicks, value: (u, v) => num(v) });
  }

  function sortedTensors() {
    const at = (t) => (t.ordinal == null ? Infinity : t.ordinal); // unplaced (no round closed yet): last, by name
    return [...state.tensors.values()].sort((a, b) => at(a) - at(b) || a.name.localeCompare(b.name));
  }

  function drawTensors() {
    const x = state.intervalRounds;
    const index = new Map(x.map((r, i) => [r, i]));
    const tensors = sortedTensors();
    const aligned = (t, key) => {
      const values = new Array(x.length).fill(null);
      for (const p of t.history) if (index.has(p.round)) values[index.get(p.round)] = p[key];
      return values;
    };
    plot("dl", "chart-dl", x, tensors.map((t) => ({ label: t.name, values: aligned(t, "d_l").map(positive) })),
      { y: { distr: 3 }, yLabel: "d_l", yValues: logTicks, value: (u, v) => num(v) });
    plot("intervals", "chart-intervals", x, tensors.map((t) => ({ label: t.name, values: aligned(t, "interval"), stepped: true })),
      { yLabel: "τ_l (rounds)", value: (u, v) => (v == null ? "–" : String(v)) });
    drawHeatmap(x, tensors.map((t) => ({ name: t.name, values: aligned(t, "dispersion") })));
  }

  function viridis(f) {
    const s = Math.min(1, Math.max(0, f)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(s));
    const t = s - i;
    const c = VIRIDIS[i].map((a, k) => Math.round(a + t * (VIRIDIS[i + 1][k] - a)));
    return `rgb(${c[0]},${c[1]},${c[2]})`;
  }

  function drawHeatmap(x, rows) {
    const holder = $("heatmap");
    const canvas = $("heatmap-canvas");
    const logs = rows.map((r) => r.values.map((v) => (v != null && v > 0 ? Math.log10(v) : null)));
    const flat = logs.flat().filter((v) => v != null);
    expose("heatmap", holder, x, Object.fromEntries(rows.map((r) => [r.name, r.values])));
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(300, holder.clientWidth);
    const rowHeight = Math.max(14, Math.min(26, 300 / Math.max(1, rows.length)));
    const height = rows.length * rowHeight + 24;
    canvas.style.height = height + "px";
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "12px system-ui, sans-serif";
    const left = Math.min(220, 12 + Math.max(0, ...rows.map((r) => ctx.measureText(r.name).width)));
    const plotWidth = width - left - 8;
    const lo = flat.length ? Math.min(...flat) : 0;
    const hi = flat.length ? Math.max(...flat) : 1;
    $("heat-min").textContent = flat.length ? "10^" + lo.toFixed(1) : "–";
    $("heat-max").textContent = flat.length ? "10^" + hi.toFixed(1) : "–";
    const cols = x.length;
    const cw = cols ? plotWidth / cols : 0;
    rows.forEach((r, i) => {
      const y = i * rowHeight;
      ctx.fillStyle = "#1d2330";
      ctx.textBaseline = "middle";
      ctx.fillText(r.name, 4, y + rowHeight / 2, left - 8);
      logs[i].forEach((v, j) => {
        ctx.fillStyle = v == null ? "#eef0f3" : viridis(hi > lo ? (v - lo) / (hi - lo) : 0.5);
        ctx.fillRect(left + j * cw, y + 1, Math.max(1, cw - (cw > 4 ? 1 : 0)), rowHeight - 2);
      });
    });
    ctx.fillStyle = "#667085";
    ctx.textBaseline = "top";
    const step = Math.max(1, Math.ceil(cols / Math.max(1, plotWidth / 60)));
    for (let j = 0; j < cols; j += step) ctx.fillText(String(x[j]), left + j * cw, rows.length * rowHeight + 6);
  }

  function drawBandwidth() {
    const rows = state.bandwidth;
    const x = rows.map((r) => r.round);
    plot("bytes", "chart-bytes", x, [
      { label: "moved (down + up)", values: rows.map((r) => r.cumulative_bytes_down + r.cumulative_bytes_up) },
      { label: "FedAvg-equivalent", values: rows.map((r) => r.cumulative_fedavg_equivalent_bytes), color: "#9ca3af" },
    ], { yLabel: "cumulative bytes", yValues: (u, vals) => vals.map(bytes), value: (u, v) => bytes(v) });
    plot("roundBytes", "chart-round-bytes", x, [
      { label: "down", values: rows.map((r) => r.bytes_down) },
      { label: "up", values: rows.map((r) => r.bytes_up) },
    ], { yLabel: "bytes", yValues: (u, vals) => vals.map(bytes), value: (u, v) => bytes(v) });
  }

  // ---------------------------------------------------------------- header and tables

  function drawFederation(fed, totals) {
    $("fed-name").textContent = fed.name;
    const badge = $("fed-state");
    badge.textContent = fed.state;
    badge.className = "badge " + fed.state;
    const planned = fed.rounds_planned ? " / " + fed.rounds_planned : "";
    $("stat-round").textContent = fed.current_round + planned + (fed.open_round ? " (open)" : "");
    $("stat-clients").textContent = `${fed.clients_online} / ${fed.clients_registered}`;
    const last = [...state.rounds.values()].filter((r) => r.test_accuracy != null).sort((a, b) => b.number - a.number)[0];
    $("stat-accuracy").textContent = last ? pct(last.test_accuracy) : "–";
    $("stat-saving").textContent = totals && totals.saving_ratio != null
      ? `${bytes(totals.bytes_down + totals.bytes_up)} (${versusFedAvg(totals.saving_ratio)})` : "–";
    const c = fed.config || {};
    $("stat-method").textContent = [c.model, c.factorization, c.strategy, c.interval_policy].filter(Boolean).join(" · ");
  }

  function drawRoundsTable() {
    const all = [...state.rounds.values()].sort((a, b) => b.number - a.number);
    $("rounds-total").textContent = `(${all.length}, newest first${all.length > 100 ? ", last 100 shown" : ""})`;
    const body = document.querySelector("#rounds-table tbody");
    body.replaceChildren(...all.slice(0, 100).map((r) => {
      const tr = document.createElement("tr");
      cell(tr, String(r.number));
      dotCell(tr, r.state, r.state);
      cell(tr, String(r.cohort_size));
      cell(tr, String(r.reported));
      cell(tr, String(r.late_pushes));
      cell(tr, r.duration_seconds == null ? "–" : r.duration_seconds.toFixed(2) + " s");
      cell(tr, pct(r.test_accuracy));
      cell(tr, pct(r.mean_client_accuracy));
      cell(tr, pct(r.personalized_accuracy));
      cell(tr, num(r.dispersion));
      cell(tr, bytes(r.bytes_down));
      cell(tr, bytes(r.bytes_up));
      return tr;
    }));
  }

  async function drawClients() {
    const page = await get(`/clients?offset=${state.clientOffset}&limit=${CLIENT_PAGE}`);
    if (page.total > 0 && state.clientOffset >= page.total) {
      state.clientOffset = Math.max(0, page.total - CLIENT_PAGE);
      return drawClients();
    }
    $("clients-total").textContent = `(${page.total})`;
    $("clients-range").textContent = page.total
      ? `${page.offset + 1}–${page.offset + page.items.length} of ${page.total}` : "none yet";
    $("clients-prev").disabled = page.offset === 0;
    $("clients-next").disabled = page.offset + page.items.length >= page.total;
    const body = document.querySelector("#clients-table tbody");
    body.replaceChildren(...page.items.map((c) => {
      const tr = document.createElement("tr");
      if (c.revoked) tr.className = "revoked";
      cell(tr, c.name);
      const id = cell(tr, "");
      const code = document.createElement("code");
      code.textContent = c.id.slice(0, 12);
      code.title = c.id;
      id.appendChild(code);
      cell(tr, String(c.tier));
      const status = c.revoked ? "revoked" : c.online ? "online" : "offline";
      dotCell(tr, status, status);
      cell(tr, ago(c.last_seen)).title = c.last_seen;
      cell(tr, String(c.rounds_joined));
      cell(tr, bytes(c.bytes_up));
      cell(tr, bytes(c.bytes_down));
      cell(tr, pct(c.last_accuracy));
      return tr;
    }));
  }

  // ---------------------------------------------------------------- the loop

  async function poll() {
    const status = $("status");
    try {
      const fed = await get("/federation");
      await fetchRounds();
      const totals = await fetchBandwidth();
      await fetchIntervals();
      drawFederation(fed, totals);
      drawRounds();
      drawTensors();
      drawBandwidth();
      drawRoundsTable();
      await drawClients();
      state.polls += 1;
      dashboard.polls = state.polls;
      dashboard.lastError = null;
      status.className = "muted";
      status.textContent = "updated " + new Date().toLocaleTimeString();
    } catch (err) {
      dashboard.lastError = String(err.message || err);
      status.className = "error";
      status.textContent = dashboard.lastError;
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  $("clients-prev").addEventListener("click", () => {
    state.clientOffset = Math.max(0, state.clientOffset - CLIENT_PAGE);
    drawClients().catch((err) => { $("status").textContent = String(err.message || err); });
  });
  $("clients-next").addEventListener("click", () => {
    state.clientOffset += CLIENT_PAGE;
    drawClients().catch((err) => { $("status").textContent = String(err.message || err); });
  });
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      for (const [key, chart] of Object.entries(charts)) {
        const element = chart.plot.root.parentElement;
        chart.plot.setSize({ width: Math.max(300, element.clientWidth), height: 240 });
        charts[key] = chart;
      }
      drawTensors();
    }, 200);
  });
  poll();
})();
