// The pages: a run's leaderboard (kind "run"), two runs side by side ("compare"), a needle heatmap ("needle")
// and the index of a results folder ("site"). The data is the JSON inlined beside this script.
"use strict";

const DATA = JSON.parse(document.getElementById("data").textContent);
const APP = document.getElementById("app");
const STYLES = new Map();

function styleOf(method) {
  if (!STYLES.has(method)) {
    const i = STYLES.size;
    STYLES.set(method, { color: PALETTE[i % PALETTE.length], shape: MARKERS[Math.floor(i / PALETTE.length) % MARKERS.length] });
  }
  return STYLES.get(method);
}

// What a filter text keeps: comma-separated terms, a method shows when its label contains any of them.
function matches(text, method) {
  const terms = text.split(",").map((t) => t.trim().toLowerCase()).filter(Boolean);
  return !terms.length || terms.some((t) => String(method).toLowerCase().includes(t));
}

function budgetsOf(rows) {
  return [...new Set(rows.map((r) => r.budget).filter((b) => b !== null && b !== undefined))].sort((a, b) => a - b);
}

function controls(parent, budgets, state, onChange, withAware, everyBudget = true) {
  const bar = el("div", null, "controls");
  const search = document.createElement("input");
  search.type = "search";
  search.id = "filter";
  search.placeholder = "filter methods: snapkv, kv, …";
  search.addEventListener("input", () => { state.text = search.value; onChange(); });
  const select = document.createElement("select");
  select.id = "budget";
  for (const b of everyBudget ? ["all", ...budgets] : budgets) {
    select.appendChild(new Option(b === "all" ? "every budget" : "B = " + b, b));
  }
  select.addEventListener("change", () => { state.budget = select.value; onChange(); });
  bar.append(el("label", "Methods "), search, el("label", "Budget "), select);
  if (withAware) {
    const box = document.createElement("input");
    box.type = "checkbox";
    box.id = "aware";
    box.checked = state.aware;
    box.addEventListener("change", () => { state.aware = box.checked; onChange(); });
    const label = el("label");
    label.append(box, document.createTextNode(" answer-aware rows"));
    bar.appendChild(label);
  }
  parent.appendChild(bar);
  return bar;
}

function verdictClass(value) { return value ? "verdict-" + value : ""; }

function footprintText(row, budgets) {
  const top = budgets.length ? budgets[budgets.length - 1] : null;
  const show = (v) => (v === null || v === undefined ? "> " + top : fmt(v));
  if (row.footprint === undefined || row.method === DATA.reference) return "–";
  return show(row.footprint) + " [" + show(row.footprint_low) + ", " + show(row.footprint_high) + "]";
}

function boardColumns(columns, budgets) {
  return columns.map((c) => {
    const column = { key: c.key, label: c.label, interval: c.interval, text: c.key === "method" || c.key === "versus" };
    if (c.key.includes("verdict")) column.className = verdictClass;
    if (c.key.startsWith("p_")) column.format = (v) => fmt(v, 2);
    if (c.key === "footprint") { column.interval = null; column.format = (v, row) => footprintText(row, budgets); }
    return column;
  });
}

function describeRun(parent, about, settings) {
  facts(parent, [["model", about.model], ["suite", about.suite], ["tasks", about.tasks], ["samples (n)", about.samples],
    ["prompt tokens", about.prompt_tokens ? about.prompt_tokens.join("–") : null], ["protocol", about.protocol],
    ["budgets", about.budgets], ["device", about.device], ["dtype", about.dtype], ["ripplekv", about.version]]);
  const note = el("p", null, "muted small");
  note.textContent = "KL and agreement are measured against this model's own full-cache answer (teacher-forced); " +
    "scores are the tasks' metrics x100. Every row shows its n. Answer-aware rows (italic) know the answer: they are " +
    "no methods, and are left out of ranks and verdicts. " + (settings && settings.interval ? "Intervals: " +
    settings.interval + " at " + (settings.confidence || 0.95) + "; tests: " + settings.test + ", " +
    settings.adjustment + "; baseline: " + settings.baseline + "." : "");
  parent.appendChild(note);
}

function headlineTable(parent, rows) {
  if (!rows.length) { parent.appendChild(el("p", "this run has no headline (one method only)", "empty")); return; }
  const wanted = [["scope", "scope", null, true], ["budget", "B"], ["samples", "n"], ["closest", "closest", null, true],
    ["closest_kl", "its KL"], ["runner_up", "runner-up", null, true], ["runner_up_kl", "its KL"],
    ["kl_delta", "KL difference", ["kl_ci_low", "kl_ci_high"]], ["p_kl_holm", "Holm p"], ["kl_verdict", "verdict"],
    ["score_delta", "score difference", ["score_ci_low", "score_ci_high"]], ["p_score_holm", "Holm p (score)"],
    ["score_verdict", "score verdict"]];
  const columns = wanted.filter(([key]) => key in rows[0]).map(([key, label, interval, text]) => ({
    key, label, text, interval: interval && interval.every((k) => k in rows[0]) ? interval : null,
    className: key.includes("verdict") ? verdictClass : null, format: key.startsWith("p_") ? (v) => fmt(v, 2) : null }));
  dataTable(parent, columns, rows);
}

function klSeries(board, state, measure) {
  const series = [];
  for (const method of new Set(board.map((r) => r.method))) {
    if (method === DATA.reference || !matches(state.text, method)) continue;
    if (!state.aware && (DATA.ceilings || []).includes(method)) continue;
    const rows = board.filter((r) => r.method === method && r.budget !== null && r[measure] !== null);
    if (!rows.length) continue;
    const points = rows.map((r) => ({ x: r.budget, y: r[measure], lo: r[measure + "_ci_low"], hi: r[measure + "_ci_high"],
      tip: [["method", method], ["budget", r.budget], ["n", fmt(r.n)], [measure, fmt(r[measure], 4) + (r[measure + "_ci_low"] !== undefined
        ? " [" + fmt(r[measure + "_ci_low"], 3) + ", " + fmt(r[measure + "_ci_high"], 3) + "]" : "")]] }));
    series.push({ name: method, ...styleOf(method), points: points.sort((a, b) => a.x - b.x) });
  }
  return series;
}

function plotBox(parent, title, note) {
  const box = el("div", null, "plot");
  box.appendChild(el("h3", title));
  if (note) box.appendChild(el("p", note, "muted small"));
  parent.appendChild(box);
  return box;
}

function forestRows(board, budget, state) {
  return board.filter((r) => r.budget === budget && r.method !== DATA.reference && r.kl_ratio_vs_uniform !== null &&
    r.kl_ratio_vs_uniform !== undefined && r.versus !== r.method && matches(state.text, r.method) &&
    !(DATA.ceilings || []).includes(r.method))
    .sort((a, b) => a.kl_ratio_vs_uniform - b.kl_ratio_vs_uniform)
    .map((r) => ({ name: r.method, ...styleOf(r.method), value: r.kl_ratio_vs_uniform, lo: r.kl_ratio_ci_low,
      hi: r.kl_ratio_ci_high, star: r.p_kl_vs_uniform_holm !== null && r.p_kl_vs_uniform_holm < 0.05,
      tip: [["method", r.method], ["budget", r.budget], ["n", fmt(r.n)], ["KL ÷ " + r.versus, fmt(r.kl_ratio_vs_uniform, 3) +
        " [" + fmt(r.kl_ratio_ci_low, 3) + ", " + fmt(r.kl_ratio_ci_high, 3) + "]"], ["Holm p", fmt(r.p_kl_vs_uniform_holm, 2)]] }));
}

function memoryPlot(parent, rows, state) {
  const series = [];
  for (const method of new Set(rows.map((r) => r.method))) {
    if (!matches(state.text, method)) continue;
    const own = rows.filter((r) => r.method === method && r.kv_bytes !== null && r.kl !== null &&
      (state.budget === "all" || String(r.budget) === state.budget));
    if (!own.length) continue;
    series.push({ name: method, ...styleOf(method), points: own.map((r) => ({ x: r.kv_bytes, y: r.kl, lo: r.kl_ci_low,
      hi: r.kl_ci_high, tip: [["method", method], ["budget", r.budget], ["n", fmt(r.samples)], ["bits", r.bits],
        ["bytes", bytes(r.kv_bytes)], ["KL", fmt(r.kl, 4) + " [" + fmt(r.kl_ci_low, 3) + ", " + fmt(r.kl_ci_high, 3) + "]"]] }))
      .sort((a, b) => a.x - b.x) });
  }
  const box = plotBox(parent, "Memory axis: KL against the bytes kept", "x: KV bytes per sample (mean), log scale; " +
    "y: KL to the full cache (95% interval); a line joins one method's budgets.");
  if (series.length) linePlot(box, series, { xLog: true, yLog: false, xLabel: "KV bytes", yLabel: "KL", xFormat: bytes });
  else box.appendChild(el("p", "no method matches the filter", "empty"));
}

function needlePanels(parent, grid, budget, state) {
  const depths = [...new Set(grid.map((r) => r.depth))].sort((a, b) => a - b);
  const lengths = [...new Set(grid.map((r) => r.length))].sort((a, b) => a - b);
  const klTop = Math.max(1e-6, ...grid.map((r) => r.kl || 0));
  const methods = [...new Set(grid.map((r) => r.method))].filter((m) => m === DATA.reference || matches(state.text, m));
  const accuracy = ramp("#c0392b", "#2a9d8f"), kl = ramp("#fdf6e3", "#5b1a5e");
  for (const method of methods) {
    const rows = grid.filter((r) => r.method === method && (method === DATA.reference || r.budget === budget));
    if (!rows.length) continue;
    for (const [value, colour, label] of [["accuracy", (v) => accuracy(v / 100), "accuracy (%)"],
      ["kl", (v) => kl(v / klTop), "KL to the full cache"]]) {
      const box = plotBox(parent, method + (method === DATA.reference ? "" : " @ B=" + budget) + ": " + label);
      const cells = rows.map((r) => ({ r: depths.indexOf(r.depth), c: lengths.indexOf(r.length), v: r[value],
        tip: [["method", method], ["budget", r.budget === null ? "full" : r.budget], ["length", r.length],
          ["depth", r.depth + "%"], ["n", r.n], [label, fmt(r[value], 3)]] }));
      heatmap(box, depths.map((d) => d + "%"), lengths.map(String), cells, { colour,
        ink: (v) => (value === "kl" ? (v / klTop > 0.55 ? "#fff" : "#000") : "#fff") });
    }
  }
}

function renderRun(d) {
  APP.appendChild(el("h1", d.title));
  describeRun(APP, d.about, d.settings);
  headlineTable(section(APP, "Headline: the method closest to the full cache, and the runner-up", "headline"), d.headline);
  const budgets = budgetsOf(d.board);
  const state = { text: "", budget: "all", aware: true };
  const boardSection = section(APP, "Leaderboard", "leaderboard");
  boardSection.appendChild(el("p", "Click a heading to sort, a row to open its method below. Critical footprint: the " +
    "smallest budget at which the method keeps " + (d.footprint_measure || "agreement >= 0.9") +
    " (90% of the full cache's fidelity), with the budgets its interval allows; \"> " + budgets[budgets.length - 1] +
    "\": not reached in this run.", "muted small"));
  controls(boardSection, budgets, state, refresh, (d.ceilings || []).length > 0);
  const aware = new Set(d.ceilings || []);
  const table = dataTable(boardSection, boardColumns(d.columns, budgets), d.board, {
    rowClass: (r) => (r.method === d.reference ? "reference" : aware.has(r.method) ? "aware" : ""),
    onRowClick: (r) => openMethod(r.method) });
  footprintTable(section(APP, "Critical KV footprint: one number per method", "footprint"), d, budgets);
  const plots = el("div", null, "plots");
  section(APP, "Plots", "plots").appendChild(plots);
  const panel = section(APP, "Method", "method");
  const picker = document.createElement("select");
  picker.id = "method-picker";
  for (const m of Object.keys(d.methods)) picker.appendChild(new Option(m, m));
  picker.addEventListener("change", () => drawMethod(panel, d, picker.value, budgets));
  panel.append(el("label", "Method "), picker);
  function openMethod(method) {
    picker.value = method;
    drawMethod(panel, d, method, budgets);
    document.getElementById("method").scrollIntoView();
  }

  function refresh() {
    table.filter((r) => (r.method === d.reference || matches(state.text, r.method)) && (state.aware || !aware.has(r.method)) &&
      (state.budget === "all" || r.budget === null || String(r.budget) === state.budget));
    plots.replaceChildren();
    const kl = plotBox(plots, "KL to the full cache against the budget", "95% intervals; log scales; hover a point.");
    linePlot(kl, klSeries(d.board, state, "kl"), { xLog: true, yLog: true, xLabel: "budget B (entries per layer and KV head)",
      yLabel: "KL to the full cache", xTicks: budgets });
    if (d.board.some((r) => r.agreement !== undefined && r.method !== d.reference)) {
      const agree = plotBox(plots, "Agreement with the full cache's answer against the budget", "95% intervals.");
      linePlot(agree, klSeries(d.board, state, "agreement"), { xLog: true, xLabel: "budget B", yLabel: "agreement", xTicks: budgets });
    }
    const forestBudget = state.budget === "all" ? budgets[0] : Number(state.budget);
    const rows = forestRows(d.board, forestBudget, state);
    const forest = plotBox(plots, "Forest: KL ÷ the baseline's KL at B = " + forestBudget, "Choose the budget above; " +
      "log scale, 95% intervals; * Holm-adjusted p < 0.05; left of the dashed line: closer to the full cache.");
    if (rows.length) forestPlot(forest, rows, { xLog: true, ref: 1, xLabel: "KL ÷ baseline's KL" });
    else forest.appendChild(el("p", "no comparison with a baseline at this budget", "empty"));
    if (d.memory) memoryPlot(plots, d.memory, state);
    if (d.needle) needlePanels(plots, d.needle, forestBudget, state);
  }
  refresh();
  const first = d.board.find((r) => r.method !== d.reference && r.rank === 1) || d.board.find((r) => r.method !== d.reference);
  if (first) picker.value = first.method;
  drawMethod(panel, d, picker.value, budgets);
}

function footprintTable(parent, d, budgets) {
  const top = budgets[budgets.length - 1];
  const rows = Object.entries(d.methods).filter(([m, info]) => m !== d.reference && info.footprint &&
    info.footprint.footprint !== undefined).map(([m, info]) => ({ method: m, ...info.footprint }));
  if (!rows.length) { parent.appendChild(el("p", "no budgets to summarise", "empty")); return; }
  parent.appendChild(el("p", "The smallest budget at which the method keeps " + (d.footprint_measure || "agreement >= 0.9") +
    " (90% of the full cache's fidelity); the interval runs from the smallest budget whose 95% interval reaches it to " +
    "the smallest whose interval lies above it. \"> " + top + "\": not within this run's budgets.", "muted small"));
  const shown = (v) => (v === null || v === undefined ? "> " + top : fmt(v));
  dataTable(parent, [{ key: "method", label: "method", text: true }, { key: "footprint", label: "footprint B", format: shown },
    { key: "footprint_low", label: "interval: from", format: shown }, { key: "footprint_high", label: "to", format: shown }],
  rows, { sortKey: "footprint", sortDir: 1, rowClass: (r) => ((d.ceilings || []).includes(r.method) ? "aware" : "") });
}

function drawMethod(panel, d, method, budgets) {
  panel.querySelectorAll(".panel").forEach((n) => n.remove());
  const info = d.methods[method];
  const box = el("div", null, "panel");
  panel.appendChild(box);
  box.appendChild(el("h3", method + (info.answer_aware ? " (answer-aware: not a method)" : "")));
  const dl = el("dl");
  const add = (name, value, mono) => {
    if (value === null || value === undefined || value === "") return;
    dl.append(el("dt", name), el("dd", typeof value === "string" ? value : JSON.stringify(value), mono ? "mono" : ""));
  };
  add("what it is", info.about);
  add("alias of", info.alias_of);
  add("resolved spec", info.spec, true);
  add("defaults", info.defaults && Object.keys(info.defaults).length ? info.defaults : null, true);
  add("reference code", info.reference || "see docs/methods.md");
  if (info.footprint && info.footprint.footprint !== undefined && method !== d.reference) {
    add("critical footprint", footprintText({ method, ...info.footprint }, budgets) + " (" + info.footprint.footprint_measure + ")");
  }
  box.appendChild(dl);
  if (info.tasks.length) {
    box.appendChild(el("h3", "Per task"));
    const keys = ["task", "budget", "n", "score", "kl", "agreement", "informative"].filter((k) => k in info.tasks[0]);
    dataTable(box, keys.map((k) => ({ key: k, label: k, text: k === "task" })), info.tasks);
  }
  if (method === d.reference) return;
  box.appendChild(el("h3", "Where its answer differs most from the full cache's (highest KL)"));
  if (!info.worst.length) box.appendChild(el("p", "no sample with a KL", "empty"));
  for (const s of info.worst) {
    const div = el("div", null, "sample");
    facts(div, [["sample", s.id], ["task", s.task], ["budget", s.budget], ["KL", fmt(s.kl, 4)],
      ["agreement", fmt(s.agreement, 3)], ["score", fmt(s.score, 3)], ["gold", s.gold]]);
    div.appendChild(el("p", s.excerpt ? "Prompt: " + s.excerpt : "Prompt: this run's lines carry no prompt text " +
      "(its eval predates recording it); the command below rebuilds the prompt.", s.excerpt ? "small" : "small empty"));
    const answers = el("div", null, "answers");
    const mine = el("div"), full = el("div");
    mine.append(el("b", "this method: "), document.createTextNode(s.prediction === null ? "–" : s.prediction));
    full.append(el("b", "full cache: "), document.createTextNode(s.full_answer === null ? "–" : s.full_answer));
    answers.append(mine, full);
    div.appendChild(answers);
    div.appendChild(el("p", "What it kept is not in the run (it needs the model); draw it with:", "small muted"));
    div.appendChild(el("pre", s.inspect));
    box.appendChild(div);
  }
}

function renderNeedle(d) {
  APP.appendChild(el("h1", d.title));
  facts(APP, [["model", d.about.model], ["suite", d.about.suite], ["tasks", d.about.tasks]]);
  const links = el("p", "Runs at each length: ");
  d.runs.forEach((r, i) => { const a = el("a", r.name); a.href = r.link; links.append(i ? ", " : "", a); });
  APP.appendChild(links);
  const budgets = budgetsOf(d.needle);
  const state = { text: "", budget: String(budgets[0]), aware: true };
  const holder = section(APP, "Needle retrieval by depth and length", "needle");
  controls(holder, budgets, state, draw, false, false);
  const plots = el("div", null, "plots");
  holder.appendChild(plots);
  function draw() {
    plots.replaceChildren();
    needlePanels(plots, d.needle, state.budget === "all" ? budgets[0] : Number(state.budget), state);
  }
  draw();
}

function renderCompare(d) {
  APP.appendChild(el("h1", d.title));
  APP.appendChild(el("p", "Rankings are paired: at each budget, the methods run in both, re-ranked by KL among " +
    "themselves (rank 1: closest to its own full cache). Compare ranks, not KL values, across models.", "muted small"));
  const sides = el("div", null, "sides");
  APP.appendChild(sides);
  const state = { text: "", budget: "all", aware: true };
  const budgets = budgetsOf(d.pairs);
  d.runs.forEach((run, i) => {
    const side = el("div");
    const title = el("h2", (i ? "B: " : "A: ") + (d.names ? d.names[i] : run.about.folder));
    if (run.link) { const a = el("a", " (its page)"); a.href = run.link; title.appendChild(a); }
    side.appendChild(title);
    describeRun(side, run.about, run.settings);
    headlineTable(side, run.headline.filter((r) => !r.scope || r.scope === run.headline[0].scope));
    const plot = plotBox(side, "KL against the budget");
    linePlot(plot, klSeries(run.board, state, "kl"), { xLog: true, yLog: true, xLabel: "budget B", yLabel: "KL",
      xTicks: budgetsOf(run.board) });
    sides.appendChild(side);
  });
  const paired = section(APP, "Rankings paired", "paired");
  paired.appendChild(el("p", d.agreement.map((a) => "B=" + a.budget + ": " + a.methods + " methods, Spearman " +
    fmt(a.spearman, 3)).join("; ") || "no budget and method in both runs", "small"));
  controls(paired, budgets, state, () => table.filter((r) => matches(state.text, r.method) &&
    (state.budget === "all" || String(r.budget) === state.budget)), false);
  const table = dataTable(paired, [{ key: "budget", label: "B" }, { key: "method", label: "method", text: true },
    { key: "rank_a", label: "rank in A" }, { key: "rank_b", label: "rank in B" },
    { key: "change", label: "change", className: (v) => (v < 0 ? "change-up" : v > 0 ? "change-down" : ""),
      format: (v) => (v > 0 ? "+" + v : String(v)) },
    { key: "kl_a", label: "KL in A" }, { key: "kl_b", label: "KL in B" }], d.pairs);
}

function renderSite(d) {
  APP.appendChild(el("h1", d.title));
  APP.appendChild(el("p", "Every page below is self-contained: it opens from disk with the network off.", "muted"));
  const columns = [{ key: "path", label: "page", text: true, format: (v) => v, href: (row) => row.link },
    { key: "kind", label: "kind", text: true }, { key: "model", label: "model", text: true },
    { key: "suite", label: "suite", text: true }, { key: "samples", label: "samples" },
    { key: "summary", label: "headline", text: true }];
  dataTable(APP, columns, d.pages);
}

({ run: renderRun, compare: renderCompare, needle: renderNeedle, site: renderSite })[DATA.kind](DATA);
