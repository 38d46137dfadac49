// ripplekv's plotting layer: SVG line plots with intervals, forest plots and heatmaps, with hover tooltips.
// Plain DOM and SVG, no library: the page must open from disk with no network.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2557a7", "#d1495b", "#2a9d8f", "#e9a03b", "#6a4c93", "#3d7a1f", "#c05299", "#1b8ec2",
  "#8c5a2b", "#5a6a7a", "#b8860b", "#0f7b6c", "#9d2a52", "#4b6ed1", "#6f8f2f", "#a05a0f", "#3c3c99",
  "#c0392b", "#16a085", "#7f8c8d"];
const MARKERS = ["circle", "square", "diamond", "triangle"];

function svgEl(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) el.setAttribute(key, String(value));
  if (parent) parent.appendChild(el);
  return el;
}

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (value === 0) return "0";
  const size = Math.abs(value);
  if (size >= 1e9) return (value / 2 ** 30).toFixed(2) + " GiB";
  if (Number.isInteger(value) && size < 1e6) return String(value);
  return value.toPrecision(digits || 3).replace(/(\.\d*?)0+(e|$)/, "$1$2").replace(/\.(e|$)/, "$1");
}

function bytes(value) {
  if (value === null || value === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let shown = value, unit = 0;
  while (shown >= 1024 && unit < units.length - 1) { shown /= 1024; unit += 1; }
  return shown.toFixed(unit ? 2 : 0) + " " + units[unit];
}

// The shared tooltip: `lines` are [label, value] pairs or plain strings.
function showTip(event, lines) {
  const tip = document.getElementById("tip");
  tip.replaceChildren();
  for (const line of lines) {
    const row = document.createElement("div");
    if (Array.isArray(line)) {
      const name = document.createElement("b");
      name.textContent = line[0] + ": ";
      row.append(name, document.createTextNode(line[1]));
    } else row.textContent = line;
    tip.appendChild(row);
  }
  tip.hidden = false;
  const x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = Math.min(event.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
  tip.style.left = x + "px";
  tip.style.top = y + "px";
}

function hideTip() { document.getElementById("tip").hidden = true; }

function withTip(el, lines) {
  el.addEventListener("mousemove", (event) => showTip(event, lines));
  el.addEventListener("mouseleave", hideTip);
  return el;
}

function scale(domain, range, log) {
  const [d0, d1] = log ? domain.map(Math.log) : domain;
  const span = d1 - d0 || 1;
  const f = (v) => range[0] + ((log ? Math.log(v) : v) - d0) / span * (range[1] - range[0]);
  f.domain = domain; f.log = log;
  return f;
}

function logTicks(lo, hi) {
  const ticks = [];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
    for (const m of [1, 2, 5]) {
      const v = m * 10 ** e;
      if (v >= lo * 0.999 && v <= hi * 1.001) ticks.push(v);
    }
  }
  return ticks.length >= 2 ? ticks : [lo, hi];
}

function linearTicks(lo, hi) {
  const step = 10 ** Math.floor(Math.log10((hi - lo) || 1));
  const unit = [1, 2, 5, 10].map((m) => m * step).find((s) => (hi - lo) / s <= 6) || step * 10;
  const ticks = [];
  for (let v = Math.ceil(lo / unit) * unit; v <= hi + unit * 1e-9; v += unit) ticks.push(+v.toPrecision(12));
  return ticks;
}

function extent(values, log) {
  const kept = values.filter((v) => Number.isFinite(v) && (!log || v > 0));
  if (!kept.length) return log ? [0.1, 1] : [0, 1];
  let lo = Math.min(...kept), hi = Math.max(...kept);
  if (lo === hi) { lo = log ? lo / 2 : lo - 1; hi = log ? hi * 2 : hi + 1; }
  if (log) return [lo / 1.15, hi * 1.15];
  const pad = (hi - lo) * 0.05;
  return [lo - pad, hi + pad];
}

// Axes with grid lines; `x.ticks` may name the ticks (e.g. the run's budgets).
function drawAxes(svg, box, x, y, opts) {
  const grid = svgEl("g", { class: "grid" }, svg);
  const axis = svgEl("g", { class: "axis" }, svg);
  const xt = opts.xTicks || (x.log ? logTicks(...x.domain) : linearTicks(...x.domain));
  const yt = opts.yTicks || (y.log ? logTicks(...y.domain) : linearTicks(...y.domain));
  for (const t of xt) {
    svgEl("line", { x1: x(t), x2: x(t), y1: box.top, y2: box.bottom }, grid);
    svgEl("text", { x: x(t), y: box.bottom + 14, "text-anchor": "middle" }, axis).textContent =
      (opts.xFormat || fmt)(t);
  }
  for (const t of yt) {
    svgEl("line", { x1: box.left, x2: box.right, y1: y(t), y2: y(t) }, grid);
    svgEl("text", { x: box.left - 5, y: y(t) + 4, "text-anchor": "end" }, axis).textContent = (opts.yFormat || fmt)(t);
  }
  svgEl("rect", { x: box.left, y: box.top, width: box.right - box.left, height: box.bottom - box.top,
    fill: "none", stroke: "#b9c0c8" }, svg);
  svgEl("text", { x: (box.left + box.right) / 2, y: box.bottom + 32, "text-anchor": "middle" }, axis).textContent =
    opts.xLabel || "";
  const yl = svgEl("text", { x: 0, y: 0, "text-anchor": "middle",
    transform: `translate(14 ${(box.top + box.bottom) / 2}) rotate(-90)` }, axis);
  yl.textContent = opts.yLabel || "";
}

function marker(svg, shape, cx, cy, color) {
  const r = 4;
  if (shape === "square") return svgEl("rect", { x: cx - r, y: cy - r, width: 2 * r, height: 2 * r, fill: color, class: "mark" }, svg);
  if (shape === "diamond") return svgEl("path", { d: `M${cx} ${cy - r - 1}L${cx + r + 1} ${cy}L${cx} ${cy + r + 1}L${cx - r - 1} ${cy}Z`, fill: color, class: "mark" }, svg);
  if (shape === "triangle") return svgEl("path", { d: `M${cx} ${cy - r - 1}L${cx + r + 1} ${cy + r}L${cx - r - 1} ${cy + r}Z`, fill: color, class: "mark" }, svg);
  return svgEl("circle", { cx, cy, r, fill: color, class: "mark" }, svg);
}

function legend(container, series) {
  const box = document.createElement("div");
  box.className = "legend";
  for (const s of series) {
    const item = document.createElement("span");
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = s.color;
    item.append(sw, document.createTextNode(s.name));
    box.appendChild(item);
  }
  container.appendChild(box);
}

// Lines with vertical intervals: series [{name, color, shape, points: [{x, y, lo, hi, tip: [[k, v]...]}]}].
function linePlot(container, series, opts) {
  const width = 640, height = 360;
  const box = { left: 62, right: width - 14, top: 12, bottom: height - 42 };
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": opts.title || "plot" });
  const points = series.flatMap((s) => s.points);
  const floor = opts.yLog ? Math.min(...points.map((p) => p.y).filter((v) => v > 0)) / 2 : -Infinity;
  const clampY = (v) => (Number.isFinite(v) ? Math.max(v, floor) : v);
  const x = scale(extent(points.map((p) => p.x), opts.xLog), [box.left + 8, box.right - 8], opts.xLog);
  const ys = points.flatMap((p) => [p.y, p.lo, p.hi].map(clampY));
  const y = scale(extent(ys, opts.yLog), [box.bottom, box.top], opts.yLog);
  drawAxes(svg, box, x, y, opts);
  for (const s of series) {
    const path = s.points.filter((p) => Number.isFinite(p.y) && (!opts.yLog || p.y > 0));
    if (path.length > 1) {
      svgEl("path", { d: path.map((p, i) => `${i ? "L" : "M"}${x(p.x).toFixed(1)} ${y(p.y).toFixed(1)}`).join(""),
        fill: "none", stroke: s.color, "stroke-width": 1.6, opacity: 0.85 }, svg);
    }
    for (const p of path) {
      if (Number.isFinite(p.lo) && Number.isFinite(p.hi)) {
        svgEl("line", { x1: x(p.x), x2: x(p.x), y1: y(clampY(p.lo)), y2: y(clampY(p.hi)), stroke: s.color,
          "stroke-width": 1.2, opacity: 0.6 }, svg);
      }
      withTip(marker(svg, s.shape, x(p.x), y(p.y), s.color), p.tip);
    }
  }
  container.appendChild(svg);
  legend(container, series);
  return svg;
}

// Forest: rows [{name, color, value, lo, hi, tip}] top to bottom, a reference line at `opts.ref`.
function forestPlot(container, rows, opts) {
  const width = 640, rowHeight = 20, height = 56 + rowHeight * Math.max(rows.length, 1);
  const box = { left: 230, right: width - 16, top: 10, bottom: height - 42 };
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": opts.title || "forest" });
  const values = rows.flatMap((r) => [r.value, r.lo, r.hi]).concat([opts.ref]);
  const x = scale(extent(values, opts.xLog), [box.left + 6, box.right - 6], opts.xLog);
  const y = (i) => box.top + rowHeight * (i + 0.5);
  drawAxes(svg, box, x, { domain: [0, 1], log: false }, { ...opts, yTicks: [] });
  svgEl("line", { x1: x(opts.ref), x2: x(opts.ref), y1: box.top, y2: box.bottom, stroke: "#555", "stroke-dasharray": "4 3" }, svg);
  rows.forEach((r, i) => {
    const label = svgEl("text", { x: box.left - 6, y: y(i) + 4, "text-anchor": "end", "font-size": 11 }, svg);
    label.textContent = (r.star ? "* " : "") + (r.name.length > 34 ? r.name.slice(0, 33) + "…" : r.name);
    const lo = opts.xLog ? Math.max(r.lo, x.domain[0]) : r.lo;
    if (Number.isFinite(r.lo) && Number.isFinite(r.hi)) {
      svgEl("line", { x1: x(lo), x2: x(r.hi), y1: y(i), y2: y(i), stroke: r.color, "stroke-width": 2 }, svg);
    }
    withTip(marker(svg, "square", x(r.value), y(i), r.color), r.tip);
  });
  container.appendChild(svg);
  return svg;
}

// Heatmap: rows and cols are labels; cells [{r, c, v, tip}]; colour from `opts.colour(v)`; blank where no cell.
function heatmap(container, rowLabels, colLabels, cells, opts) {
  const cw = 54, ch = 20, left = 54, top = 30;
  const width = left + cw * colLabels.length + 8, height = top + ch * rowLabels.length + 8;
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": opts.title || "heatmap",
    style: `max-width:${width * 1.4}px` });
  colLabels.forEach((c, j) => {
    svgEl("text", { x: left + cw * (j + 0.5), y: top - 8, "text-anchor": "middle", "font-size": 10 }, svg).textContent = c;
  });
  rowLabels.forEach((r, i) => {
    svgEl("text", { x: left - 4, y: top + ch * (i + 0.5) + 4, "text-anchor": "end", "font-size": 10 }, svg).textContent = r;
  });
  for (const cell of cells) {
    const rect = svgEl("rect", { x: left + cw * cell.c, y: top + ch * cell.r, width: cw - 1, height: ch - 1,
      fill: opts.colour(cell.v), class: "mark" }, svg);
    withTip(rect, cell.tip);
    const t = svgEl("text", { x: left + cw * (cell.c + 0.5), y: top + ch * (cell.r + 0.5) + 4, "text-anchor": "middle",
      "font-size": 9, fill: opts.ink ? opts.ink(cell.v) : "#000", "pointer-events": "none" }, svg);
    t.textContent = fmt(cell.v, 2);
  }
  container.appendChild(svg);
  return svg;
}

// A colour ramp between two hex colours, for heatmaps: t in [0, 1].
function ramp(from, to) {
  const parse = (h) => [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16));
  const [a, b] = [parse(from), parse(to)];
  return (t) => {
    const k = Math.max(0, Math.min(1, Number.isFinite(t) ? t : 0));
    return "rgb(" + a.map((v, i) => Math.round(v + (b[i] - v) * k)).join(",") + ")";
  };
}
