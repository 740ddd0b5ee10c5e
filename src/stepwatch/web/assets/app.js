// stepwatch dashboard and report: draws what stepwatch.views computed (one script for both).
// window.STEPWATCH says which page and where its data is: fetched from /api/ (mode "server") or
// inlined in the page (mode "report"). Text from the data is always set as textContent, never
// parsed as HTML.
(function () {
  "use strict";
  const SW = window.STEPWATCH || {};
  const $ = (id) => document.getElementById(id);
  const LIBRARY_MISSING = "the charting library (uPlot) did not load: the charts are missing";
  // points a live page's charts hold before it asks for its downsampled data again
  const LIVE_POINTS = 160000;
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf"];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function message(text, kind) {
    const box = $("message");
    box.textContent = text;
    box.className = "message " + (kind || "error");
    box.hidden = false;
  }

  async function getJSON(url, started) {
    const response = await (started || fetch(url, { credentials: "same-origin" }));
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (!response.ok) {
      const error = new Error((body && body.error) || ("HTTP " + response.status + " from " + url));
      error.status = response.status;
      throw error;
    }
    return body;
  }

  const fmt = {
    time(ns) { return ns ? new Date(ns / 1e6).toISOString().replace("T", " ").slice(0, 19) + "Z" : "-"; },
    dur(s) {
      if (s === null || s === undefined) return "-";
      if (s < 60) return s.toFixed(1) + " s";
      if (s < 3600) return (s / 60).toFixed(1) + " min";
      return (s / 3600).toFixed(2) + " h";
    },
    num(v) { return v === null || v === undefined ? "-" : (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : String(v)); },
    ms(v) { return v === null || v === undefined ? "-" : v.toFixed(2) + " ms"; },
  };

  function runLink(sid) { return SW.mode === "report" ? "#" : "/run/" + encodeURIComponent(sid); }

  function section(id, title, ...children) {
    return el("section", { id: id, class: "card" }, el("h2", {}, title), ...children);
  }

  function crumbs(...items) {
    const nav = $("crumbs");
    nav.textContent = "";
    for (const item of items) nav.appendChild(item);
  }

  // -- runs page --------------------------------------------------------------------------------

  async function runsPage() {
    const data = await getJSON("/api/runs");
    const content = $("content");
    content.textContent = "";
    crumbs(el("span", {}, " / runs in " + data.path));
    for (const problem of data.problems) message(problem, data.runs.length ? "warn" : "error");
    const columns = [["session_id", "session"], ["command", "command"], ["started_at_ns", "start"],
      ["duration_s", "duration"], ["outcome", "outcome"], ["status", "status"], ["ranks", "ranks"],
      ["steps", "steps"], ["primary", "primary verdict"], ["alerts", "alerts"]];
    let sortKey = "started_at_ns", sortDir = -1, filter = "";
    const chosen = new Set();
    const table = el("table", { id: "runs", class: "runs" });
    const compare = el("a", { id: "compare-link", class: "button", href: "#", hidden: true }, "compare the two chosen runs");
    const filterBox = el("input", { id: "filter", type: "search", placeholder: "filter (any column)" });
    filterBox.addEventListener("input", () => { filter = filterBox.value.toLowerCase(); draw(); });
    function cell(run, key) {
      const v = run[key];
      if (key === "started_at_ns") return fmt.time(v);
      if (key === "duration_s") return fmt.dur(v);
      return v === null || v === undefined ? "-" : String(v);
    }
    function draw() {
      table.textContent = "";
      const head = el("tr", {}, el("th", {}, ""));
      for (const [key, title] of columns) {
        head.appendChild(el("th", { class: "sortable", "data-key": key, onclick: () => {
          sortDir = sortKey === key ? -sortDir : 1; sortKey = key; draw();
        } }, title + (sortKey === key ? (sortDir > 0 ? " ▲" : " ▼") : "")));
      }
      table.appendChild(el("thead", {}, head));
      const body = el("tbody");
      const rows = data.runs.filter((run) => !filter || columns.some(([k]) => cell(run, k).toLowerCase().includes(filter)));
      rows.sort((a, b) => {
        const x = a[sortKey], y = b[sortKey];
        if (x === y) return 0;
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * sortDir;
      });
      for (const run of rows) {
        const box = el("input", { type: "checkbox", "data-session": run.session_id });
        box.checked = chosen.has(run.session_id);
        box.addEventListener("change", () => {
          if (box.checked) chosen.add(run.session_id); else chosen.delete(run.session_id);
          const pair = Array.from(chosen);
          compare.hidden = pair.length !== 2;
          if (pair.length === 2) compare.href = "/compare?a=" + encodeURIComponent(pair[0]) + "&b=" + encodeURIComponent(pair[1]);
        });
        const tr = el("tr", { "data-session": run.session_id }, el("td", {}, box));
        for (const [key] of columns) {
          const text = cell(run, key);
          tr.appendChild(el("td", { class: "c-" + key }, key === "session_id" ? el("a", { href: runLink(run.session_id) }, text) : text));
        }
        body.appendChild(tr);
      }
      table.appendChild(body);
    }
    draw();
    content.appendChild(section("runs-card", "Runs (" + data.runs.length + ")", el("div", { class: "toolbar" }, filterBox, compare), table));
  }

  // -- run page ---------------------------------------------------------------------------------

  function diagnosisCard(diagnosis) {
    const card = el("section", { id: "diagnosis", class: "card diagnosis" });
    const primary = diagnosis && diagnosis.primary;
    if (!primary) {
      card.appendChild(el("h2", {}, "Diagnosis"));
      card.appendChild(el("p", {}, "not available: " + ((diagnosis && diagnosis.error) || "no verdict")));
      return card;
    }
    card.classList.add("sev-" + primary.severity);
    card.appendChild(el("h2", {}, el("span", { id: "verdict-name", class: "verdict" }, primary.name),
      el("span", { class: "badge sev-" + primary.severity }, primary.severity),
      primary.ranks && primary.ranks.length ? el("span", { class: "badge" }, "rank" + (primary.ranks.length > 1 ? "s " : " ") + primary.ranks.join(", ")) : null));
    card.appendChild(el("p", { id: "verdict-message", class: "verdict-message" }, primary.message));
    if (primary.next_step) card.appendChild(el("p", { id: "next-step" }, el("b", {}, "Next step: "), primary.next_step));
    const evidence = primary.evidence || {};
    const items = Object.entries(evidence).filter(([, v]) => v === null || typeof v !== "object").slice(0, 14);
    if (items.length) {
      card.appendChild(el("details", { id: "evidence" }, el("summary", {}, "Evidence"),
        el("dl", { class: "evidence" }, items.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, fmt.num(v))])),
        el("pre", { class: "json" }, JSON.stringify(evidence, null, 1))));
    }
    const others = [];
    for (const group of ["step_time", "memory", "system"]) {
      for (const v of diagnosis[group] || []) {
        if (v.name === primary.name && JSON.stringify(v.ranks) === JSON.stringify(primary.ranks)) continue;
        if (group === "step_time" && v.severity === "info") continue;
        others.push(el("li", {}, el("b", {}, v.name), " (" + v.severity + "): " + v.message));
      }
    }
    if (others.length) card.appendChild(el("ul", { class: "others" }, others));
    if (diagnosis.source) card.appendChild(el("p", { class: "source" }, "from " + diagnosis.source));
    return card;
  }

  function headerCard(page) {
    const s = page.session;
    const outcome = s.outcome || s.status || "unknown";
    const duration = s.ended_at_ns && s.started_at_ns ? (s.ended_at_ns - s.started_at_ns) / 1e9 : null;
    const facts = [["status", s.status], ["outcome", s.outcome], ["started", fmt.time(s.started_at_ns)],
      ["duration", fmt.dur(duration)], ["ranks", !s.ranks.length ? "-" : s.ranks.length > 8 ? s.ranks.length + " (" + s.ranks[0] + "–" + s.ranks[s.ranks.length - 1] + ")" : s.ranks.join(", ")], ["steps", s.steps],
      ["world size", s.world_size], ["host", s.host], ["exit code", s.exit_code]];
    if (page.summary && page.summary.step_ms) {
      facts.push(["median step", fmt.ms(page.summary.step_ms.median)], ["p99 step", fmt.ms(page.summary.step_ms.p99)],
        ["steps/s", fmt.num(page.summary.throughput_steps_per_s)]);
    }
    const card = el("section", { id: "run-header", class: "card" },
      el("h1", {}, "Run ", el("code", { id: "session-id" }, s.session_id), " ",
        el("span", { id: "outcome", class: "badge outcome-" + outcome }, outcome)),
      s.command ? el("p", { class: "command" }, el("code", {}, s.command.join(" "))) : null,
      el("dl", { class: "facts" }, facts.filter(([, v]) => v !== null && v !== undefined).flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])));
    if (s.error) card.appendChild(el("p", { id: "run-error", class: "error-line" }, "failed: " + (s.error.type || s.error.kind || "") + " " + (s.error.message || "")));
    return card;
  }

  // -- charts -----------------------------------------------------------------------------------
  // Line charts are uPlot's (canvas, made for long time series); the heatmap and the spans
  // timeline are drawn here on a plain <canvas> (uPlot has neither). Every chart registers itself
  // in CHARTS, whose describe() says what it drew: window.stepwatchCharts() hands that to the
  // browser tests and the bench (name, type, points, rows of each series).

  const CHARTS = {};
  window.stepwatchCharts = () => {
    const out = {};
    for (const [id, chart] of Object.entries(CHARTS)) if (document.getElementById(id)) out[id] = chart.describe();
    return out;
  };

  function chartBox(id, hint) {
    return el("div", { class: "chart-box" }, el("div", { id: id, class: "chart" }),
      el("p", { id: id + "-readout", class: "readout" }, hint || "\u00a0"));
  }

  function timed(id, draw) {
    const started = performance.now();
    const chart = draw();
    // each chart's drawing time, read by bench/bench_dashboard.py (performance.getEntriesByType)
    performance.measure("sw:plot:" + id, { start: started });
    return chart;
  }

  function boxWidth(box) { return Math.max(320, Math.floor(box.clientWidth || box.parentNode.clientWidth || 900)); }

  // The union of the series' x (each ascending) and each series' y on it, undefined where a
  // series has no point (uPlot draws a line across undefined): uPlot wants one x for all series,
  // and the server's min/max buckets put each rank's points at its own steps.
  function align(series) {
    let total = 0;
    for (const s of series) total += s.x.length;
    const all = new Float64Array(total);
    let at = 0;
    for (const s of series) { all.set(s.x, at); at += s.x.length; }
    all.sort();
    const xs = [];
    for (let i = 0; i < all.length; i++) if (i === 0 || all[i] !== all[i - 1]) xs.push(all[i]);
    const data = [xs];
    for (const s of series) {
      const ys = [];
      let i = 0;
      for (let j = 0; j < xs.length; j++) {
        let value;
        while (i < s.x.length && s.x[i] <= xs[j]) { if (s.x[i] === xs[j]) value = s.y[i]; i++; }
        ys.push(value === null ? undefined : value);
      }
      data.push(ys);
    }
    return data;
  }

  function defined(values) {
    let n = 0;
    for (const v of values) if (v !== undefined && v !== null) n++;
    return n;
  }

  // The index nearest ``idx`` where series ``si`` has a point (the hover's value of a series that
  // has none at the x under the pointer).
  function nearestPoint(u, si, idx) {
    const ys = u.data[si];
    if (idx === null || idx === undefined || !ys) return null;
    if (ys[idx] !== undefined && ys[idx] !== null) return idx;
    const xs = u.data[0];
    for (let d = 1; d < ys.length; d++) {
      const lo = idx - d, hi = idx + d;
      const left = lo >= 0 && ys[lo] !== undefined && ys[lo] !== null;
      const right = hi < ys.length && ys[hi] !== undefined && ys[hi] !== null;
      if (left && right) return xs[idx] - xs[lo] <= xs[hi] - xs[idx] ? lo : hi;
      if (left) return lo;
      if (right) return hi;
      if (lo < 0 && hi >= ys.length) break;
    }
    return null;
  }

  const fmtAxis = (v) => Math.abs(v) >= 1e4 ? (v / 1e3).toFixed(0) + "k" : String(+v.toPrecision(6));

  // A line chart of ``series`` ([{key, label, x, y, color, dash}]) that can grow (extend) and be
  // asked what it drew (describe). ``o``: xLabel, yLabel, fmtX and fmtY (the hover's words),
  // yRange, markers ([{t, kind, label}], drawn as vertical lines), stacked (y are cumulative:
  // each series filled down to the one below it; ``raw`` gives the hover its own values).
  function lineChart(id, series, o) {
    const box = $(id);
    const readout = $(id + "-readout");
    const chart = { id: id, series: series, u: null, built: 0 };
    const fmtX = o.fmtX || ((x) => o.xLabel + " " + fmt.num(x));  // exact (the axis rounds: 12k)
    const fmtY = o.fmtY || ((y) => fmt.num(y));
    const hint = readout ? readout.textContent : "";

    function markerDraw(u) {
      const ctx = u.ctx, box = u.bbox, ratio = window.devicePixelRatio || 1;
      ctx.save();
      ctx.lineWidth = ratio;
      for (const m of o.markers) {
        const x = Math.round(u.valToPos(m.t, "x", true));
        if (x < box.left || x > box.left + box.width) continue;
        ctx.strokeStyle = ctx.fillStyle = MARKER_COLORS[m.kind] || "#999";
        ctx.setLineDash(m.kind === "phase" ? [2 * ratio, 3 * ratio] : [6 * ratio, 4 * ratio]);
        ctx.beginPath(); ctx.moveTo(x, box.top); ctx.lineTo(x, box.top + box.height); ctx.stroke();
        ctx.setLineDash([]);
        const y = box.top + box.height, s = 5 * ratio;
        ctx.beginPath(); ctx.moveTo(x, y - 2 * s); ctx.lineTo(x - s, y); ctx.lineTo(x + s, y); ctx.closePath(); ctx.fill();
      }
      ctx.restore();
    }

    function read(u) {
      if (!readout) return;
      const left = u.cursor.left, top = u.cursor.top;
      if (left === undefined || left === null || left < 0) { readout.textContent = hint; return; }
      const near = (o.markers || []).filter((m) => Math.abs(u.valToPos(m.t, "x") - left) <= 4);
      if (near.length) { readout.textContent = near.map((m) => m.kind + " at " + fmtX(m.t) + ": " + m.label).join(" · "); return; }
      if (o.stacked) {
        const idx = u.cursor.idx;
        if (idx === null || idx === undefined) { readout.textContent = hint; return; }
        const parts = chart.series.map((s, i) => s.label + " " + fmtY(o.raw[i][idx])).filter((t, i) => o.raw[i][idx]);
        readout.textContent = fmtX(u.data[0][idx]) + ": " + parts.join(", ");
        return;
      }
      let best = null;
      for (let i = 1; i < u.series.length; i++) {
        if (!u.series[i].show) continue;
        const idx = u.cursor.idxs[i];
        const v = idx === null || idx === undefined ? undefined : u.data[i][idx];
        if (v === undefined || v === null) continue;
        const d = Math.abs(u.valToPos(v, "y") - top);
        if (!best || d < best.d) best = { i: i, idx: idx, v: v, d: d };
      }
      readout.textContent = best ? fmtX(u.data[0][best.idx]) + " · " + chart.series[best.i - 1].label + ": " + fmtY(best.v) : hint;
    }

    chart.build = () => {
      if (chart.u) chart.u.destroy();
      const many = chart.series.length > 16;
      const opts = {
        width: boxWidth(box), height: o.height || 300,
        // past 16 series a legend is a wall of names: the line under the chart names the nearest one
        legend: { show: !many && !o.noLegend },
        // a few series: the one nearest the pointer is brought forward (each move redraws them
        // all, which at 64 series of thousands of x would make pointing sluggish)
        cursor: Object.assign({ points: { show: !many && !o.stacked }, focus: { prox: many || o.stacked ? -1 : 24 } },
          o.stacked ? {} : { dataIdx: nearestPoint }),
        focus: { alpha: 0.5 },
        scales: { x: { time: false }, y: o.yRange ? { range: o.yRange } : {} },
        axes: [{ label: o.xLabel, values: (u, ticks) => ticks.map(fmtAxis) },
          { label: o.yLabel, size: 60, values: (u, ticks) => ticks.map(fmtAxis) }],
        series: [{ label: o.xLabel, value: (u, v) => v === null || v === undefined ? "-" : fmtAxis(v) }].concat(chart.series.map((s) => ({
          label: s.label, stroke: s.color, width: s.width || 1, dash: s.dash, spanGaps: true, points: { show: false },
          fill: o.stacked ? s.color : undefined,
          value: (u, v, si, idx) => idx === null || idx === undefined ? "-" : fmtY(o.stacked ? o.raw[si - 1][idx] : v),
        }))),
        hooks: { setCursor: [read], draw: o.markers && o.markers.length ? [markerDraw] : [] },
      };
      if (o.markers && o.markers.length) {
        // the whole chart (not a zoom into it) spans the markers too
        const ts = o.markers.map((m) => m.t), first = Math.min(...ts), last = Math.max(...ts);
        opts.scales.x.range = (u, min, max) => min === chart.bounds[0] && max === chart.bounds[1] ?
          [Math.min(min === null ? first : min, first), Math.max(max === null ? last : max, last)] : [min, max];
      }
      const data = aligned();
      chart.u = new window.uPlot(opts, data, box);
      chart.built = chart.series.length;
    };

    function aligned() {
      let data = align(chart.series);
      if (o.stacked) data = stack(data);
      chart.bounds = data[0].length ? [data[0][0], data[0][data[0].length - 1]] : [null, null];
      return data;
    }

    // stacked: series i drawn at the sum of itself and the series after it, the first (the
    // whole) first, so each one's fill covers the lower part of the one drawn before it
    function stack(data) {
      o.raw = data.slice(1);
      const cumulative = new Array(o.raw.length);
      let sum = data[0].map(() => 0);
      for (let i = o.raw.length - 1; i >= 0; i--) {
        const ys = o.raw[i];
        sum = sum.map((v, j) => v + (ys[j] || 0));
        cumulative[i] = sum;
      }
      return [data[0]].concat(cumulative);
    }

    chart.extend = (key, xs, ys, make) => {
      const found = chart.series.find((s) => s.key === key);
      if (found) { found.x = found.x.concat(xs); found.y = found.y.concat(ys); }
      else chart.series.push(make());
    };
    chart.redraw = () => {
      if (chart.series.length !== chart.built || !chart.u) chart.build();
      else chart.u.setData(aligned());
    };
    chart.points = () => chart.series.reduce((n, s) => n + s.x.length, 0);
    chart.resize = () => { if (chart.u) chart.u.setSize({ width: boxWidth(box), height: o.height || 300 }); };
    chart.describe = () => chart.series.map((s, i) => ({ name: s.label, type: o.stacked ? "area" : "line",
      points: chart.u ? defined(o.stacked ? o.raw[i] : chart.u.data[i + 1]) : 0, rows: null }))
      .concat(o.markers && o.markers.length ? [{ name: "markers", type: "markers", points: o.markers.length, rows: null,
        kinds: Array.from(new Set(o.markers.map((m) => m.kind))) }] : []);
    chart.build();
    CHARTS[id] = chart;
    return chart;
  }

  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => { for (const chart of Object.values(CHARTS)) chart.resize(); }, 150);
  });

  // -- canvas charts: the heatmap and the spans timeline ---------------------------------------

  // A canvas of ``width`` x ``height`` CSS pixels, sharp on any screen: (canvas, its context in CSS pixels)
  function canvasIn(box, width, height) {
    box.textContent = "";
    const ratio = window.devicePixelRatio || 1;
    const canvas = el("canvas", { width: Math.round(width * ratio), height: Math.round(height * ratio) });
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    box.appendChild(canvas);
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.font = "11px system-ui, sans-serif";
    return [canvas, ctx];
  }

  // about ``count`` round values covering lo..hi
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / Math.max(1, count);
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function xAxis(ctx, left, top, width, lo, hi, label) {
    ctx.fillStyle = "#444"; ctx.strokeStyle = "#999"; ctx.textAlign = "center"; ctx.textBaseline = "top";
    for (const v of niceTicks(lo, hi, Math.max(2, Math.floor(width / 90)))) {
      const x = left + (v - lo) / (hi - lo || 1) * width;
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + 4); ctx.stroke();
      ctx.fillText(fmtAxis(v), x, top + 6);
    }
    ctx.fillText(label, left + width / 2, top + 20);
  }

  function rowLabels(ctx, left, top, rowH, labels) {
    ctx.fillStyle = "#444"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
    const every = Math.max(1, Math.ceil(12 / rowH));
    labels.forEach((label, i) => { if (i % every === 0) ctx.fillText(label, left - 6, top + (i + 0.5) * rowH); });
  }

  // a row's height: roomy for a few rows (the chart at least 120 px tall), 4-10 px for many
  function rowHeight(rows, roomy) {
    return rows <= 16 ? Math.max(roomy, Math.floor(120 / Math.max(1, rows))) : Math.max(4, Math.min(10, Math.floor(640 / rows)));
  }

  // ColorBrewer's YlOrRd: pale yellow for the fastest cells, dark red for the slowest
  const HEAT = [[255, 255, 204], [255, 237, 160], [254, 217, 118], [254, 178, 76], [253, 141, 60], [252, 78, 42],
    [227, 26, 28], [189, 0, 38], [128, 0, 38]];

  function heatColor(f) {
    const at = Math.min(1, Math.max(0, f)) * (HEAT.length - 1);
    const i = Math.min(HEAT.length - 2, Math.floor(at)), w = at - i;
    return HEAT[i].map((c, k) => Math.round(c + (HEAT[i + 1][k] - c) * w));
  }

  function quantile(sorted, q) { return sorted.length ? sorted[Math.min(sorted.length - 1, Math.floor(q * (sorted.length - 1)))] : 0; }

  // The rank x step heatmap: one row per rank, one column per bucket of steps, each cell the
  // slowest step of its bucket, coloured by how much slower it is than the median cell: pale at
  // the median or faster, darkest at 1.5 times the median or the 99th percentile, whichever is
  // higher. A straggler's row is then dark on a pale map, a lone spike does not wash the rest
  // out, and a few percent of noise stays pale (scaled from the fastest cell, it would not).
  function heatmapChart(id, h) {
    const box = $(id), readout = $(id + "-readout"), hint = readout.textContent;
    const rows = h.ranks.length, cols = h.x.length;
    const chart = { id: id };
    const values = [];
    for (const row of h.z) for (const v of row) if (v !== null && v !== undefined) values.push(v);
    values.sort((a, b) => a - b);
    const lo = quantile(values, 0.5);
    let hi = Math.max(lo * 1.5, quantile(values, 0.99));
    if (!(hi > lo)) hi = lo + 1;
    const m = { l: 70, r: 96, t: 8, b: 40 };
    let geometry = null;
    chart.draw = () => {
      const rowH = rowHeight(rows, 18);
      const width = boxWidth(box), height = m.t + m.b + rowH * Math.max(1, rows);
      const [canvas, ctx] = canvasIn(box, width, height);
      const plotW = width - m.l - m.r, plotH = rowH * rows;
      geometry = { left: m.l, top: m.t, width: plotW, height: plotH, rowH: rowH, ratio: window.devicePixelRatio || 1 };
      if (rows && cols) {
        const cells = document.createElement("canvas");
        cells.width = cols; cells.height = rows;
        const cctx = cells.getContext("2d");
        const image = cctx.createImageData(cols, rows);
        for (let r = 0; r < rows; r++) {
          for (let c = 0; c < cols; c++) {
            const v = h.z[r][c], at = (r * cols + c) * 4;
            const rgb = v === null || v === undefined ? [238, 238, 238] : heatColor((v - lo) / (hi - lo));
            image.data[at] = rgb[0]; image.data[at + 1] = rgb[1]; image.data[at + 2] = rgb[2]; image.data[at + 3] = 255;
          }
        }
        cctx.putImageData(image, 0, 0);
        ctx.imageSmoothingEnabled = false;
        ctx.drawImage(cells, m.l, m.t, plotW, plotH);
      }
      rowLabels(ctx, m.l, m.t, rowH, h.ranks.map((r) => "rank " + r));
      const first = cols ? h.x[0] : 0;
      xAxis(ctx, m.l, m.t + plotH, plotW, first, first + cols * (h.width || 1), "step");
      // the colour bar
      const barX = m.l + plotW + 16, barH = Math.max(40, plotH);
      const gradient = ctx.createLinearGradient(0, m.t + barH, 0, m.t);
      HEAT.forEach((c, i) => gradient.addColorStop(i / (HEAT.length - 1), "rgb(" + c.join(",") + ")"));
      ctx.fillStyle = gradient;
      ctx.fillRect(barX, m.t, 12, barH);
      ctx.fillStyle = "#444"; ctx.textAlign = "left"; ctx.textBaseline = "middle";
      ctx.fillText("≥ " + fmt.num(hi) + " ms", barX + 16, m.t + 6);
      ctx.fillText("≤ " + fmt.num(lo) + " ms", barX + 16, m.t + barH - 6);
      canvas.addEventListener("mousemove", (e) => {
        const rect = canvas.getBoundingClientRect();
        const c = Math.floor((e.clientX - rect.left - m.l) / plotW * cols), r = Math.floor((e.clientY - rect.top - m.t) / rowH);
        if (c < 0 || c >= cols || r < 0 || r >= rows) { readout.textContent = hint; return; }
        const v = h.z[r][c], start = h.x[c], w = h.width || 1;
        readout.textContent = "rank " + h.ranks[r] + " · " + (w > 1 ? "steps " + start + "–" + (start + w - 1) : "step " + start) +
          ": " + (v === null || v === undefined ? "no step" : fmt.ms(v) + (w > 1 ? " (the bucket's slowest)" : ""));
      });
      canvas.addEventListener("mouseleave", () => { readout.textContent = hint; });
    };
    chart.resize = chart.draw;
    chart.describe = () => [{ name: "step time", type: "heatmap", points: cols, rows: rows, plot: geometry, range: [lo, hi] }];
    chart.draw();
    CHARTS[id] = chart;
    return chart;
  }

  // One step's spans as a timeline across ranks: a row per rank, a bar per span (ms from the
  // step's first start); spans inside others (a phase inside the step) are drawn thinner on top.
  function timelineChart(id, data, legendBox) {
    const box = $(id), readout = $(id + "-readout"), hint = readout.textContent;
    const chart = { id: id };
    const ranks = Array.from(new Set(data.spans.map((s) => s.rank))).sort((a, b) => a - b);
    const names = [];
    for (const s of data.spans) if (!names.includes(s.name)) names.push(s.name);
    const color = (name) => COLORS[names.indexOf(name) % COLORS.length];
    const end = Math.max(1e-9, ...data.spans.map((s) => s.start_ms + s.ms));
    const m = { l: 70, r: 20, t: 8, b: 40 };
    // each span's nesting depth in its rank (spans come in start order)
    const placed = [];
    for (const rank of ranks) {
      const open = [];
      for (const s of data.spans.filter((x) => x.rank === rank).sort((a, b) => a.start_ms - b.start_ms || b.ms - a.ms)) {
        while (open.length && open[open.length - 1] < s.start_ms + s.ms - 1e-9) open.pop();
        placed.push({ span: s, depth: open.length, row: ranks.indexOf(rank) });
        open.push(s.start_ms + s.ms);
      }
    }
    let hits = [];
    chart.draw = () => {
      const rowH = rowHeight(ranks.length, 28);
      const width = boxWidth(box), height = m.t + m.b + rowH * Math.max(1, ranks.length);
      const [canvas, ctx] = canvasIn(box, width, height);
      const plotW = width - m.l - m.r;
      const xOf = (ms) => m.l + ms / end * plotW;
      hits = [];
      for (const p of placed) {
        const bar = rowH * 0.85 * Math.pow(0.7, p.depth);
        const x0 = xOf(p.span.start_ms), x1 = Math.max(x0 + 1, xOf(p.span.start_ms + p.span.ms));
        const y0 = m.t + p.row * rowH + (rowH - bar) / 2;
        ctx.globalAlpha = p.span.name === "step" ? 0.25 : 0.9;
        ctx.fillStyle = color(p.span.name);
        ctx.fillRect(x0, y0, x1 - x0, bar);
        hits.push({ x0: x0, x1: x1, y0: y0, y1: y0 + bar, span: p.span });
      }
      ctx.globalAlpha = 1;
      rowLabels(ctx, m.l, m.t, rowH, ranks.map((r) => "rank " + r));
      xAxis(ctx, m.l, m.t + rowH * ranks.length, plotW, 0, end, "ms from the step's first start");
      canvas.addEventListener("mousemove", (e) => {
        const rect = canvas.getBoundingClientRect(), x = e.clientX - rect.left, y = e.clientY - rect.top;
        let hit = null;
        for (let i = hits.length - 1; i >= 0 && !hit; i--) {
          const b = hits[i];
          if (x >= b.x0 && x <= b.x1 && y >= b.y0 && y <= b.y1) hit = b.span;
        }
        readout.textContent = hit ? "rank " + hit.rank + " · " + hit.name + ": " + fmt.ms(hit.ms) + " from " + fmt.ms(hit.start_ms) : hint;
      });
      canvas.addEventListener("mouseleave", () => { readout.textContent = hint; });
    };
    legendBox.textContent = "";
    for (const name of names) legendBox.appendChild(el("span", { class: "key" }, el("i", { style: "background:" + color(name) }), name));
    chart.resize = chart.draw;
    chart.describe = () => names.map((name) => ({ name: name, type: "bar", points: data.spans.filter((s) => s.name === name).length, rows: ranks.length }));
    chart.draw();
    CHARTS[id] = chart;
    return chart;
  }

  // -- the run page's charts ----------------------------------------------------------------------

  function rankSeries(s, i, prefix, dash) {
    return { key: String(s.rank), label: (prefix || "") + "rank " + s.rank, x: s.x, y: s.y, color: COLORS[i % COLORS.length], dash: dash };
  }

  function drawStepTime(page) {
    const width = page.step_time.width;
    $("step-note").textContent = (width > 1 ? "each bucket of " + width + " steps shows its fastest and slowest step" : "every step") +
      "; drag to zoom, double-click to zoom out";
    timed("chart-step", () => lineChart("chart-step", page.step_time.series.map((s, i) => rankSeries(s, i)),
      { xLabel: "step", yLabel: "step time (ms)", fmtY: fmt.ms }));
  }

  const PHASE_COLORS = { data_load: "#1f77b4", h2d: "#17becf", forward: "#2ca02c", backward: "#ff7f0e", optimizer: "#9467bd",
    recompute: "#8c564b", wait: "#d62728" };

  function drawPhases(page) {
    const x = page.phases.x;
    const series = Object.entries(page.phases.shares).filter(([, ys]) => ys.some((v) => v)).map(([name, ys], i) => ({
      key: name, label: name, x: x, y: ys.map((v) => v === null ? 0 : v * 100), color: PHASE_COLORS[name] || COLORS[i % COLORS.length] }));
    timed("chart-phases", () => lineChart("chart-phases", series.reverse(), { xLabel: "step", yLabel: "share of step time (%)",
      yRange: [0, 100], stacked: true, fmtY: (v) => v === null || v === undefined ? "-" : v.toFixed(1) + "%",
      fmtX: (s) => "steps " + s + "+" }));
  }

  const MARKER_COLORS = { oom: "#d62728", failure: "#d62728", alert: "#ff7f0e", verdict: "#9467bd", phase: "#999999" };

  function memorySeries(s, i) {
    return { key: s.rank + "/" + s.device + "/" + s.collector, label: "rank " + s.rank + (s.device >= 0 ? " gpu" + s.device : ""),
      x: s.t, y: s.y, color: COLORS[i % COLORS.length] };
  }

  function drawMemory(page) {
    timed("chart-memory", () => lineChart("chart-memory", page.memory.series.map(memorySeries), { xLabel: "seconds since start",
      yLabel: "memory (MiB)", fmtX: (t) => fmt.num(t) + " s", fmtY: (v) => fmt.num(v) + " MiB", markers: page.memory.markers || [] }));
  }

  function drawHeatmap(page) { timed("chart-heatmap", () => heatmapChart("chart-heatmap", page.heatmap)); }

  function drawMarks(page) {
    if (!page.marks.length) { $("chart-marks").hidden = true; return; }
    timed("chart-marks", () => lineChart("chart-marks", page.marks.map((m, i) => ({ key: m.name + "/" + m.rank,
      label: m.name + (m.inferred ? " (inferred)" : "") + " rank " + m.rank, x: m.t, y: m.y, color: COLORS[i % COLORS.length] })),
    { xLabel: "seconds since start", yLabel: "value", fmtX: (t) => fmt.num(t) + " s" }));
  }

  function drawSpans(data) {
    timed("chart-spans", () => timelineChart("chart-spans", data, $("spans-legend")));
    const input = $("spans-step");
    if (input) input.value = data.step;
    $("spans-title").textContent = "One step's spans across ranks: step " + data.step;
    document.body.dataset.spans = String(data.step);
  }

  function alertRows(alerts) {
    return alerts.map((a) => el("tr", { class: "sev-" + a.severity }, el("td", {}, a.iso || "-"), el("td", {}, a.kind),
      el("td", {}, a.severity), el("td", {}, (a.ranks || []).join(", ")), el("td", {}, a.step === null || a.step === undefined ? "-" : String(a.step)),
      el("td", {}, a.message)));
  }

  function alertsCard(page) {
    const body = el("tbody", { id: "alerts-body" }, alertRows(page.alerts));
    const stacks = (page.stacks || []).map((f) => el("li", {}, SW.mode === "report" ? f.name :
      el("a", { href: "/api/run/" + encodeURIComponent(page.session.session_id) + "/stacks/" + encodeURIComponent(f.name) }, f.name),
      " (" + f.bytes + " bytes)"));
    return section("alerts", "Alerts (" + page.alerts.length + ")",
      el("p", { id: "no-alerts", hidden: page.alerts.length > 0 }, "no alert"),
      el("table", { class: "alerts" }, el("thead", {}, el("tr", {}, ["time", "kind", "severity", "ranks", "step", "message"].map((t) => el("th", {}, t)))), body),
      stacks.length ? el("div", {}, el("h3", {}, "Stack dumps"), el("ul", { id: "stack-files" }, stacks)) : null);
  }

  function verdictRows(verdicts) {
    return verdicts.map((v) => el("tr", {}, el("td", {}, fmt.time(v.ts_ns)), el("td", {}, v.step === null ? "-" : String(v.step)),
      el("td", {}, v.name), el("td", {}, v.severity), el("td", {}, v.message)));
  }

  function epochsCard(epochs) {
    if (!epochs) return section("epochs", "Epochs", el("p", {}, "no epochs recorded"));
    const rows = (epochs.epochs || []).map((e) => el("tr", {}, el("td", {}, String(e.rank)), el("td", {}, fmt.num(e.index)),
      el("td", {}, fmt.ms(e.duration_ms)), el("td", {}, String(e.steps)), el("td", {}, String(e.eval_steps)), el("td", {}, fmt.ms(e.eval_ms))));
    return section("epochs", "Epochs (" + epochs.count + ")",
      el("p", {}, "median " + fmt.ms(epochs.duration_ms.median) + ", evaluation " + fmt.ms(epochs.eval_ms.total) +
        (epochs.eval_ms.share !== null ? " (" + (epochs.eval_ms.share * 100).toFixed(1) + "% of the epochs' time)" : "")),
      el("table", {}, el("thead", {}, el("tr", {}, ["rank", "epoch", "duration", "steps", "eval steps", "eval time"].map((t) => el("th", {}, t)))), el("tbody", {}, rows)));
  }

  // After the next paint (or 100 ms, a hidden tab paints nothing), in a task of its own.
  function afterPaint() {
    return new Promise((done) => {
      let fired = false;
      const go = () => { if (!fired) { fired = true; setTimeout(done, 0); } };
      requestAnimationFrame(go);
      setTimeout(go, 100);
    });
  }

  // Draws the run page. The first view (header, diagnosis, step-time chart) is drawn and marked
  // (body[data-first], performance mark sw:first-view) before the charts below the fold, each of
  // which is drawn in a task of its own after a paint: the top shows while they draw (the
  // 64-rank charts take 0.1-0.3 s each). Resolves once every chart is drawn.
  async function renderRun(page, stepSpans) {
    for (const [id, chart] of Object.entries(CHARTS)) { if (chart.u) chart.u.destroy(); delete CHARTS[id]; }
    const content = $("content");
    content.textContent = "";
    crumbs(el("span", {}, " / "), el("a", { href: SW.mode === "report" ? "#" : "/" }, "runs"), el("span", {}, " / " + page.session.session_id.slice(0, 8)));
    if ((page.problems || []).length) message(page.problems.join("\n"), "warn");  // every one, a line each
    content.appendChild(headerCard(page));
    content.appendChild(diagnosisCard(page.diagnosis));
    content.appendChild(section("step-time", "Step time per rank", el("p", { id: "step-note", class: "note" }), chartBox("chart-step", "point at a line: its rank, step and time")));
    content.appendChild(section("heatmap", "Rank × step: step time (the slowest of each bucket)",
      el("p", { class: "note" }, "a straggler is a dark row: pale is the median cell or faster, darkest 1.5 times the median " +
        "(or the 99th percentile, if higher) or slower"),
      chartBox("chart-heatmap", "point at a cell: its rank, steps and time")));
    content.appendChild(section("phases", "Phase shares over steps", chartBox("chart-phases", "point at the chart: each phase's share there")));
    content.appendChild(section("memory", "Memory per rank", el("p", { class: "note" }, "dashed lines: alerts, OOMs, failures and verdict changes; dotted: epochs (point at one to read it)"),
      chartBox("chart-memory", "point at a line or a marker to read it")));
    content.appendChild(section("marks", "Loss and other marks", page.marks.length ? null : el("p", {}, "no numeric marks"), chartBox("chart-marks")));
    const stepInput = el("input", { id: "spans-step", type: "number", min: 0 });
    const spansTools = SW.mode === "report" ? el("p", { class: "note" }, "the slowest step drawn") :
      el("div", { class: "toolbar" }, el("label", {}, "step ", stepInput),
        el("button", { id: "spans-go", onclick: () => loadSpans(page.session.session_id, parseInt(stepInput.value, 10)) }, "show"));
    const spansCard = section("spans", "One step's spans across ranks", spansTools, el("div", { id: "spans-legend", class: "keys" }),
      chartBox("chart-spans", "point at a bar: its span, rank and time"));
    spansCard.querySelector("h2").id = "spans-title";
    content.appendChild(spansCard);
    content.appendChild(alertsCard(page));
    content.appendChild(section("verdicts", "Verdict changes (live)", page.verdicts.length ? null : el("p", { class: "note" }, "none stored (the live verdict thread stores a change of the primary verdict while a run trains)"), el("table", {}, el("thead", {}, el("tr", {}, ["time", "step", "verdict", "severity", "message"].map((t) => el("th", {}, t)))), el("tbody", { id: "verdicts-body" }, verdictRows(page.verdicts)))));
    content.appendChild(epochsCard(page.epochs));
    if (page.summary_text) content.appendChild(section("summary", "Final summary (stepwatch summary)", el("pre", { class: "json" }, page.summary_text)));
    if (page.environment) content.appendChild(section("environment", "Environment (run.json)", el("pre", { class: "json" }, JSON.stringify(page.environment, null, 2))));
    if (!window.uPlot) { message(LIBRARY_MISSING, "error"); return; }
    drawStepTime(page);
    if (!document.body.dataset.first) { performance.mark("sw:first-view"); document.body.dataset.first = "1"; }
    for (const draw of [drawHeatmap, drawPhases, drawMemory, drawMarks]) {
      await afterPaint();
      draw(page);
    }
    if (stepSpans) drawSpans(stepSpans);
  }

  async function loadSpans(sid, step) {
    if (!Number.isFinite(step)) return;
    try { drawSpans(await getJSON("/api/run/" + encodeURIComponent(sid) + "/step/" + step)); }
    catch (e) { message("spans of step " + step + ": " + e.message); }
  }

  async function runPage() {
    const sid = SW.session;
    const url = "/api/run/" + encodeURIComponent(sid);
    let page = null;
    // a run just started (the URL printed by run --ui-port) may have sent nothing yet: wait for it
    for (let attempt = 0; page === null; attempt++) {
      const answer = await getJSON(url, attempt === 0 ? SW.preload : null);
      if (!answer.pending) { page = answer; break; }
      message(answer.message + ": waiting for its first steps", "warn");
      await new Promise((done) => setTimeout(done, SW.poll_ms || 1000));
    }
    $("message").hidden = true;
    performance.mark("sw:data");
    await renderRun(page, null);
    const running = page.session.status === "running";
    $("live").hidden = !running;
    performance.mark("sw:ready");
    document.body.dataset.ready = "1";
    if (page.slowest_step !== null && page.slowest_step !== undefined) await loadSpans(sid, page.slowest_step);
    if (!running) return;
    // live: ask for what is new; extend the traces in place
    let cursor = page.cursor;
    let busy = false;
    const timer = setInterval(async () => {
      if (busy) return;
      busy = true;
      try {
        const update = await getJSON(url + "/updates?cursor=" + encodeURIComponent(JSON.stringify(cursor)));
        const grown = CHARTS["chart-step"] && CHARTS["chart-step"].points() > LIVE_POINTS;
        if (update.reload || grown || update.status !== "running") {
          page = await getJSON(url);
          await renderRun(page, null);
          cursor = page.cursor;
          if (update.status !== "running") { clearInterval(timer); $("live").hidden = true; }
        } else {
          applyUpdate(page, update);
          cursor = update.cursor;
        }
        document.body.dataset.polls = String((parseInt(document.body.dataset.polls || "0", 10)) + 1);
      } catch (e) {
        message("live update failed: " + e.message, "warn");
      } finally { busy = false; }
    }, SW.poll_ms || 1000);
  }

  // Live: the new points go on the end of each rank's series (a rank seen for the first time gets
  // a series of its own) and the chart is drawn again from them.
  function applyUpdate(page, update) {
    const steps = CHARTS["chart-step"];
    if (steps && steps.u && update.steps.length) {
      for (const s of update.steps) steps.extend(String(s.rank), s.x, s.y, () => rankSeries(s, steps.series.length));
      steps.redraw();
    }
    const memory = CHARTS["chart-memory"];
    if (memory && memory.u && update.memory.length) {
      for (const s of update.memory) memory.extend(s.rank + "/" + s.device + "/" + s.collector, s.t, s.y, () => memorySeries(s, memory.series.length));
      memory.redraw();
    }
    if (update.alerts.length) {
      page.alerts = page.alerts.concat(update.alerts);
      for (const row of alertRows(update.alerts)) $("alerts-body").appendChild(row);
      $("no-alerts").hidden = true;
      $("alerts").querySelector("h2").textContent = "Alerts (" + page.alerts.length + ")";
      message("new alert: " + update.alerts[update.alerts.length - 1].message, "warn");
    }
    for (const row of verdictRows(update.verdicts)) $("verdicts-body").appendChild(row);
    if (update.verdicts.length) {
      const v = update.verdicts[update.verdicts.length - 1];
      const name = $("verdict-name");
      if (name) name.textContent = v.name;
      const text = $("verdict-message");
      if (text) text.textContent = v.message;
    }
  }

  // -- compare page -----------------------------------------------------------------------------

  async function comparePage() {
    const data = await getJSON("/api/compare?a=" + encodeURIComponent(SW.a) + "&b=" + encodeURIComponent(SW.b));
    const content = $("content");
    content.textContent = "";
    crumbs(el("span", {}, " / "), el("a", { href: "/" }, "runs"), el("span", {}, " / compare"));
    const v = data.verdict;
    content.appendChild(el("section", { id: "compare-verdict", class: "card diagnosis" },
      el("h2", {}, el("span", { id: "verdict-name", class: "verdict" }, v.verdict), " B against A"),
      el("ul", {}, v.reasons.map((r) => el("li", {}, r))),
      el("p", {}, "A: ", el("a", { href: runLink(data.a.session.session_id) }, data.a.session.session_id), " (" + (data.a.primary || "-") + ")"),
      el("p", {}, "B: ", el("a", { href: runLink(data.b.session.session_id) }, data.b.session.session_id), " (" + (data.b.primary || "-") + ")")));
    content.appendChild(section("compare-step", "Step time, A (solid) and B (dashed)", chartBox("chart-compare", "point at a line: its run, rank, step and time")));
    const rows = data.metrics.map((m) => el("tr", {}, el("td", {}, m.metric), el("td", {}, fmt.num(m.a)), el("td", {}, fmt.num(m.b)),
      el("td", {}, m.relative === null ? "-" : (m.relative * 100).toFixed(1) + "%")));
    content.appendChild(section("compare-metrics", "Metrics", el("table", {}, el("thead", {}, el("tr", {}, ["metric", "A", "B", "change"].map((t) => el("th", {}, t)))), el("tbody", {}, rows))));
    if (!window.uPlot) { message(LIBRARY_MISSING); return; }
    const a = data.a.step_time.series.map((s, i) => rankSeries(s, i, "A "));
    const b = data.b.step_time.series.map((s, i) => Object.assign(rankSeries(s, i, "B ", [5, 4]), { key: "b" + s.rank }));
    timed("chart-compare", () => lineChart("chart-compare", a.concat(b), { xLabel: "step", yLabel: "step time (ms)", fmtY: fmt.ms }));
  }

  // -- report: the data inlined, compressed ------------------------------------------------------

  async function inflate(id) {
    const text = $(id).textContent.trim();
    const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return await new Response(stream).text();
  }

  async function reportPage() {
    const page = JSON.parse(await inflate("sw-data"));
    await renderRun(page.run, page.spans);
    performance.mark("sw:ready");
    document.body.dataset.ready = "1";
  }

  async function start() {
    try {
      if (SW.mode === "report") await reportPage();
      else if (SW.page === "runs") await runsPage();
      else if (SW.page === "run") await runPage();
      else if (SW.page === "compare") await comparePage();
      document.body.dataset.ready = "1";
    } catch (e) {
      const loading = $("loading");
      if (loading) loading.remove();
      message(e.message || String(e), "error");
      document.body.dataset.ready = "1";
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
