// stepwatch dashboard and report: draws what stepwatch.views computed (one script for both).
// window.STEPWATCH says which page and where its data is: fetched from /api/ (mode "server") or
// inlined in the page (mode "report"). Text from the data is always set as textContent, never
// parsed as HTML.
(function () {
  "use strict";
  const SW = window.STEPWATCH || {};
  const $ = (id) => document.getElementById(id);
  const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["sendDataToCloud"] };
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

  function chartDiv(id) { return el("div", { id: id, class: "chart" }); }

  function plot(id, traces, layout) {
    if (!window.Plotly) return;
    // past 16 series a legend is a wall of names (the hover names each line): left out, and drawn faster
    const base = { margin: { l: 60, r: 20, t: 10, b: 45 }, height: 320, hovermode: "closest",
      legend: { orientation: "h", y: -0.25 }, font: { size: 11 }, showlegend: traces.length <= 16 ? undefined : false };
    const started = performance.now();
    window.Plotly.newPlot(id, traces, Object.assign(base, layout || {}), PLOT_CONFIG);
    // each chart's drawing time, read by bench/bench_dashboard.py (performance.getEntriesByType)
    performance.measure("sw:plot:" + id, { start: started });
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

  function stepTraces(series, prefix, dash) {
    return series.map((s, i) => ({ type: "scatter", mode: "lines", name: (prefix || "") + "rank " + s.rank, x: s.x, y: s.y,
      line: { width: 1, color: COLORS[i % COLORS.length], dash: dash || "solid" }, meta: { rank: s.rank } }));
  }

  function drawStepTime(page) {
    const width = page.step_time.width;
    plot("chart-step", stepTraces(page.step_time.series), {
      xaxis: { title: { text: "step" } }, yaxis: { title: { text: "step time (ms)" } } });
    $("step-note").textContent = width > 1 ? "each bucket of " + width + " steps shows its fastest and slowest step" : "every step";
  }

  function drawPhases(page) {
    const traces = Object.entries(page.phases.shares).filter(([, ys]) => ys.some((v) => v)).map(([name, ys]) => ({
      type: "scatter", mode: "lines", stackgroup: "one", name: name, x: page.phases.x, y: ys.map((v) => v === null ? 0 : v * 100) }));
    plot("chart-phases", traces, { xaxis: { title: { text: "step" } }, yaxis: { title: { text: "share of step time (%)" }, range: [0, 100] } });
  }

  const MARKER_COLORS = { oom: "#d62728", failure: "#d62728", alert: "#ff7f0e", verdict: "#9467bd", phase: "#999999" };

  function drawMemory(page) {
    const traces = page.memory.series.map((s, i) => ({ type: "scatter", mode: "lines",
      name: "rank " + s.rank + (s.device >= 0 ? " gpu" + s.device : ""), x: s.t, y: s.y,
      line: { width: 1, color: COLORS[i % COLORS.length] }, meta: { key: s.rank + "/" + s.device + "/" + s.collector } }));
    const markers = page.memory.markers || [];
    const shapes = markers.map((m) => ({ type: "line", xref: "x", yref: "paper", x0: m.t, x1: m.t, y0: 0, y1: 1,
      line: { color: MARKER_COLORS[m.kind] || "#999", width: 1, dash: m.kind === "phase" ? "dot" : "dash" } }));
    if (markers.length) {
      traces.push({ type: "scatter", mode: "markers", name: "events", x: markers.map((m) => m.t),
        y: markers.map(() => 0), text: markers.map((m) => m.kind + ": " + m.label), hoverinfo: "text",
        marker: { symbol: "triangle-up", size: 9, color: markers.map((m) => MARKER_COLORS[m.kind] || "#999") } });
    }
    plot("chart-memory", traces, { xaxis: { title: { text: "seconds since start" } }, yaxis: { title: { text: "memory (MiB)" } }, shapes: shapes });
  }

  function drawHeatmap(page) {
    const h = page.heatmap;
    plot("chart-heatmap", [{ type: "heatmap", x: h.x, y: h.ranks.map((r) => "rank " + r), z: h.z, colorscale: "YlOrRd", reversescale: true,
      colorbar: { title: { text: "ms" } }, hovertemplate: "%{y}, steps %{x}+: %{z} ms<extra></extra>" }],
    { xaxis: { title: { text: "step" } }, height: Math.max(220, 60 + 18 * h.ranks.length), margin: { l: 70, r: 20, t: 10, b: 45 } });
  }

  function drawMarks(page) {
    if (!page.marks.length) { $("chart-marks").hidden = true; return; }
    const traces = page.marks.map((m, i) => ({ type: "scatter", mode: "lines", x: m.t, y: m.y,
      name: m.name + (m.inferred ? " (inferred)" : "") + " rank " + m.rank, line: { width: 1, color: COLORS[i % COLORS.length] } }));
    plot("chart-marks", traces, { xaxis: { title: { text: "seconds since start" } }, yaxis: { title: { text: "value" } } });
  }

  function drawSpans(data) {
    const byName = {};
    for (const s of data.spans) (byName[s.name] = byName[s.name] || []).push(s);
    const traces = Object.entries(byName).map(([name, spans], i) => ({ type: "bar", orientation: "h", name: name,
      y: spans.map((s) => "rank " + s.rank), x: spans.map((s) => s.ms), base: spans.map((s) => s.start_ms),
      opacity: name === "step" ? 0.25 : 0.9, marker: { color: COLORS[i % COLORS.length] },
      hovertemplate: name + " %{x:.3f} ms from %{base:.3f} ms<extra>%{y}</extra>" }));
    plot("chart-spans", traces, { barmode: "overlay", xaxis: { title: { text: "ms from the step's first start" } },
      height: Math.max(200, 80 + 30 * new Set(data.spans.map((s) => s.rank)).size) });
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
    const content = $("content");
    content.textContent = "";
    crumbs(el("span", {}, " / "), el("a", { href: SW.mode === "report" ? "#" : "/" }, "runs"), el("span", {}, " / " + page.session.session_id.slice(0, 8)));
    for (const problem of page.problems || []) message(problem, "warn");
    content.appendChild(headerCard(page));
    content.appendChild(diagnosisCard(page.diagnosis));
    content.appendChild(section("step-time", "Step time per rank", el("p", { id: "step-note", class: "note" }), chartDiv("chart-step")));
    content.appendChild(section("heatmap", "Rank × step: step time (the slowest of each bucket)", chartDiv("chart-heatmap")));
    content.appendChild(section("phases", "Phase shares over steps", chartDiv("chart-phases")));
    content.appendChild(section("memory", "Memory per rank", el("p", { class: "note" }, "dashed lines: alerts, OOMs, failures and verdict changes; dotted: epochs"), chartDiv("chart-memory")));
    content.appendChild(section("marks", "Loss and other marks", page.marks.length ? null : el("p", {}, "no numeric marks"), chartDiv("chart-marks")));
    const stepInput = el("input", { id: "spans-step", type: "number", min: 0 });
    const spansTools = SW.mode === "report" ? el("p", { class: "note" }, "the slowest step drawn") :
      el("div", { class: "toolbar" }, el("label", {}, "step ", stepInput),
        el("button", { id: "spans-go", onclick: () => loadSpans(page.session.session_id, parseInt(stepInput.value, 10)) }, "show"));
    const spansCard = section("spans", "One step's spans across ranks", spansTools, chartDiv("chart-spans"));
    spansCard.querySelector("h2").id = "spans-title";
    content.appendChild(spansCard);
    content.appendChild(alertsCard(page));
    content.appendChild(section("verdicts", "Verdict changes (live)", page.verdicts.length ? null : el("p", { class: "note" }, "none stored (the live verdict thread stores a change of the primary verdict while a run trains)"), el("table", {}, el("thead", {}, el("tr", {}, ["time", "step", "verdict", "severity", "message"].map((t) => el("th", {}, t)))), el("tbody", { id: "verdicts-body" }, verdictRows(page.verdicts)))));
    content.appendChild(epochsCard(page.epochs));
    if (page.summary_text) content.appendChild(section("summary", "Final summary (stepwatch summary)", el("pre", { class: "json" }, page.summary_text)));
    if (page.environment) content.appendChild(section("environment", "Environment (run.json)", el("pre", { class: "json" }, JSON.stringify(page.environment, null, 2))));
    if (!window.Plotly) { message(window.STEPWATCH_PLOTLY_MISSING || "the charting library did not load", "error"); return; }
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
        if (update.reload || update.status !== "running") {
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

  function applyUpdate(page, update) {
    const chart = $("chart-step");
    for (const s of update.steps) {
      let index = chart.data.findIndex((t) => t.meta && t.meta.rank === s.rank);
      if (index < 0) {
        window.Plotly.addTraces(chart, stepTraces([s])[0]);
        continue;
      }
      window.Plotly.extendTraces(chart, { x: [s.x], y: [s.y] }, [index]);
    }
    const mem = $("chart-memory");
    for (const s of update.memory) {
      const key = s.rank + "/" + s.device + "/" + s.collector;
      const index = mem.data.findIndex((t) => t.meta && t.meta.key === key);
      if (index < 0) {
        window.Plotly.addTraces(mem, { type: "scatter", mode: "lines", name: "rank " + s.rank, x: s.t, y: s.y, meta: { key: key } });
      } else {
        window.Plotly.extendTraces(mem, { x: [s.t], y: [s.y] }, [index]);
      }
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
    content.appendChild(section("compare-step", "Step time, A (solid) and B (dotted)", chartDiv("chart-compare")));
    const rows = data.metrics.map((m) => el("tr", {}, el("td", {}, m.metric), el("td", {}, fmt.num(m.a)), el("td", {}, fmt.num(m.b)),
      el("td", {}, m.relative === null ? "-" : (m.relative * 100).toFixed(1) + "%")));
    content.appendChild(section("compare-metrics", "Metrics", el("table", {}, el("thead", {}, el("tr", {}, ["metric", "A", "B", "change"].map((t) => el("th", {}, t)))), el("tbody", {}, rows))));
    if (!window.Plotly) { message(window.STEPWATCH_PLOTLY_MISSING || "the charting library did not load"); return; }
    plot("chart-compare", stepTraces(data.a.step_time.series, "A ", "solid").concat(stepTraces(data.b.step_time.series, "B ", "dot")),
      { xaxis: { title: { text: "step" } }, yaxis: { title: { text: "step time (ms)" } } });
  }

  // -- report: the data inlined, compressed ------------------------------------------------------

  async function inflate(id) {
    const text = $(id).textContent.trim();
    const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return await new Response(stream).text();
  }

  async function reportPage() {
    if (!window.Plotly && $("sw-plotly")) {
      const script = document.createElement("script");
      script.textContent = await inflate("sw-plotly");
      document.head.appendChild(script);
    }
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
