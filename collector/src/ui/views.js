// What the table, sandwich and compare views compute from stacks (no drawing here beyond the
// table's rows): functions by self and total, the callers and callees trees of one function,
// and the differential tree of two profiles.
"use strict";

// Rows drawn at most in the function table; the filter finds the rest.
const TABLE_MAX_ROWS = 500;

// Functions by self value (stacks ending in them) and total value (stacks holding them,
// counted once per stack even under recursion). Process roots are not functions.
function functionTable(stacks) {
  const rows = new Map();
  const row = (name) => {
    let r = rows.get(name);
    if (!r) { r = { name, self: 0, total: 0, kind: frameKind(name, false) }; rows.set(name, r); }
    return r;
  };
  for (const s of stacks) {
    const seen = new Set();
    for (const f of s.frames) {
      if (!seen.has(f)) { seen.add(f); row(f).total += s.value; }
    }
    if (s.frames.length) row(s.frames[s.frames.length - 1]).self += s.value;
  }
  return [...rows.values()];
}

// Fills `tbody` with the rows that contain `filter` (case-insensitive), sorted by
// `sort.key` ("name", "self" or "total"), and returns how many matched.
function renderTable(tbody, rows, { sort, filter, total, unit, selected, onPick }) {
  const f = (filter || "").toLowerCase();
  const shown = rows.filter((r) => !f || r.name.toLowerCase().includes(f));
  const dir = sort.desc ? -1 : 1;
  shown.sort((a, b) => {
    const x = a[sort.key], y = b[sort.key];
    const c = x < y ? -1 : x > y ? 1 : 0;
    return c * dir || (a.name < b.name ? -1 : 1);
  });
  const frag = document.createDocumentFragment();
  for (const r of shown.slice(0, TABLE_MAX_ROWS)) {
    const tr = document.createElement("tr");
    if (r.name === selected) tr.className = "on";
    const name = document.createElement("td");
    const sw = document.createElement("i");
    sw.className = "kind";
    sw.style.background = kindColour(r.kind, r.name);
    name.append(sw, r.name);
    name.title = r.name;
    tr.append(name);
    for (const v of [r.self, r.total]) {
      const td = document.createElement("td");
      td.textContent = `${formatValue(v, unit)}`;
      const p = document.createElement("span");
      p.className = "pct";
      p.textContent = `${pct(v, total).toFixed(2)} %`;
      td.append(" ", p);
      tr.append(td);
    }
    tr.onclick = () => onPick(r.name);
    frag.append(tr);
  }
  tbody.replaceChildren(frag);
  return shown.length;
}

// The sandwich of `fn`: in each stack holding it, from its outermost call, the callers
// (nearest first) and the callees (the rest of the stack, recursion included). Both trees
// are rooted at `fn`, so their root values are its total.
function sandwichTrees(stacks, fn) {
  const callers = newNode(fn, null, frameKind(fn, false));
  const callees = newNode(fn, null, frameKind(fn, false));
  for (const s of stacks) {
    const i = s.frames.indexOf(fn);
    if (i < 0) continue;
    const up = s.frames.slice(0, i).reverse();
    if (s.process !== null) up.push(s.process);
    addStack(callers, up, s.value, "value", s.process !== null ? up.length - 1 : -1);
    addStack(callees, s.frames.slice(i + 1), s.value, "value", -1);
  }
  return { callers, callees };
}

// One tree of two profiles' code stacks (process roots left out, so runs under different
// process names line up): `base` holds the baseline's values, `value` the candidate's.
function diffTree(baseProfile, newProfile) {
  const root = newNode("all", null, "root");
  treeOf(baseProfile, { process: false }, root, "base");
  treeOf(newProfile, { process: false }, root, "value");
  return root;
}
