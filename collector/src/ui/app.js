// The page: state held in the URL, the chart (uPlot) with range brushing, label pickers, and
// the wiring of the flame graph, table, sandwich and compare views.
"use strict";

const $ = (id) => document.getElementById(id);
const VIEWS = ["flame", "table", "sandwich", "compare"];
// URL parameters of the compare form, named as /api/v1/diff names them, and their inputs.
const COMPARE_FIELDS = [["base_query", "base-query"], ["base_from", "base-from"], ["base_to", "base-to"],
  ["new_query", "new-query"], ["new_from", "new-from"], ["new_to", "new-to"],
  ["inclusive", "cmp-judge"], ["fail_above", "cmp-threshold"]];
const PALETTE = ["#c0392b", "#2874a6", "#d68910", "#239b56", "#7d3c98", "#17a589", "#a04000", "#5d6d7e",
  "#cb4335", "#1f618d", "#b7950b"];

const state = {
  view: "flame", query: "{}", from: "now-1h", to: "now", type: "", by: "", search: "", fn: "",
  filter: "", sort: { key: "self", desc: true },
};
let profile = null; // the last `format=flame` answer
let stacks = [];
let tableRows = [];
let chart = null;
let loadSeq = 0;
let compareSeq = 0;

// --- reading with a token ---------------------------------------------------------------------
// A collector with a token file answers 401 until a read token comes with each request: the
// page asks for it once and keeps it for this tab only (sessionStorage), never in the URL.

const TOKEN_KEY = "pyrometer-token";
let signingIn = null; // the pending sign-in, shared by the requests that wait for it

function authHeaders() {
  const t = sessionStorage.getItem(TOKEN_KEY);
  return t ? { Authorization: "Bearer " + t } : {};
}

// Shows the sign-in form and resolves once a token is entered.
function signIn(message) {
  if (signingIn) return signingIn;
  signingIn = new Promise((resolve) => {
    $("signin-error").textContent = message || "";
    $("signin").hidden = false;
    $("token").value = "";
    $("token").focus();
    $("signin").onsubmit = (e) => {
      e.preventDefault();
      const t = $("token").value.trim();
      if (!t) return;
      sessionStorage.setItem(TOKEN_KEY, t);
      $("signin").hidden = true;
      signingIn = null;
      resolve();
    };
  });
  return signingIn;
}

// fetch with the tab's token, asking for one (again) on 401.
async function authorized(url) {
  for (;;) {
    const r = await fetch(url, { headers: authHeaders() });
    if (r.status !== 401) return r;
    const had = sessionStorage.getItem(TOKEN_KEY);
    sessionStorage.removeItem(TOKEN_KEY);
    await signIn(had ? "That token was not accepted." : "");
  }
}

async function json(url) {
  const r = await authorized(url);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

// A download link whose request carries the token: fetched, then saved from a blob.
function download(link, name) {
  link.onclick = async (e) => {
    e.preventDefault();
    try {
      const r = await authorized(link.href);
      if (!r.ok) throw new Error((await r.json()).error || r.statusText);
      const url = URL.createObjectURL(await r.blob());
      const a = document.createElement("a");
      a.href = url;
      a.download = name;
      a.click();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) {
      $("error").textContent = err.message;
    }
  };
}

// --- URL state -----------------------------------------------------------------------------

function readURL() {
  const p = new URLSearchParams(location.search);
  for (const k of ["query", "from", "to", "type", "by", "search", "fn", "filter"])
    if (p.has(k)) state[k] = p.get(k);
  if (VIEWS.includes(p.get("view"))) state.view = p.get("view");
  for (const [key, id] of COMPARE_FIELDS) if (p.has(key)) $(id).value = p.get(key);
  $("query").value = state.query;
  $("search").value = state.search;
  $("filter").value = state.filter;
}

function writeURL() {
  const p = new URLSearchParams();
  p.set("view", state.view);
  if (state.view === "compare") {
    for (const [key, id] of COMPARE_FIELDS) if ($(id).value.trim()) p.set(key, $(id).value.trim());
  } else {
    p.set("query", state.query);
    p.set("from", state.from);
    p.set("to", state.to);
    for (const k of ["by", "search", "fn", "filter"]) if (state[k]) p.set(k, state[k]);
  }
  if (state.type) p.set("type", state.type);
  history.replaceState(null, "", "?" + p.toString());
}

function selection(extra = {}) {
  const p = new URLSearchParams({ query: state.query, from: state.from, to: state.to });
  if (state.type) p.set("type", state.type);
  for (const [k, v] of Object.entries(extra)) p.set(k, v);
  return p;
}

function unit() {
  return profile ? profile.unit : "count";
}

// --- query matchers --------------------------------------------------------------------------

const MATCHER = /([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')/g;

function matchers(query) {
  return [...query.matchAll(MATCHER)].map((m) => ({
    label: m[1], op: m[2], text: m[0],
    value: m[3].slice(1, -1).replace(/\\(.)/g, "$1"),
  }));
}

// The query with `label`'s matchers replaced by `label="value"` (removed when value is null).
function withMatcher(query, label, value) {
  const rest = matchers(query).filter((m) => m.label !== label).map((m) => m.text);
  if (value !== null) rest.push(`${label}="${value.replace(/\\/g, "\\\\").replace(/"/g, '\\"')}"`);
  return "{" + rest.join(", ") + "}";
}

function equalsValue(label) {
  const m = matchers(state.query).find((m) => m.label === label && m.op === "=");
  return m ? m.value : null;
}

// --- label pickers ---------------------------------------------------------------------------

const PICKER_MAX_VALUES = 200;

async function loadLabels() {
  const range = new URLSearchParams({ from: state.from, to: state.to });
  const { names } = await json("/api/v1/labels?" + range);
  const list = $("label-list");
  const open = new Set([...list.querySelectorAll("details[open]")].map((d) => d.dataset.label));
  list.innerHTML = "";
  const by = $("by");
  by.replaceChildren(new Option("(none)", ""));
  for (const name of names) {
    by.append(new Option(name, name));
    const d = document.createElement("details");
    d.dataset.label = name;
    const s = document.createElement("summary");
    s.textContent = name;
    const sel = document.createElement("span");
    sel.className = "sel";
    s.append(sel);
    const ul = document.createElement("ul");
    d.append(s, ul);
    d.addEventListener("toggle", () => { if (d.open) fillPicker(d); });
    list.append(d);
    if (open.has(name) || name === "node" || equalsValue(name) !== null) d.open = true;
  }
  by.value = state.by;
  markPickers();
}

async function fillPicker(d) {
  const name = d.dataset.label;
  const range = new URLSearchParams({ from: state.from, to: state.to });
  const { values } = await json(`/api/v1/label/${encodeURIComponent(name)}/values?` + range);
  const ul = d.querySelector("ul");
  ul.innerHTML = "";
  const any = document.createElement("li");
  any.textContent = "(any)";
  any.className = "any";
  any.onclick = () => pick(name, null);
  ul.append(any);
  for (const v of values.slice(0, PICKER_MAX_VALUES)) {
    const li = document.createElement("li");
    li.className = "value";
    li.textContent = v;
    li.dataset.value = v;
    li.title = v;
    li.onclick = () => pick(name, equalsValue(name) === v ? null : v);
    ul.append(li);
  }
  if (values.length > PICKER_MAX_VALUES) {
    const li = document.createElement("li");
    li.className = "more";
    li.textContent = `${values.length - PICKER_MAX_VALUES} more: use the query box`;
    ul.append(li);
  }
  markPickers();
}

function markPickers() {
  for (const d of document.querySelectorAll("#label-list details")) {
    const v = equalsValue(d.dataset.label);
    d.querySelector(".sel").textContent = v === null ? "" : `= ${v}`;
    for (const li of d.querySelectorAll("li.value")) li.classList.toggle("on", li.dataset.value === v);
    const any = d.querySelector("li.any");
    if (any) any.classList.toggle("on", v === null);
  }
}

// --- traces ----------------------------------------------------------------------------------

// A W3C trace id (32 hex digits) in `text`, which may be a trace viewer's link.
const TRACE_ID = /(?:^|[^0-9a-fA-F])([0-9a-fA-F]{32})(?![0-9a-fA-F])/;

function traceIn(text) {
  const m = TRACE_ID.exec(text.trim());
  return m ? m[1].toLowerCase() : null;
}

function openTrace() {
  const text = $("trace-open").value;
  const id = traceIn(text);
  if (!id) {
    $("error").textContent = `no trace id (32 hex digits) in "${text.trim()}"`;
    return;
  }
  $("trace-open").value = "";
  pick("trace_id", id);
}

// Traces listed under a flame graph that is not pinned to one, largest first.
const TRACE_LIST_MAX = 5;

// The flame graph of one trace names it, with its permanent link (/trace/ID); any other lists
// the traces with the most samples in it, each a click away from its own.
async function showTrace(seq) {
  const id = equalsValue("trace_id");
  $("trace-info").hidden = id === null;
  const list = $("trace-list");
  list.hidden = true;
  if (id !== null) {
    $("trace-id").textContent = id;
    $("trace-link").href = "/trace/" + encodeURIComponent(id);
    return;
  }
  const { groups, total } = await json("/api/v1/profile?" + selection({ by: "trace_id" }));
  if (seq !== loadSeq) return;
  const traces = groups.filter((g) => g.labels.trace_id)
    .sort((a, b) => b.total - a.total).slice(0, TRACE_LIST_MAX);
  list.replaceChildren("traces:");
  for (const g of traces) {
    const a = document.createElement("a");
    a.href = "#";
    a.className = "trace";
    a.dataset.trace = g.labels.trace_id;
    a.textContent = g.labels.trace_id.slice(0, 8) + "…";
    a.title = `${g.labels.trace_id}: ${(100 * g.total / total).toFixed(1)} % of this view`;
    a.onclick = (e) => { e.preventDefault(); pick("trace_id", g.labels.trace_id); };
    list.append(" ", a);
  }
  list.hidden = traces.length === 0;
}

function pick(label, value) {
  state.query = withMatcher(state.query, label, value);
  $("query").value = state.query;
  markPickers();
  refresh();
}

// --- chart -----------------------------------------------------------------------------------

function rangeText(from, to) {
  const f = (t) => new Date(t * 1000).toLocaleString("en-GB", { dateStyle: "short", timeStyle: "medium" });
  return `${f(from)} – ${f(to)}`;
}

async function loadChart(seq) {
  const p = selection();
  if (state.by) p.set("by", state.by);
  const s = await json("/api/v1/series?" + p);
  if (seq !== loadSeq) return;
  $("range-text").textContent = rangeText(s.from, s.to) + ` (${s.step} s steps)`;
  const data = [s.timestamps, ...s.series.map((x) => x.values)];
  const series = [{}, ...s.series.map((x, i) => ({
    label: x.other ? "(other)" : state.by ? Object.values(x.labels).join(",") || "(none)" : s.type,
    stroke: PALETTE[i % PALETTE.length],
    fill: state.by ? undefined : PALETTE[0] + "22",
    width: 1.5,
    points: { show: false },
  }))];
  const box = $("chart");
  if (chart) chart.destroy();
  chart = new uPlot({
    width: box.clientWidth,
    height: 150,
    series,
    scales: { x: { time: true, range: [s.timestamps[0], s.to + 1] } },
    axes: [{}, { size: 70, values: (u, ticks) => ticks.map((v) => formatValue(v, s.unit)) }],
    cursor: { drag: { x: true, y: false, setScale: false } },
    legend: { show: !!state.by },
    hooks: { setSelect: [(u) => brushed(u)] },
  }, data, box);
  box.dataset.from = s.from;
  box.dataset.unit = s.unit;
  box.dataset.to = s.to;
}

function brushed(u) {
  if (u.select.width < 3) return;
  const from = Math.floor(u.posToVal(u.select.left, "x"));
  const to = Math.ceil(u.posToVal(u.select.left + u.select.width, "x"));
  u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
  if (to <= from) return;
  state.from = String(from);
  state.to = String(to);
  syncRange();
  // The pickers list the labels of the new range; the views follow even if that fails.
  loadLabels().catch(() => {}).finally(refresh);
}

function syncRange() {
  const preset = state.to === "now" && [...$("range").options].some((o) => o.value === state.from);
  $("range").value = preset ? state.from : "custom";
  $("range-back").hidden = preset;
}

// --- profile views ---------------------------------------------------------------------------

let flame, callers, callees, diffFlame;

async function loadProfile(seq) {
  const p = await json("/api/v1/profile?" + selection({ format: "flame" }));
  if (seq !== loadSeq) return;
  profile = p;
  stacks = stacksOf(p);
  tableRows = functionTable(stacks);
  if (!p.stacks.length) $("error").textContent = "nothing matched the query in this time range";
  for (const g of [flame, callers, callees]) g.opts.unit = p.unit;
  flame.setData(treeOf(p));
  applySearch();
  drawTable();
  drawSandwich();
}

function applySearch() {
  const share = flame.search(state.search);
  $("match-share").textContent = share
    ? `${flame.matches} frames match, ${share.pct.toFixed(2)} % of the total (${formatValue(share.matched, unit())})`
    : "";
}

function drawTable() {
  const n = renderTable(document.querySelector("#functions tbody"), tableRows, {
    sort: state.sort, filter: state.filter, total: profile ? profile.total : 0, unit: unit(),
    selected: state.fn, onPick: pickFunction,
  });
  $("table-count").textContent = `${n} of ${tableRows.length} functions` +
    (n > TABLE_MAX_ROWS ? `, the first ${TABLE_MAX_ROWS} shown: filter for the rest` : "");
  for (const th of document.querySelectorAll("#functions th")) {
    th.classList.toggle("sorted", th.dataset.sort === state.sort.key);
    th.classList.toggle("asc", !state.sort.desc);
  }
}

function drawSandwich() {
  if (!state.fn) return;
  const { callers: up, callees: down } = sandwichTrees(stacks, state.fn);
  const total = profile ? profile.total : 0;
  $("sandwich-title").textContent = up.value
    ? `${state.fn}: total ${formatValue(up.value, unit())} (${pct(up.value, total).toFixed(2)} %), ` +
      `self ${formatValue(down.self, unit())} (${pct(down.self, total).toFixed(2)} %)`
    : `${state.fn} is not in this selection`;
  callers.setData(up);
  callees.setData(down);
}

function pickFunction(name) {
  state.fn = name;
  setView("sandwich");
  drawTable();
  drawSandwich();
  writeURL();
}

async function refresh() {
  writeURL();
  if (state.view === "compare") return compare();
  const seq = ++loadSeq;
  $("error").textContent = "";
  $("dl-pprof").href = "/api/v1/profile?" + selection({ format: "pprof" });
  $("dl-folded").href = "/api/v1/profile?" + selection({ format: "folded" });
  const results = await Promise.allSettled([loadChart(seq), loadProfile(seq), showTrace(seq)]);
  const failed = results.find((r) => r.status === "rejected");
  if (failed && seq === loadSeq) $("error").textContent = failed.reason.message;
}

// --- compare ---------------------------------------------------------------------------------

function diffParams(extra) {
  const p = new URLSearchParams();
  for (const [key, id] of COMPARE_FIELDS) {
    const v = $(id).value.trim();
    if (v) p.set(key, v);
  }
  if (state.type) p.set("type", state.type);
  for (const [k, v] of Object.entries(extra)) p.set(k, v);
  return "/api/v1/diff?" + p;
}

// One side's stacks as the flame graph reads them; a blank candidate field takes the baseline's.
function sideProfile(side) {
  const v = (name) => $(`${side}-${name}`).value.trim() || $(`base-${name}`).value.trim();
  const p = new URLSearchParams({ format: "flame", query: v("query"), from: v("from"), to: v("to") });
  if (state.type) p.set("type", state.type);
  return json("/api/v1/profile?" + p);
}

function fillDiffTable(id, rows, d) {
  const incl = d.judged === "inclusive";
  const head = document.querySelector(`#${id} thead`);
  head.innerHTML = "<tr><th>function</th><th>base %</th><th>new %</th><th>Δ pts</th><th>z</th><th>p</th></tr>";
  const tbody = document.querySelector(`#${id} tbody`);
  tbody.innerHTML = "";
  for (const f of rows) {
    const tr = document.createElement("tr");
    if (f.regression) tr.className = "regression";
    const [b, n, dl] = incl ? [f.base_inclusive_pct, f.new_inclusive_pct, f.inclusive_delta_pts]
                            : [f.base_self_pct, f.new_self_pct, f.self_delta_pts];
    for (const v of [f.function, b.toFixed(2), n.toFixed(2), (dl > 0 ? "+" : "") + dl.toFixed(2),
                     f.z.toFixed(1), f.p_value < 1e-4 ? f.p_value.toExponential(1) : f.p_value.toFixed(4)]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
}

async function compare() {
  writeURL();
  // A comparison started later (the form changed meanwhile) owns the view.
  const seq = ++compareSeq;
  $("cmp-error").textContent = "";
  $("cmp-summary").textContent = "";
  for (const id of ["grew", "shrank"]) document.querySelector(`#${id} tbody`).innerHTML = "";
  try {
    const [d, base, cand] = await Promise.all([json(diffParams({ format: "json" })), sideProfile("base"),
      sideProfile("new")]);
    if (seq !== compareSeq) return;
    diffFlame.opts.unit = d.unit;
    diffFlame.setData(diffTree(base, cand), { baseTotal: base.total, newTotal: cand.total });
    const delta = (f) => d.judged === "inclusive" ? f.inclusive_delta_pts : f.self_delta_pts;
    // The API sorts by judged change, largest growth first.
    fillDiffTable("grew", d.functions.filter((f) => delta(f) > 0).slice(0, 15), d);
    fillDiffTable("shrank", d.functions.filter((f) => delta(f) < 0).reverse().slice(0, 15), d);
    let text = `baseline ${d.base.samples} samples, candidate ${d.new.samples}; ${d.judged} shares, ` +
      `red grew, blue shrank.`;
    if (d.fail_above_pts !== null)
      text += d.regressions.length ? ` Regressions: ${d.regressions.join(", ")}.` : " No regression.";
    $("cmp-summary").textContent = text;
  } catch (e) {
    if (seq === compareSeq) $("cmp-error").textContent = e.message;
  }
}

function compareWithEarlier() {
  // "now-1h" as the candidate, "now-2h" to "now-1h" as the baseline; a brushed range against
  // the range of the same length before it.
  const m = state.from.match(/^now-(\d+)([smhd])$/);
  $("base-query").value = state.query;
  $("new-query").value = "";
  if (m && state.to === "now") {
    $("base-from").value = `now-${2 * m[1]}${m[2]}`;
    $("base-to").value = state.from;
    $("new-from").value = state.from;
    $("new-to").value = "now";
  } else if (/^\d+$/.test(state.from) && /^\d+$/.test(state.to)) {
    const [f, t] = [Number(state.from), Number(state.to)];
    $("base-from").value = String(2 * f - t);
    $("base-to").value = String(f);
    $("new-from").value = String(f);
    $("new-to").value = String(t);
  } else return;
  setView("compare");
  compare();
}

// --- wiring ----------------------------------------------------------------------------------

function setView(view) {
  const was = state.view;
  state.view = view;
  for (const v of VIEWS) document.body.classList.toggle(`view-${v}`, v === view);
  for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("on", b.dataset.view === view);
  writeURL();
  // Graphs in panes that were hidden have no width until shown.
  if (view !== was) requestAnimationFrame(() => {
    for (const g of [flame, callers, callees, diffFlame]) g.render();
    if (chart && was === "compare") chart.setSize({ width: $("chart").clientWidth, height: 150 });
  });
}

async function loadTypes() {
  const { types } = await json("/api/v1/types");
  const sel = $("type");
  sel.innerHTML = "";
  for (const t of types) sel.append(new Option(`${t.name} (${t.unit})`, t.name));
  if (!types.some((t) => t.name === state.type))
    state.type = types.some((t) => t.name === "samples") ? "samples" : types.length ? types[0].name : "";
  sel.value = state.type;
}

function wire() {
  flame = new FlameGraph($("flame"), {});
  callers = new FlameGraph($("callers"), { inverted: true });
  callees = new FlameGraph($("callees"), {});
  diffFlame = new FlameGraph($("diff-flame"), {});
  legend($("legend"), false);
  legend($("diff-legend"), true);
  for (const b of document.querySelectorAll("#tabs button")) {
    b.onclick = () => {
      const from = state.view;
      setView(b.dataset.view);
      if ((from === "compare") !== (b.dataset.view === "compare")) refresh();
    };
  }
  const show = () => { state.query = $("query").value.trim() || "{}"; markPickers(); refresh(); };
  $("show").onclick = show;
  $("query").addEventListener("keydown", (e) => { if (e.key === "Enter") show(); });
  $("trace-open").addEventListener("keydown", (e) => { if (e.key === "Enter") openTrace(); });
  $("range").onchange = () => {
    if ($("range").value === "custom") return;
    state.from = $("range").value;
    state.to = "now";
    syncRange();
    loadLabels().then(refresh);
  };
  $("range-back").onclick = () => { $("range").value = "now-1h"; $("range").onchange(); };
  $("type").onchange = () => { state.type = $("type").value; refresh(); };
  $("by").onchange = () => {
    state.by = $("by").value;
    writeURL();
    loadChart(loadSeq).catch((e) => { $("error").textContent = e.message; });
  };
  $("search").addEventListener("input", () => { state.search = $("search").value; applySearch(); writeURL(); });
  $("filter").addEventListener("input", () => { state.filter = $("filter").value; drawTable(); writeURL(); });
  for (const th of document.querySelectorAll("#functions th")) {
    th.onclick = () => {
      const key = th.dataset.sort;
      state.sort = { key, desc: state.sort.key === key ? !state.sort.desc : key !== "name" };
      drawTable();
    };
  }
  $("vs-earlier").onclick = compareWithEarlier;
  download($("dl-pprof"), "profile.pb.gz");
  download($("dl-folded"), "profile.folded");
  $("cmp-run").onclick = compare;
  for (const [, id] of COMPARE_FIELDS)
    $(id).addEventListener("keydown", (e) => { if (e.key === "Enter") compare(); });
  new ResizeObserver(() => { if (chart) chart.setSize({ width: $("chart").clientWidth, height: 150 }); })
    .observe($("chart"));
}

async function start() {
  wire();
  readURL();
  syncRange();
  setView(state.view);
  try {
    await Promise.all([loadTypes(), loadLabels()]);
  } catch (e) {
    $("error").textContent = e.message;
    return;
  }
  await refresh();
}

start();
