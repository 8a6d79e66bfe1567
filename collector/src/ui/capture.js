"use strict";
// The "Capture…" panel: asks the collector for an on-demand capture (or a dump) of a process
// on a node (POST /api/v1/captures), follows it, and shows its flame graph with downloads.
// Node and pid come from the query's `node="…"` and `pid="…"` matchers when it has them.

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
}

function capRequest(kind) {
  const pid = Number($("cap-pid").value.trim());
  if (!Number.isInteger(pid) || pid <= 0) throw new Error("give the pid of a process on the node");
  return {
    kind,
    node: $("cap-node").value,
    pid,
    duration_s: Number($("cap-duration").value) || 5,
    frequency_hz: Number($("cap-hz").value) || 99,
    off_cpu: $("cap-offcpu").checked,
  };
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
  if (capFlame) capFlame.setData(newNode("all", null, "root"));
  $("cap-start").disabled = $("cap-dump").disabled = true;
  try {
    const made = await send("/api/v1/captures", capRequest(kind));
    capStatus(`${made.state} on ${made.node}`);
    const c = await follow(made.id, Date.now());
    if (c.state === "failed") {
      capStatus(c.reason, true);
      return;
    }
    if (kind === "dump") {
      capStatus(`dump of ${c.pids.join(", ")} on ${c.node}`);
      $("cap-dump-text").textContent = dumpText(JSON.parse(c.text || "[]"));
      $("cap-dump-text").hidden = false;
      return;
    }
    const secs = ((c.ended_unix_ns - c.started_unix_ns) / 1e9).toFixed(1);
    capStatus(`done: ${c.samples} samples in ${secs} s on ${c.node}`);
    const base = `/api/v1/captures/${encodeURIComponent(c.id)}/result`;
    $("cap-dl-pprof").href = base + "?format=pprof";
    $("cap-dl-trace").href = base + "?format=chrome";
    download($("cap-dl-pprof"), `capture-${c.id}.pb.gz`);
    download($("cap-dl-trace"), `capture-${c.id}.trace.json`);
    $("cap-result").hidden = false;
    const p = await json(base + "?format=flame");
    capFlame.opts.unit = p.unit;
    capFlame.setData(treeOf(p));
  } catch (e) {
    capStatus(e.message, true);
  } finally {
    $("cap-start").disabled = $("cap-dump").disabled = false;
  }
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
      for (const f of t.frames) out.push(`    ${f.function || "?"} (${f.file || "?"}:${f.line ?? "?"})`);
      out.push("");
    }
  }
  return out.join("\n");
}

function wireCapture() {
  capFlame = new FlameGraph($("cap-flame"), {});
  $("capture-open").onclick = openCapture;
  $("cap-close").onclick = () => { $("capture").hidden = true; };
  $("cap-start").onclick = () => runCapture("capture");
  $("cap-dump").onclick = () => runCapture("dump");
}

wireCapture();
