// The flame graph component: a tree of frames drawn as absolutely positioned boxes with a
// fixed row height, root at the top (or at the bottom when inverted), inside a viewport that
// scrolls vertically, so a 250-frame stack makes the graph taller and never narrower. Widths
// are the frame's share of the zoomed frame; frames under half a pixel are not drawn.
"use strict";

const FLAME_ROW = 18;
const FLAME_MIN_PX = 0.5;
// Boxes drawn at most per render; beyond it the narrowest are left out (and counted).
const FLAME_MAX_BOXES = 20000;

// Frame kinds by name: the agent writes Python frames as `function (file.py:line)` and kernel
// frames with a `_[k]` suffix; the process (comm) root is its own kind.
function frameKind(name, isProcess) {
  if (isProcess) return "process";
  if (name.endsWith("_[k]")) return "kernel";
  if (/ \([^()]*\.pyx?(:\d+)?\)$/.test(name) || /^<[a-z]+> \(/.test(name)) return "python";
  return "native";
}

const KIND_HUES = { python: [200, 60], native: [28, 85], kernel: [355, 60], process: [270, 12] };

function hash(s) {
  let h = 2166136261;
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 16777619);
  return (h >>> 0) / 4294967295;
}

function kindColour(kind, name) {
  const [hue, sat] = KIND_HUES[kind] || KIND_HUES.native;
  const v = hash(name);
  return `hsl(${hue + Math.round(v * 16 - 8)}, ${sat}%, ${62 + Math.round(v * 14)}%)`;
}

// Red for a share that grew, blue for one that shrank, saturated at 10 points.
function diffColour(deltaPts) {
  const t = Math.min(1, Math.abs(deltaPts) / 10);
  if (Math.abs(deltaPts) < 0.05) return "hsl(0, 0%, 85%)";
  const hue = deltaPts > 0 ? 0 : 220;
  return `hsl(${hue}, ${Math.round(40 + 50 * t)}%, ${Math.round(88 - 30 * t)}%)`;
}

function newNode(name, parent, kind) {
  return { name, kind, value: 0, self: 0, base: 0, baseSelf: 0, children: new Map(), parent };
}

function childOf(node, name, isProcess) {
  let c = node.children.get(name);
  if (!c) {
    c = newNode(name, node, frameKind(name, isProcess));
    node.children.set(name, c);
  }
  return c;
}

// Adds one stack (root first) with `value` to the tree; `field` is "value" or "base";
// `processAt` is the index of the frame that is the process (comm), -1 if none.
function addStack(root, frames, value, field, processAt) {
  const selfField = field === "value" ? "self" : "baseSelf";
  let node = root;
  node[field] += value;
  frames.forEach((name, i) => {
    node = childOf(node, name, i === processAt);
    node[field] += value;
  });
  node[selfField] += value;
}

// The tree of a `format=flame` answer; with `process` the comm label roots each stack.
function treeOf(profile, { process = true } = {}, root = newNode("all", null, "root"), field = "value") {
  const names = profile.names;
  const selfField = field === "value" ? "self" : "baseSelf";
  for (const row of profile.stacks) {
    const value = row[0];
    let node = root;
    node[field] += value;
    if (process && row[1] >= 0) {
      node = childOf(node, names[row[1]], true);
      node[field] += value;
    }
    for (let i = 2; i < row.length; i++) {
      node = childOf(node, names[row[i]], false);
      node[field] += value;
    }
    node[selfField] += value;
  }
  return root;
}

// Stacks of a `format=flame` answer as arrays of names (no process root) with values.
function stacksOf(profile) {
  return profile.stacks.map((row) => ({
    value: row[0],
    process: row[1] >= 0 ? profile.names[row[1]] : null,
    frames: row.slice(2).map((i) => profile.names[i]),
  }));
}

function formatValue(v, unit) {
  if (unit === "nanoseconds") {
    const s = Math.abs(v) / 1e9;
    if (s >= 1) return `${(v / 1e9).toFixed(2)} s`;
    if (s >= 1e-3) return `${(v / 1e6).toFixed(1)} ms`;
    return s >= 1e-6 ? `${(v / 1e3).toFixed(1)} µs` : `${v} ns`;
  }
  if (unit === "bytes") {
    const k = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0, x = v;
    while (Math.abs(x) >= 1024 && i < k.length - 1) { x /= 1024; i++; }
    return `${i ? x.toFixed(1) : x} ${k[i]}`;
  }
  return v.toLocaleString("en-US");
}

function pct(part, whole) {
  return whole > 0 ? (100 * part) / whole : 0;
}

class FlameGraph {
  // opts: { inverted, height (css), unit, onSelect(node), crumbs (element) }
  constructor(el, opts = {}) {
    this.el = el;
    this.opts = opts;
    this.root = null;
    this.focus = null;
    this.searchRe = null;
    el.classList.add("fg");
    el.innerHTML = "";
    this.crumbs = document.createElement("div");
    this.crumbs.className = "fg-crumbs";
    this.status = document.createElement("span");
    this.status.className = "fg-status";
    this.viewport = document.createElement("div");
    this.viewport.className = "fg-viewport";
    if (opts.height) this.viewport.style.height = opts.height;
    this.canvas = document.createElement("div");
    this.canvas.className = "fg-canvas";
    this.viewport.appendChild(this.canvas);
    const head = document.createElement("div");
    head.className = "fg-head";
    head.append(this.crumbs, this.status);
    el.append(head, this.viewport);
    this.tip = document.getElementById("tooltip");
    this.canvas.addEventListener("click", (e) => {
      const node = this.nodeAt(e.target);
      if (node) this.zoom(node);
    });
    this.canvas.addEventListener("mousemove", (e) => this.showTip(e));
    this.canvas.addEventListener("mouseleave", () => { this.tip.hidden = true; });
    new ResizeObserver(() => this.render()).observe(this.viewport);
  }

  // A diff tree carries `base` values and side totals: { baseTotal, newTotal }.
  setData(root, diff = null) {
    this.root = root;
    this.diff = diff;
    this.focus = root;
    this.render();
  }

  nodeAt(target) {
    const box = target.closest(".frame");
    return box ? box._node : null;
  }

  // Width basis: a frame's value, or in a diff the mean of its two normalized shares, so a
  // function that vanished from the candidate is still drawn.
  weight(node) {
    if (!this.diff) return node.value;
    return pct(node.base, this.diff.baseTotal) + pct(node.value, this.diff.newTotal);
  }

  deltaPts(node) {
    return pct(node.value, this.diff.newTotal) - pct(node.base, this.diff.baseTotal);
  }

  zoom(node) {
    this.focus = node;
    this.render();
    if (this.opts.onZoom) this.opts.onZoom(node);
  }

  zoomPath() {
    const path = [];
    for (let n = this.focus; n && n.parent; n = n.parent) path.unshift(n.name);
    return path;
  }

  zoomTo(path) {
    let n = this.root;
    for (const name of path) {
      const c = n && n.children.get(name);
      if (!c) break;
      n = c;
    }
    this.zoom(n);
  }

  search(text) {
    this.searchRe = null;
    if (text) {
      try { this.searchRe = new RegExp(text, "i"); } catch { this.searchRe = new RegExp(text.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"), "i"); }
    }
    this.render();
    return this.matchShare();
  }

  // The share of the root's value under frames that match the search, counting a stack once
  // even when several of its frames match.
  matchShare() {
    if (!this.searchRe || !this.root) return null;
    let matched = 0;
    const walk = (n) => {
      if (n.kind !== "root" && this.searchRe.test(n.name)) { matched += n.value; return; }
      for (const c of n.children.values()) walk(c);
    };
    walk(this.root);
    return { matched, total: this.root.value, pct: pct(matched, this.root.value) };
  }

  renderCrumbs() {
    this.crumbs.innerHTML = "";
    const chain = [];
    for (let n = this.focus; n; n = n.parent) chain.unshift(n);
    chain.forEach((n, i) => {
      const a = document.createElement("button");
      a.className = "crumb";
      a.textContent = n.name;
      a.title = n.name;
      a.onclick = () => this.zoom(n);
      if (i) this.crumbs.append(" › ");
      this.crumbs.append(a);
    });
  }

  render() {
    if (!this.root) return;
    // The frame under the pointer is gone or moved: a tooltip would describe the old one.
    this.tip.hidden = true;
    this.renderCrumbs();
    const width = this.viewport.clientWidth;
    const boxes = [];
    let dropped = 0;
    let depthMax = 0;
    // Ancestors of the focus span the width, greyed: the path back out.
    const ancestors = [];
    for (let n = this.focus.parent; n; n = n.parent) ancestors.unshift(n);
    ancestors.forEach((n, d) => boxes.push([n, d, 0, width, true]));
    const focusWeight = this.weight(this.focus) || 1;
    const stack = [[this.focus, ancestors.length, 0]];
    while (stack.length) {
      const [n, depth, x] = stack.pop();
      const w = (this.weight(n) / focusWeight) * width;
      if (w < FLAME_MIN_PX) { dropped++; continue; }
      if (boxes.length >= FLAME_MAX_BOXES) { dropped++; continue; }
      boxes.push([n, depth, x, w, false]);
      depthMax = Math.max(depthMax, depth);
      let cx = x;
      for (const c of [...n.children.values()].sort((a, b) => (a.name < b.name ? -1 : 1))) {
        stack.push([c, depth + 1, cx]);
        cx += (this.weight(c) / focusWeight) * width;
      }
    }
    const rows = depthMax + 1;
    this.canvas.style.height = `${rows * FLAME_ROW}px`;
    const frag = document.createDocumentFragment();
    let matches = 0;
    for (const [n, depth, x, w, context] of boxes) {
      const b = document.createElement("div");
      b.className = "frame";
      if (context) b.classList.add("context");
      b._node = n;
      b.dataset.name = n.name;
      b.dataset.kind = n.kind;
      const row = this.opts.inverted ? rows - 1 - depth : depth;
      b.style.cssText = `left:${x}px;width:${w}px;top:${row * FLAME_ROW}px;height:${FLAME_ROW - 1}px;` +
        `background:${this.diff ? diffColour(this.deltaPts(n)) : n.kind === "root" ? "#ddd" : kindColour(n.kind, n.name)}`;
      if (this.searchRe && n.kind !== "root" && this.searchRe.test(n.name)) {
        b.classList.add("match");
        matches++;
      }
      if (w > 24) b.textContent = n.name;
      frag.appendChild(b);
    }
    if (this.searchRe) this.canvas.classList.add("searching"); else this.canvas.classList.remove("searching");
    this.canvas.replaceChildren(frag);
    const total = this.root.value;
    let text = this.diff ? "" : `${formatValue(total, this.opts.unit)} total`;
    if (dropped) text += `${text ? ", " : ""}${dropped} frames too narrow to draw`;
    this.status.textContent = text;
    this.matches = matches;
  }

  showTip(e) {
    const node = this.nodeAt(e.target);
    if (!node) { this.tip.hidden = true; return; }
    const unit = this.opts.unit;
    const root = this.root;
    const lines = [[node.name, ""]];
    if (this.diff) {
      const b = pct(node.base, this.diff.baseTotal), n = pct(node.value, this.diff.newTotal);
      const d = n - b;
      lines.push(["baseline", `${b.toFixed(2)} % (${formatValue(node.base, unit)})`]);
      lines.push(["candidate", `${n.toFixed(2)} % (${formatValue(node.value, unit)})`]);
      lines.push(["change", `${d > 0 ? "+" : ""}${d.toFixed(2)} pts`]);
    } else {
      lines.push(["total", `${formatValue(node.value, unit)} (${pct(node.value, root.value).toFixed(2)} %)`]);
      lines.push(["self", `${formatValue(node.self, unit)} (${pct(node.self, root.value).toFixed(2)} %)`]);
      if (this.focus !== root)
        lines.push(["of zoomed", `${pct(node.value, this.focus.value).toFixed(2)} %`]);
    }
    lines.push(["kind", node.kind]);
    this.tip.replaceChildren(...lines.map(([k, v], i) => {
      const d = document.createElement("div");
      if (i === 0) { d.className = "tip-name"; d.textContent = k; }
      else { const b = document.createElement("b"); b.textContent = k + " "; d.append(b, v); }
      return d;
    }));
    this.tip.hidden = false;
    const x = Math.min(e.clientX + 14, window.innerWidth - this.tip.offsetWidth - 4);
    const y = e.clientY + 16 + this.tip.offsetHeight > window.innerHeight ? e.clientY - this.tip.offsetHeight - 8 : e.clientY + 16;
    this.tip.style.left = `${x}px`;
    this.tip.style.top = `${y}px`;
  }
}

// A legend of the frame kinds (or of the diff colours).
function legend(el, diff) {
  el.innerHTML = "";
  const items = diff
    ? [["grew", diffColour(10)], ["unchanged", diffColour(0)], ["shrank", diffColour(-10)]]
    : [["Python", kindColour("python", "x")], ["native", kindColour("native", "x")],
       ["kernel", kindColour("kernel", "x")], ["process", kindColour("process", "x")]];
  for (const [name, colour] of items) {
    const s = document.createElement("span");
    s.className = "swatch";
    const c = document.createElement("i");
    c.style.background = colour;
    s.append(c, name);
    el.append(s);
  }
}
