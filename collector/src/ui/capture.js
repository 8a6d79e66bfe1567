"use strict";
// The "Capture…" panel: asks the collector for an on-demand capture (or a dump) of a process
// on a node (POST /api/v1/captures), follows it, and shows its flame graph with downloads.
// Node and pid come from the query's `node="…"` and `pid="…"` matchers when it has them; a
// query that picks processes by another label (a Ray job, task or actor from the label
// picker) and names no pid becomes the request's label query, which the collector resolves
// to the nodes and processes its agents pushed recently (one request per node); their flame
// graphs are drawn as one, each node's under its name (the downloads are the first node's;
// the status line names every request). A capture with the GIL view shows each node's GIL
// table below its flame graph.

let capFlame = null;

async function send(url, body) {
  for (;;) {
    const r = await fetch(url, {
      method: "POST",
      headers: { ...authHeaders(), "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (r.status !== 401) {
      const answer = await r.json();
      if (!r.ok) throw new Error(answer.error || r.statusText);
      return answer;
    }
    sessionStorage.removeItem(TOKEN_KEY);
    await signIn("A token with the capture role is needed.");
  }
}

function capStatus(text, failed = false) {
  $("cap-status").textContent = text;
  $("cap-status").className = failed ? "failed" : "";
}

async function openCapture() {
  $("capture").hidden = false;
  capStatus("");
  try {
    const list = await json("/api/v1/captures");
    const select = $("cap-node");
    select.textContent = "";
    for (const n of list.nodes) select.add(new Option(n, n));
    const node = equalsValue("node");
    if (node !== null) {
      if (![...select.options].some((o) => o.value === node)) select.add(new Option(node, node));
      select.value = node;
    }
    if (!list.nodes.length && node === null) capStatus("no agent polls this collector for requests", true);
  } catch (e) {
    capStatus(e.message, true);
  }
  const pid = equalsValue("pid");
  if (pid !== null) $("cap-pid").value = pid;
  const picked = matchers(state.query).filter((m) => m.label !== "node" && m.label !== "pid");
  $("cap-query").value = pid === null && picked.length ? state.query.trim() : "";
  capFields();
}

// A label query stands in for node and pid: they are greyed out while it is there.
function capFields() {
  const byLabels = $("cap-query").value.trim() !== "";
  $("cap-node").disabled = $("cap-pid").disabled = byLabels;
}

function capRequest(kind) {
  const query = $("cap-query").value.trim();
  const common = {
    kind,
    duration_s: Number($("cap-duration").value) || 5,
    frequency_hz: Number($("cap-hz").value) || 99,
    gil: $("cap-gil").checked,
    off_cpu: $("cap-offcpu").checked,
  };
  // A dump's native frames too (the agent stops no thread to read them).
  if (kind === "dump") common.native = $("cap-native").checked;
  if (query) return { ...common, query };
  const pid = Number($("cap-pid").value.trim());
  if (!Number.isInteger(pid) || pid <= 0) throw new Error("give the pid of a process on the node");
  return { ...common, node: $("cap-node").value, pid };
}

// Follows request `id` until it ends; its last state.
async function follow(id, started) {
  for (;;) {
    const c = await json(`/api/v1/captures/${encodeURIComponent(id)}?wait=1`);
    if (c.state === "done" || c.state === "failed") return c;
    const s = ((Date.now() - started) / 1000).toFixed(0);
    capStatus(`${c.state} on ${c.node}: ${s} s of ${(c.duration_ms / 1000).toFixed(0)} s`);
  }
}

async function runCapture(kind) {
  $("cap-result").hidden = true;
  $("cap-dump-text").hidden = true;
  // A dump has no flame graph: its text takes the place.
  $("cap-flame").hidden = kind === "dump";
  if (capFlame) capFlame.setData(newNode("all", null, "root"));
  $("cap-start").disabled = $("cap-dump").disabled = true;
  try {
    const made = await send("/api/v1/captures", capRequest(kind));
    capStatus(`${made.state} on ${made.node}`);
    // A label query makes one request per node: each is followed; the first that worked
    // is drawn, the others are listed with their downloads.
    const ids = made.members && made.members.length ? made.members : [made.id];
    const started = Date.now();
    const ended = [];
    for (const id of ids) ended.push(await follow(id, started));
    const done = ended.filter((e) => e.state === "done");
    if (!done.length) {
      capStatus(ended.map((e) => e.reason).join("; "), true);
      return;
    }
    const c = done[0];
    const failures = ended.filter((e) => e.state !== "done").map((e) => e.reason);
    const also = failures.length ? `; ${failures.join("; ")}` : "";
    if (kind === "dump") {
      capStatus(`dump of ${done.map((d) => `${d.pids.join(", ")} on ${d.node}`).join("; ")}`);
      $("cap-dump-text").textContent = done
        .map((d) => (done.length > 1 ? `Node ${d.node}\n\n` : "") + dumpText(JSON.parse(d.text || "[]")))
        .join("\n");
      $("cap-dump-text").hidden = false;
      return;
    }
    const secs = ((c.ended_unix_ns - c.started_unix_ns) / 1e9).toFixed(1);
    if (done.length === 1) {
      const who = c.query ? ` (${c.query}: pid ${c.pids.join(", ")})` : "";
      capStatus(`done: ${c.samples} samples in ${secs} s on ${c.node}${who}${also}`);
    } else {
      // One request per node: their flame graphs are drawn as one, a node's under its name.
      const total = done.reduce((n, d) => n + d.samples, 0);
      const each = done.map((d) => `${d.node}: ${d.samples}, pid ${d.pids.join(", ")} (${d.id})`);
      capStatus(`done: ${total} samples in ${secs} s on ${done.length} nodes (${c.query}: ${each.join("; ")})${also}`);
    }
    const base = `/api/v1/captures/${encodeURIComponent(c.id)}/result`;
    $("cap-dl-pprof").href = base + "?format=pprof";
    $("cap-dl-trace").href = base + "?format=chrome";
    download($("cap-dl-pprof"), `capture-${c.id}.pb.gz`);
    download($("cap-dl-trace"), `capture-${c.id}.trace.json`);
    $("cap-result").hidden = false;
    const root = newNode("all", null, "root");
    for (const d of done) {
      const p = await json(`/api/v1/captures/${encodeURIComponent(d.id)}/result?format=flame`);
      capFlame.opts.unit = p.unit;
      const under = done.length > 1 ? childOf(root, d.node, true) : root;
      treeOf(p, {}, under);
      if (under !== root) root.value += under.value;
    }
    capFlame.setData(root);
    // With the GIL view: each node's GIL table, as `pyrometer capture --gil` prints it.
    const tables = done.filter((d) => d.text);
    if (tables.length) {
      $("cap-dump-text").textContent = tables
        .map((d) => (done.length > 1 ? `Node ${d.node}\n\n` : "") + d.text)
        .join("\n");
      $("cap-dump-text").hidden = false;
    }
  } catch (e) {
    capStatus(e.message, true);
  } finally {
    $("cap-start").disabled = $("cap-dump").disabled = false;
  }
}

// One frame of a dump: a native one without a line shows its module, or its name alone.
function frameText(f) {
  if (!f.function) return "<unreadable frame: changed while read>";
  if (f.native && f.line == null) return f.file ? `${f.function} (${f.file})` : f.function;
  return `${f.function} (${f.file || "?"}:${f.line ?? "?"})`;
}

// A dump as `pyrometer dump` prints it.
function dumpText(dumps) {
  const out = [];
  for (const d of dumps) {
    out.push(`Process ${d.pid}: ${d.command || "?"}`, `Python v${d.version} (${d.binary})`, "");
    for (const t of d.threads) {
      const name = t.python_name || t.name || "";
      const gil = t.holds_gil ? ", holds GIL" : "";
      out.push(`Thread ${t.tid ?? t.thread_id} (${t.state.replace(/_/g, " ")}${gil}): "${name}"`);
      if (!t.frames.length) out.push("    (no Python frames)");
      for (const f of t.frames) out.push(`    ${frameText(f)}`);
      if (t.native_error) out.push(`    (native frames unavailable: ${t.native_error})`);
      if (t.truncated) out.push("    ... (stack cut: too deep, looping or unreadable)");
      out.push("");
    }
  }
  return out.join("\n");
}

function wireCapture() {
  capFlame = new FlameGraph($("cap-flame"), {});
  $("capture-open").onclick = openCapture;
  $("cap-close").onclick = () => { $("capture").hidden = true; };
  $("cap-query").oninput = capFields;
  $("cap-start").onclick = () => runCapture("capture");
  $("cap-dump").onclick = () => runCapture("dump");
}

wireCapture();
