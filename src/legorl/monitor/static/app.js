// legorl dashboard pages. Each page fetches its JSON from /api/... and redraws on a timer (live runs).
"use strict";
const {render: drawChart, fmt, esc} = Charts;
const app = document.getElementById("app");
const page = document.body.dataset.page;
const REFRESH_MS = 5000;

async function api(path) {
  const r = await fetch(path, {headers: {Accept: "application/json"}});
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status} ${await r.text()}`);
  return r.json();
}

function h(html) { const t = document.createElement("template"); t.innerHTML = html.trim(); return t.content.firstElementChild; }
const pct = v => (v === null || v === undefined) ? "–" : (100 * v).toFixed(1) + "%";
const short = (s, n) => { s = String(s ?? ""); return s.length > n ? s.slice(0, n - 1) + "…" : s; };
const outcomePill = o => o ? `<span class="pill" data-outcome="${esc(o)}" style="background:${Charts.color(o, 0)}">${esc(o)}</span>` : `<span class="pill">pending</span>`;
const rolloutLink = (id, text) => `<a class="rollout-link" href="/rollout/${encodeURIComponent(id)}">${esc(text ?? id)}</a>`;

function live(fn, ms = REFRESH_MS) {
  const dot = document.getElementById("live");
  const tick = async () => {
    if (document.hidden) return;
    try { await fn(); dot.classList.remove("stale"); } catch (e) { dot.classList.add("stale"); console.error(e); }
  };
  tick();
  return setInterval(tick, ms);
}

function chartsGrid(specs, grid) {
  if (!grid) { grid = h('<div class="grid-charts"></div>'); }
  const boxes = new Map([...grid.children].map(c => [c.dataset.chart, c]));
  for (const spec of specs) {
    let box = boxes.get(spec.id);
    if (!box) { box = h(`<div class="chart" id="chart-${spec.id}"></div>`); grid.appendChild(box); }
    drawChart(box, spec);
  }
  grid._specs = specs;
  return grid;
}
let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => document.querySelectorAll(".grid-charts").forEach(g => g._specs && chartsGrid(g._specs, g)), 150);
});

// ---- alarms banner (every page) ----------------------------------------------------------------------
async function alarmBanner() {
  const a = await api("/api/alarms");
  const banner = document.getElementById("alarm-banner"), badge = document.getElementById("alarm-count");
  badge.hidden = !a.active.length;
  badge.textContent = a.active.length;
  banner.hidden = !a.active.length || page === "alarms";
  banner.innerHTML = a.active.map(x => `<div>⚠ <b>${esc(x.name)}</b> at step ${x.step}: ${esc(x.message)} <a href="/alarms">details</a></div>`).join("");
}
live(alarmBanner, 10000);

// ---- overview ------------------------------------------------------------------------------------------
const duration = s => s === null || s === undefined ? "–" : s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
async function phaseBanner(box) {
  const p = await api("/api/progress");
  if (!p.phase) { box.hidden = true; return; }
  box.hidden = false;
  const steps = (p.planned || []).map(n => `<span class="phase-step${n === p.phase ? " current" : p.phase_times_s[n] !== undefined ? " done" : ""}">${esc(n.replaceAll("_", " "))}${p.phase_times_s[n] !== undefined && n !== p.phase ? " · " + duration(p.phase_times_s[n]) : ""}</span>`).join(" → ");
  const bar = p.share === null || p.share === undefined ? "" : `<progress max="1" value="${p.share}"></progress> ${pct(p.share)}`;
  box.innerHTML = `<div><b id="phase-label">${esc(p.label)}</b> ${bar}</div>
    <div class="muted">${p.phase === "done" ? "phases took " + duration(Object.values(p.phase_times_s).reduce((a, b) => a + b, 0)) : `in this phase ${duration(p.phase_elapsed_s)} · time left ${p.time_left_s === null ? "not estimated yet" : "about " + duration(p.time_left_s)}`}</div>
    <div class="phases">${steps}</div>`;
}
async function overview() {
  const grid = h('<div class="grid-charts"></div>');
  const stats = h('<div class="stats"></div>');
  const fails = h('<div></div>');
  const phase = h('<div class="phase" id="phase" hidden></div>');
  const config = h('<details id="config"><summary>Resolved config</summary><pre class="mono"></pre></details>');
  app.innerHTML = "<h1>Overview</h1>";
  app.append(phase, stats, grid, fails, config);
  config.addEventListener("toggle", async () => {
    if (config.open && !config.dataset.loaded) {
      config.querySelector("pre").textContent = JSON.stringify(await api("/api/config"), null, 2);
      config.dataset.loaded = "1";
    }
  });
  live(() => phaseBanner(phase));
  live(async () => {
    const d = await api("/api/overview");
    const r = d.run, last = r.last || {};
    const cells = [["steps", r.steps], ["rollouts", r.rollouts], ["model calls", r.calls],
      ["resolved", r.outcomes.resolved || 0], ["reward (last)", fmt(last["reward/mean"])],
      ["pass rate (last)", pct(last["pass_rate"])], ["logprob Pearson (last)", fmt(last["train/logprob_pearson"])],
      ["k3 KL (last)", fmt(last["train/mismatch_k3_kl"])], ["step time (last)", last["time/step_s"] ? fmt(last["time/step_s"]) + " s" : "–"]];
    stats.innerHTML = cells.map(([k, v]) => `<div class="stat"><div class="k">${k}</div><div class="v">${v}</div></div>`).join("");
    chartsGrid(d.charts, grid);
    fails.innerHTML = `<h2>Latest failed rollouts</h2>` + (d.recent_failures.length ? `<table id="recent-failures"><tr><th>step</th><th>rollout</th><th>task</th><th>split</th><th>outcome</th><th>reason</th></tr>` +
      d.recent_failures.map(f => `<tr><td class="num">${f.step}</td><td class="mono">${rolloutLink(f.id)}</td><td class="mono">${esc(f.task_id)}</td><td>${esc(f.split)}</td><td>${outcomePill(f.outcome)}</td><td>${esc(short(f.outcome_reason, 140))}</td></tr>`).join("") + "</table>"
      : `<p class="muted">no failed rollout yet</p>`);
  });
}

// ---- rollouts table --------------------------------------------------------------------------------------
const FILTERS = ["step", "task", "harness", "outcome", "split", "reward_min", "reward_max", "masked"];
async function rollouts() {
  const q = new URLSearchParams(location.search);
  const state = {sort: q.get("sort") || "step", order: q.get("order") || "desc", page: +(q.get("page") || 1), per_page: +(q.get("per_page") || 50)};
  for (const f of FILTERS) state[f] = q.get(f) || "";
  app.innerHTML = `<h1>Rollouts</h1>
  <form class="filters" id="filters">
    <label>step<input name="step" type="number" value="${esc(state.step)}"></label>
    <label>task<input name="task" placeholder="id or part of it" value="${esc(state.task)}"></label>
    <label>harness<select name="harness"></select></label>
    <label>outcome<select name="outcome"></select></label>
    <label>split<select name="split"></select></label>
    <label>reward ≥<input name="reward_min" type="number" step="any" value="${esc(state.reward_min)}"></label>
    <label>reward ≤<input name="reward_max" type="number" step="any" value="${esc(state.reward_max)}"></label>
    <label>reward<select name="masked"><option value="">any</option><option value="0">rewarded</option><option value="1">masked (no reward)</option></select></label>
    <button class="primary" type="submit">Filter</button><button type="button" id="clear">Clear</button>
  </form>
  <div class="pager" id="pager-top"></div><div id="table"></div><div class="pager" id="pager"></div>`;
  const form = document.getElementById("filters");
  form.masked.value = state.masked;
  let facetsDone = false;
  const setOptions = (sel, values, extra) => {
    const cur = state[sel.name];
    sel.innerHTML = `<option value="">any</option>` + (extra || []).map(([v, t]) => `<option value="${v}">${t}</option>`).join("") +
      values.map(v => `<option value="${esc(v)}">${esc(v)}</option>`).join("");
    if (cur && ![...sel.options].some(o => o.value === cur)) sel.appendChild(h(`<option value="${esc(cur)}">${esc(cur)}</option>`));
    sel.value = cur;
  };
  const cols = [["step", "step"], ["id", "rollout"], ["task", "task"], [null, "sample"], ["harness", "harness"], ["split", "split"],
    ["outcome", "outcome"], ["reward", "reward"], [null, "turns"], [null, "tokens"], [null, "weights"], [null, "time (s)"], [null, "reason"]];
  async function load() {
    const params = new URLSearchParams();
    for (const [k, v] of Object.entries(state)) if (v !== "" && v !== null) params.set(k, v);
    history.replaceState(null, "", "/rollouts?" + params.toString());
    const d = await api("/api/rollouts?" + params.toString());
    if (!facetsDone) {
      setOptions(form.harness, d.facets.harness);
      setOptions(form.outcome, d.facets.outcome, [["failed", "any failure"]]);
      setOptions(form.split, d.facets.split);
      facetsDone = true;
    }
    const head = cols.map(([key, label]) => key ? `<th class="sortable ${state.sort === key ? "sorted " + state.order : ""}" data-sort="${key}">${label}</th>` : `<th>${label}</th>`).join("");
    const body = d.rows.map(r => `<tr data-id="${esc(r.id)}"><td class="num">${r.step}</td><td class="mono nowrap" title="${esc(r.id)}">${rolloutLink(r.id, short(r.id, 34))}</td>
      <td class="mono nowrap" title="${esc(r.task_id)}">${esc(short(r.task_id, 36))}</td><td class="num" title="group ${esc(r.group_id)}">${r.sample_index}</td><td class="nowrap">${esc(r.harness)}</td><td class="nowrap">${esc(r.split)}</td>
      <td>${outcomePill(r.outcome)}</td><td class="num">${r.reward === null ? '<span class="muted">masked</span>' : fmt(r.reward)}</td>
      <td class="num">${r.turns}</td><td class="num">${r.completion_tokens}</td><td class="num">${r.weight_version_start}${r.weight_version_end !== r.weight_version_start ? "→" + r.weight_version_end : ""}</td>
      <td class="num">${r.duration_s ? fmt(r.duration_s) : "–"}</td><td class="reason">${esc(short(r.outcome_reason, 120))}</td></tr>`).join("");
    document.getElementById("table").innerHTML = `<table id="rollouts-table"><tr>${head}</tr>${body || `<tr><td colspan="${cols.length}" class="muted">no rollout matches</td></tr>`}</table>`;
    const pages = Math.max(1, Math.ceil(d.total / d.per_page));
    const pager = `<button data-go="prev" ${d.page <= 1 ? "disabled" : ""}>← prev</button><span id="page-info">page ${d.page} of ${pages} · ${d.total} rollouts</span><button data-go="next" ${d.page >= pages ? "disabled" : ""}>next →</button>`;
    for (const id of ["pager", "pager-top"]) document.getElementById(id).innerHTML = pager;
    document.querySelectorAll("th.sortable").forEach(th => th.onclick = () => {
      if (state.sort === th.dataset.sort) state.order = state.order === "desc" ? "asc" : "desc"; else { state.sort = th.dataset.sort; state.order = "desc"; }
      state.page = 1; load();
    });
    document.querySelectorAll("[data-go]").forEach(b => b.onclick = () => { state.page += b.dataset.go === "next" ? 1 : -1; load(); });
  }
  form.onsubmit = ev => { ev.preventDefault(); for (const f of FILTERS) state[f] = form[f].value; state.page = 1; load(); };
  document.getElementById("clear").onclick = () => { for (const f of FILTERS) { state[f] = ""; form[f].value = ""; } state.page = 1; load(); };
  await load();
}

// ---- trajectory viewer ---------------------------------------------------------------------------------
function shade(lp) {
  const p = Math.exp(lp);                       // sampled token's probability
  const a = Math.min(0.75, Math.max(0, (1 - p) * 0.75));
  return `rgba(224,49,49,${a.toFixed(3)})`;
}
function diffHtml(diff) {
  return diff.split("\n").map(l => {
    const c = l.startsWith("+++") || l.startsWith("---") ? "" : l.startsWith("+") ? "add" : l.startsWith("-") ? "del" : l.startsWith("@@") ? "hunk" : "";
    return c ? `<span class="${c}">${esc(l)}</span>` : esc(l) + "\n";
  }).join("");
}
async function trajectoryPage() {
  const id = document.body.dataset.rollout;
  let d;
  try { d = await api("/api/rollout/" + encodeURIComponent(id)); } catch (e) { app.innerHTML = `<p class="err">${esc(e.message)}</p>`; return; }
  const r = d.rollout, s = d.summary;
  const t = r.timings || {};
  const mix = Object.entries(s.mix).map(([k, v]) => `${k} ${v}`).join(", ") || "–";
  let out = `<h1>Rollout <span class="mono">${esc(r.id)}</span></h1>
  <div class="card" id="rollout-head"><div class="kv">
    <span class="k">outcome</span><span>${outcomePill(r.outcome)} <span id="outcome-reason">${esc(r.outcome_reason || "")}</span></span>
    <span class="k">reward</span><span>${r.reward === null ? "masked (not trained on)" : fmt(r.reward)}</span>
    <span class="k">task</span><span class="mono">${esc(r.task_id)}</span>
    <span class="k">step · group · sample</span><span class="mono">${r.step} · ${esc(r.group_id)} · ${r.sample_index}</span>
    <span class="k">harness · split</span><span>${esc(r.harness)} · ${esc(r.split)}</span>
    <span class="k">weight versions</span><span>${r.weight_version_start} → ${r.weight_version_end} (calls: ${s.weight_versions.join(", ") || "–"})</span>
    <span class="k">timings (s)</span><span>${Object.entries(t).map(([k, v]) => `${esc(k)} ${fmt(v)}`).join(" · ") || "–"}</span>
    <span class="k">calls · segments</span><span>${s.calls} calls · ${s.segments} segment(s) · ${s.completion_tokens} sampled tokens · mean logprob ${fmt(s.mean_logprob)}</span>
    <span class="k">side calls</span><span id="side-calls">${Object.entries(s.side_calls || {}).map(([k, v]) => `${esc(k)} ${v}`).join(" · ") || "none"}</span>
    <span class="k">behaviour</span><span>${s.tool_calls} tool calls over ${s.turns} turns · ${s.text_only_turns} text-only · ${s.format_errors} format error(s) ·
      ${s.edits} edit(s), ${s.verified_edits} verified · submitted: ${s.submitted ? "yes" : "no"} · mix: ${esc(mix)}</span>
  </div></div>
  <div class="muted" style="margin:6px 0 10px">Completion tokens are shaded by how unlikely the sampler found them: <span class="scale">p=0 <span></span> p=1</span> · hover a token for its id, logprob and routed experts.</div>`;
  d.calls.forEach((c, ci) => {
    const seg = c.parent_index === null || c.segment_break;
    const comp = c.completion;
    const toks = comp.ids.map((tid, i) => `<span class="tok" data-c="${ci}" data-i="${i}" style="background:${shade(comp.logprobs[i] ?? 0)}">${esc(comp.pieces[i])}</span>`).join("");
    const side = c.session && c.session !== "main";
    out += `<div class="card call ${seg ? "seg" : ""} ${side ? "side" : ""}" id="call-${c.index}" data-call="${c.index}">
      <div class="call-h"><b>call ${c.index}</b>${side ? `<span class="pill" title="a side call of the harness, in a session of its own: not an agent turn">side: ${esc(c.session)}</span>` : ""}<span>weights v${c.weight_version}</span><span>finish: ${esc(c.finish_reason)}</span>
        <span>${esc(c.wire_format)}</span><span>prompt ${c.prompt_tokens} tok (new ${c.new_prompt_tokens})</span><span>completion ${comp.ids.length} tok</span>
        ${c.parent_index !== null ? `<span>extends call ${c.parent_index}</span>` : ""}${c.duration_s ? `<span>${fmt(c.duration_s)} s</span>` : ""}
        ${c.sampled_from_policy ? "" : '<span class="pill">not sampled from policy</span>'}${c.naive_prompt_differs ? '<span title="re-rendering the conversation would have produced different tokens; the bridge kept the sampled ones">bridge prevented drift</span>' : ""}</div>
      ${c.segment_break ? `<div class="segbreak">segment break: ${esc(c.segment_break)}</div>` : (seg ? `<div class="segbreak">segment start</div>` : "")}
      <div class="block-label">${c.new_prompt_start ? "new prompt tokens (after call " + c.parent_index + "'s prompt + completion)" : "full prompt (segment start)"}</div>
      <details ${c.new_prompt_text.length < 1500 ? "open" : ""}><summary class="muted">${c.new_prompt_tokens} tokens${c.new_prompt_elided_chars ? `, first ${c.new_prompt_elided_chars} chars elided` : ""}</summary><pre class="prompt">${esc(c.new_prompt_text)}</pre></details>
      <div class="block-label">sampled completion</div><div class="tokens">${toks}</div>
      ${c.tool_calls.map(tc => `<div class="toolcall ${tc.valid ? "" : "invalid"}"><b>tool call</b> <span class="mono">${esc(tc.name)}</span> <span class="pill" style="background:${Charts.color(tc.kind, 0)}">${tc.kind}</span>${tc.valid ? "" : ' <span class="err">malformed arguments</span>'}<pre>${esc(tc.arguments)}</pre></div>`).join("")}
      ${c.tool_results.map(tr => `<div class="result ${tr.is_error ? "error" : ""}"><b>tool result</b>${tr.tool_call_id ? ` <span class="muted mono">${esc(tr.tool_call_id)}</span>` : ""}<pre>${esc(tr.text)}</pre></div>`).join("")}
      ${c.notes.map(n => `<div class="note ${c.format_error_note ? "error" : ""}"><b>${c.format_error_note ? "harness: format error" : "harness (" + esc(n.role) + ")"}</b><pre>${esc(n.text)}</pre></div>`).join("")}
    </div>`;
  });
  const rep = r.report;
  out += `<h2>Final diff</h2>${r.diff ? `<pre class="diff" id="final-diff">${diffHtml(r.diff)}</pre>` : `<p class="muted" id="final-diff">the agent changed nothing</p>`}`;
  out += `<h2>Grader report</h2>`;
  if (rep) {
    const tests = Object.entries(rep.tests || {});
    out += `<div class="card" id="grader-report"><div class="kv"><span class="k">verdict</span><span>${rep.resolved ? "resolved" : "not resolved"} · ${esc(rep.reason || "")}</span>
      <span class="k">collected · exit code</span><span>${rep.collected} · ${rep.exit_code ?? "–"}</span>
      <span class="k">applied paths</span><span class="mono">${esc((rep.applied_paths || []).join(", ") || "–")}</span>
      <span class="k">dropped paths</span><span class="mono ${rep.dropped_paths && rep.dropped_paths.length ? "err" : ""}">${esc((rep.dropped_paths || []).join(", ") || "none")}</span></div>
      <table style="margin-top:8px" id="tests"><tr><th>test</th><th>status</th></tr>${tests.map(([k, v]) => `<tr><td class="mono">${esc(k)}</td><td class="status-${esc(v)}">${esc(v)}</td></tr>`).join("")}</table>
      <div class="block-label">log tail</div><pre>${esc(rep.log_tail || "")}</pre></div>`;
  } else out += `<p class="muted">not graded</p>`;
  out += `<h2>Outcome</h2><div class="card" id="outcome">${outcomePill(r.outcome)} ${esc(r.outcome_reason || "")}</div>`;
  app.innerHTML = out;
  app.addEventListener("mouseover", ev => {
    const tk = ev.target.closest(".tok");
    if (!tk) return;
    const c = d.calls[+tk.dataset.c], i = +tk.dataset.i, lp = c.completion.logprobs[i];
    const ex = c.completion.experts ? c.completion.experts[i] : null;
    Charts.tip(`<div class="tip-h">token ${i} · id ${c.completion.ids[i]}</div><div class="mono">${esc(JSON.stringify(c.completion.pieces[i]))}</div>
      <div>logprob ${lp.toFixed(4)} (p = ${Math.exp(lp).toFixed(4)})</div>${ex ? `<div>routed experts: ${esc(ex)}</div>` : ""}`, ev);
  });
  app.addEventListener("mouseout", ev => { if (ev.target.closest(".tok")) Charts.tip(null); });
}

// ---- failures ------------------------------------------------------------------------------------------
async function failures() {
  const q = new URLSearchParams(location.search);
  let split = q.get("split") || "train";
  app.innerHTML = `<h1>Failures</h1><div class="filters"><label>rollouts<select id="split"><option value="train">train</option><option value="all">all splits</option></select></label></div>
    <div class="grid-charts" id="fgrid"></div><h2>Outcome taxonomy</h2><div id="taxonomy"></div>`;
  const sel = document.getElementById("split");
  sel.value = split;
  const grid = document.getElementById("fgrid");
  const load = async () => {
    const d = await api("/api/failures?split=" + encodeURIComponent(split));
    chartsGrid(d.charts, grid);
    const rows = d.table.map(t => `<tr data-outcome="${esc(t.outcome)}"><td>${outcomePill(t.outcome)}${t.infra ? ' <span class="muted">infra</span>' : ""}</td><td class="num">${t.count}</td><td class="num">${pct(t.share)}</td>
      <td>${t.reasons.map(x => `<div>${x.count}× ${esc(short(x.reason, 110))} <span class="muted">(last step ${x.last_step})</span></div>`).join("")}</td>
      <td>${t.examples.map(e => `<div class="mono">${rolloutLink(e.id, short(e.id, 40))} <span class="muted">step ${e.step}</span></div>`).join("")}
        <a href="/rollouts?outcome=${encodeURIComponent(t.outcome)}${split !== "all" ? "&split=" + encodeURIComponent(split) : ""}">all ${t.count} →</a></td></tr>`).join("");
    document.getElementById("taxonomy").innerHTML = `<p class="muted">${d.total} finished rollouts, ${d.resolved} resolved.</p>` +
      (rows ? `<table id="taxonomy-table"><tr><th>outcome</th><th>count</th><th>share</th><th>most frequent reasons</th><th>examples</th></tr>${rows}</table>` : `<p class="muted">no failure yet</p>`);
  };
  sel.onchange = () => { split = sel.value; history.replaceState(null, "", "/failures?split=" + split); load(); };
  live(load);
}

// ---- behaviour -----------------------------------------------------------------------------------------
async function behaviour() {
  app.innerHTML = `<h1>Behaviour</h1><p class="muted" id="bnote"></p><div class="grid-charts" id="bgrid"></div>`;
  const grid = document.getElementById("bgrid");
  live(async () => {
    const d = await api("/api/behaviour");
    document.getElementById("bnote").textContent = `${d.steps} train steps, ${d.rollouts_analysed} rollouts analysed from their captured calls and tool calls ` +
      `(verification after edit = an edited file is later read, or tests are run; text-only turn = an assistant turn without a tool call).`;
    chartsGrid(d.charts, grid);
  }, 10000);
}

// ---- alarms --------------------------------------------------------------------------------------------
async function alarms() {
  app.innerHTML = `<h1>Alarms</h1><div id="active"></div><h2>History</h2><div id="history"></div><h2>Thresholds</h2><pre id="thresholds"></pre>`;
  live(async () => {
    const d = await api("/api/alarms");
    document.getElementById("active").innerHTML = d.active.length ? d.active.map(a => `<div class="card alarm ${a.severity}"><b>${esc(a.name)}</b> at step ${a.step}: ${esc(a.message)}</div>`).join("")
      : `<div class="card">No active alarm${d.last_step !== null ? ` at step ${d.last_step}` : ""}.</div>`;
    document.getElementById("history").innerHTML = d.alarms.length ? `<table id="alarm-history"><tr><th>step</th><th>alarm</th><th>value</th><th>threshold</th><th>message</th></tr>` +
      d.alarms.slice().reverse().map(a => `<tr><td class="num">${a.step}</td><td>${esc(a.name)}</td><td class="num">${fmt(a.value)}</td><td class="num">${fmt(a.threshold)}</td><td>${esc(a.message)}</td></tr>`).join("") + "</table>"
      : `<p class="muted">No alarm has fired in this run.</p>`;
    document.getElementById("thresholds").textContent = JSON.stringify(d.config, null, 2);
  }, 10000);
}

// ---- task grid: one row per task, one column per step or evaluation --------------------------------------
async function tasksPage() {
  const q = new URLSearchParams(location.search);
  let split = q.get("split") || "train";
  app.innerHTML = `<h1>Tasks</h1><form class="filters" id="grid-form"><label>split<select name="split">
    <option value="train">train (RL steps)</option><option value="eval-heldout">held-out evaluations</option>
    <option value="eval-train">train-set evaluations</option><option value="demo">demonstrations</option></select></label></form>
    <p class="muted">each cell: that task's rollouts at that step; <span class="cell solved">■</span> all resolved,
    <span class="cell mixed">■</span> some, <span class="cell failed">■</span> none, <span class="cell masked">■</span> masked only;
    empty: not sampled. Click a cell for one of its trajectories.</p><div id="grid"></div>`;
  const sel = document.querySelector("#grid-form select");
  sel.value = split;
  sel.addEventListener("change", () => { split = sel.value; history.replaceState(null, "", `?split=${split}`); draw(); });
  const grid = document.getElementById("grid");
  const kind = c => !c ? "" : c[0] + c[1] === 0 ? "masked" : c[1] === 0 ? "solved" : c[0] === 0 ? "failed" : "mixed";
  async function draw() {
    const d = await api(`/api/tasks?split=${encodeURIComponent(split)}`);
    if (!d.rows.length) { grid.innerHTML = `<p class="muted">no finished rollout in this split yet</p>`; return; }
    // the evaluation before RL and the demonstrations are recorded at step -1
    const col = s => s >= 0 ? `step ${s}` : split === "demo" ? "demonstrations" : "before RL";
    const head = `<tr><th>task</th><th>harness</th><th>solved</th>${d.steps.map(s => `<th class="step" title="${col(s)}">${s >= 0 ? s : split === "demo" ? "" : "before"}</th>`).join("")}</tr>`;
    let family = null, body = "";
    for (const r of d.rows) {
      if (r.family !== family) { family = r.family; body += `<tr class="family"><td colspan="${3 + d.steps.length}">${esc(family)}</td></tr>`; }
      body += `<tr><td class="mono">${esc(short(r.task, 48))}</td><td>${esc(r.harness)}</td><td class="num">${r.solved}/${r.sampled}</td>` +
        r.cells.map((c, i) => c ? `<td class="cell ${kind(c)}" title="${col(d.steps[i])}: ${c[0]} resolved, ${c[1]} failed, ${c[2]} masked"><a href="/rollout/${encodeURIComponent(c[3])}">■</a></td>` : `<td></td>`).join("") + "</tr>";
    }
    grid.innerHTML = (d.older_steps ? `<p class="muted">${d.older_steps} older steps not shown</p>` : "") + `<table id="task-grid">${head}${body}</table>`;
  }
  live(draw);
}

// ---- compare runs (legorl dashboard RUN_A RUN_B ...) ------------------------------------------------------
async function comparePage() {
  const runs = h('<div></div>'), grid = h('<div class="grid-charts"></div>'), diff = h('<div></div>'), per = h('<div></div>');
  app.innerHTML = "<h1>Compare runs</h1>";
  app.append(runs, grid, diff, per);
  const val = v => v === null || v === undefined ? '<span class="muted">–</span>' : esc(typeof v === "object" ? JSON.stringify(v) : String(v));
  live(async () => {
    const d = await api("/api/compare");
    runs.innerHTML = `<table id="compare-runs"><tr><th>run</th><th>directory</th><th>steps</th><th>wall time</th></tr>` +
      d.runs.map(r => `<tr><td>${esc(r.label)}</td><td class="mono">${esc(r.dir)}</td><td class="num">${r.steps}</td><td class="num">${r.wall_time_s ? duration(r.wall_time_s) : "–"}</td></tr>`).join("") + "</table>";
    chartsGrid(d.charts, grid);
    const head = d.runs.map(r => `<th>${esc(r.label)}</th>`).join("");
    diff.innerHTML = `<h2>Config differences</h2>` + (d.config_differences.length
      ? `<table id="config-diff"><tr><th>key</th>${head}</tr>` + d.config_differences.map(c => `<tr><td class="mono">${esc(c.key)}</td>${c.values.map(v => `<td class="mono">${val(v)}</td>`).join("")}</tr>`).join("") + "</table>"
      : `<p class="muted">the runs' configs are the same</p>`);
    per.innerHTML = `<h2>Held-out pass@1 per harness, before and after RL</h2>` + (d.per_harness.length
      ? `<table id="per-harness"><tr><th>run</th><th>harness</th><th>before RL</th><th>after RL</th><th>change (points)</th></tr>` +
        d.per_harness.map(r => `<tr><td>${esc(r.run)}</td><td>${esc(r.harness)}</td><td class="num">${pct(r.before)}</td><td class="num">${pct(r.after)}</td><td class="num">${r.before !== null && r.after !== null && r.before !== undefined && r.after !== undefined ? (100 * (r.after - r.before)).toFixed(1) : "–"}</td></tr>`).join("") + "</table>"
      : `<p class="muted">no run has finished its evaluations yet</p>`);
  });
}

({overview, rollouts, tasks: tasksPage, trajectory: trajectoryPage, failures, behaviour, alarms, compare: comparePage})[page]?.();
