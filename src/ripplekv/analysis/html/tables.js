// Sortable, filterable tables: a click on a heading sorts by that column (again: the other way); a filter
// function decides which rows show. Cells with an interval show it beside the value.
"use strict";

function compareValues(a, b) {
  const missingA = a === null || a === undefined || a === "", missingB = b === null || b === undefined || b === "";
  if (missingA || missingB) return missingA - missingB;  // missing values last, whichever the order
  if (typeof a === "number" && typeof b === "number") return a - b;
  return String(a).localeCompare(String(b), undefined, { numeric: true });
}

function cellText(column, row) {
  const value = row[column.key];
  if (column.format) return column.format(value, row);
  return fmt(value, 4);
}

// columns: [{key, label, interval: [lowKey, highKey] | null, text: bool, format(value, row), className(value, row),
//            href(row): a link for the cell}]
// opts: {rowClass(row), onRowClick(row), sortKey, sortDir}
function dataTable(container, columns, rows, opts) {
  opts = opts || {};
  const wrap = document.createElement("div");
  wrap.className = "tablewrap";
  const table = document.createElement("table");
  const head = table.createTHead().insertRow();
  const body = table.createTBody();
  let sortKey = opts.sortKey || null, sortDir = opts.sortDir || 1, keep = () => true;
  const headers = columns.map((column) => {
    const th = document.createElement("th");
    th.textContent = column.label;
    th.dataset.key = column.key;
    if (column.text) th.className = "text";
    th.title = "sort by " + column.label + (column.interval ? " (95% interval in brackets)" : "");
    th.addEventListener("click", () => {
      sortDir = sortKey === column.key ? -sortDir : 1;
      sortKey = column.key;
      draw();
    });
    head.appendChild(th);
    return th;
  });

  function draw() {
    const shown = rows.filter((row) => keep(row));
    if (sortKey) shown.sort((a, b) => sortDir * compareValues(a[sortKey], b[sortKey]));
    headers.forEach((th) => {
      th.classList.remove("sorted-asc", "sorted-desc");
      if (th.dataset.key === sortKey) th.classList.add(sortDir > 0 ? "sorted-asc" : "sorted-desc");
    });
    body.replaceChildren();
    for (const row of shown) {
      const tr = body.insertRow();
      tr.dataset.method = row.method === undefined ? "" : String(row.method);
      if (opts.rowClass) tr.className = opts.rowClass(row) || "";
      if (opts.onRowClick) {
        tr.classList.add("clickable");
        tr.addEventListener("click", () => opts.onRowClick(row));
      }
      for (const column of columns) {
        const td = tr.insertCell();
        if (column.text) td.className = "text";
        if (column.className) td.classList.add(...(column.className(row[column.key], row) || "").split(" ").filter(Boolean));
        const href = column.href ? column.href(row) : null;
        if (href) {
          const a = document.createElement("a");
          a.href = href;
          a.textContent = cellText(column, row);
          td.appendChild(a);
        } else td.textContent = cellText(column, row);
        if (column.interval) {
          const [lo, hi] = column.interval.map((k) => row[k]);
          if (lo !== null && lo !== undefined && hi !== null && hi !== undefined) {
            const span = document.createElement("span");
            span.className = "ci";
            span.textContent = " [" + fmt(lo, 3) + ", " + fmt(hi, 3) + "]";
            span.style.color = "var(--muted)";
            span.style.fontSize = "12px";
            td.appendChild(span);
          }
        }
      }
    }
    if (!shown.length) {
      const td = body.insertRow().insertCell();
      td.colSpan = columns.length;
      td.className = "text empty";
      td.textContent = "no row matches the filter";
    }
  }

  table.appendChild(body);
  wrap.appendChild(table);
  container.appendChild(wrap);
  draw();
  return {
    element: table,
    filter(fn) { keep = fn; draw(); },
    sortBy(key, dir) { sortKey = key; sortDir = dir || 1; draw(); },
  };
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function section(parent, title, id) {
  const h = el("h2", title);
  if (id) h.id = id;
  parent.appendChild(h);
  const div = el("div");
  parent.appendChild(div);
  return div;
}

function facts(parent, pairs) {
  const ul = el("ul", null, "facts");
  for (const [name, value] of pairs) {
    if (value === null || value === undefined || value === "") continue;
    const li = el("li");
    li.append(el("b", name + ": "), document.createTextNode(Array.isArray(value) ? value.join(", ") : String(value)));
    ul.appendChild(li);
  }
  parent.appendChild(ul);
  return ul;
}
