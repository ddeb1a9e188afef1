// legorl dashboard: tiny dependency-free SVG charts (line and stacked bars) with hover and click.
// A spec is {id, title, kind: "line"|"stacked", x: [steps], series: [{name, values}], ylog, ymin, ymax, link}.
"use strict";
const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2563eb", "#e8590c", "#2f9e44", "#9c36b5", "#c92a2a", "#0b7285", "#e67700", "#5c7cfa",
    "#868e96", "#d6336c", "#37b24d", "#1098ad"];
  const NAMED = {
    resolved: "#2f9e44", unresolved: "#f08c00", max_turns: "#fcc419", agent_timeout: "#9c36b5",
    agent_crash: "#c92a2a", no_model_calls: "#868e96", context_overflow: "#0b7285", sandbox_error: "#343a40",
    engine_error: "#f03e3e", grader_error: "#7048e8", invalid_capture: "#adb5bd",
    read: "#2563eb", search: "#15aabf", edit: "#e8590c", test: "#2f9e44", submit: "#9c36b5", other: "#adb5bd",
    rollout: "#2563eb", grading: "#15aabf", training: "#e8590c", "weight sync": "#9c36b5",
  };
  const H = 230, M = {l: 52, r: 18, t: 10, b: 26};

  function color(name, i) { return NAMED[name] || PALETTE[i % PALETTE.length]; }

  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
    if (a >= 100) return v.toFixed(0);
    if (a >= 1) return v.toFixed(2).replace(/\.?0+$/, "");
    if (a >= 1e-3) return v.toPrecision(2);
    return v.toExponential(1);
  }

  // a tick's label: as many decimals as the tick step needs, so a narrow range (a Pearson of 0.9999998 to
  // 1) reads 0.9999998, 0.9999999, 1 rather than three "1.0"
  function tickFmt(v, step) {
    const a = Math.abs(v);
    if (a === 0 || step >= 1 || a < 1e-3 || a >= 1e4) return fmt(v);
    let d = 0;
    while (d < 10 && Math.abs(Math.round(step * 10 ** d) - step * 10 ** d) > 1e-6) d++;
    return v.toFixed(d);
  }

  function ticks(lo, hi, n) {
    if (hi <= lo) { hi = lo + 1; }
    const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (parent) parent.appendChild(e);
    return e;
  }

  function tip(html, ev) {
    const t = document.getElementById("tip");
    if (!t) return;
    if (html === null) { t.hidden = true; return; }
    t.innerHTML = html;
    t.hidden = false;
    const x = Math.min(ev.clientX + 14, window.innerWidth - t.offsetWidth - 8);
    t.style.left = x + "px";
    t.style.top = (ev.clientY + 14) + "px";
  }

  function esc(s) { return String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c])); }

  function render(box, spec) {
    box.innerHTML = "";
    box.dataset.chart = spec.id;
    const head = document.createElement("div");
    head.className = "chart-title";
    head.textContent = spec.title;
    box.appendChild(head);
    const series = spec.series || [];
    const xs = spec.x || [];
    if (!xs.length || !series.length) {
      const p = document.createElement("div");
      p.className = "chart-empty";
      p.textContent = "no data yet";
      box.appendChild(p);
      return;
    }
    const W = Math.max(260, box.clientWidth - 2);
    const svg = el("svg", {width: W, height: H, class: "chart-svg", role: "img", "aria-label": spec.title}, box);
    const stacked = spec.kind === "stacked";
    const n = xs.length;
    // y range
    let lo = Infinity, hi = -Infinity;
    if (stacked) {
      lo = 0;
      for (let i = 0; i < n; i++) { let s = 0; for (const se of series) s += se.values[i] || 0; hi = Math.max(hi, s); }
    } else {
      for (const se of series) for (const v of se.values) if (v !== null && (!spec.ylog || v > 0)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    }
    if (!Number.isFinite(lo)) { lo = 0; hi = 1; }
    if (spec.ymin !== undefined && spec.ymin !== null && !spec.ylog) lo = Math.min(lo, spec.ymin);
    if (spec.ymax !== undefined && spec.ymax !== null && !spec.ylog) hi = Math.max(hi, spec.ymax);
    if (hi - lo <= Math.max(Math.abs(hi), Math.abs(lo)) * 1e-6) { // flat: give it some room, never below 0 for >= 0 data
      const d = Math.abs(hi) * 0.1 || 1, nonneg = lo >= 0;
      lo -= d; hi += d;
      if (nonneg) lo = Math.max(0, lo);
    }
    const log = !!spec.ylog;
    if (log && lo > 0) { lo = Math.pow(10, Math.floor(Math.log10(lo))); hi = Math.pow(10, Math.ceil(Math.log10(hi))); }
    const ty = log ? (v => Math.log10(v)) : (v => v);
    const L = ty(lo), Hh = ty(hi);
    const decades = Math.round(Hh - L), every = Math.max(1, Math.ceil(decades / 5));
    const yt = (log ? Array.from({length: Math.floor(decades / every) + 1}, (_, i) => Math.pow(10, Math.round(L) + i * every))
      : ticks(lo, hi, 4)).filter(v => v >= lo - 1e-12 && v <= hi + 1e-12);
    const ystep = yt.length > 1 ? yt[1] - yt[0] : 1;
    const ylabels = yt.map(v => log ? fmt(v) : tickFmt(v, ystep));
    // the left margin widens for long labels (10px text: about 6px a character)
    const ml = Math.max(M.l, 10 + 6 * Math.max(0, ...ylabels.map(t => t.length)));
    const pw = W - ml - M.r, ph = H - M.t - M.b;
    const Y = v => M.t + ph - (ty(v) - L) / ((Hh - L) || 1) * ph;
    // x: a band per step for bars, a linear scale for lines
    const xmin = Math.min(...xs), xmax = Math.max(...xs);
    const band = pw / n;
    const X = stacked ? (i => ml + band * (i + 0.5)) : (i => ml + (xmax === xmin ? pw / 2 : (xs[i] - xmin) / (xmax - xmin) * pw));
    // grid and axes
    yt.forEach((v, k) => {
      const y = Y(v);
      el("line", {x1: ml, x2: ml + pw, y1: y, y2: y, class: "grid"}, svg);
      el("text", {x: ml - 6, y: y + 4, "text-anchor": "end", class: "axis"}, svg).textContent = ylabels[k];
    });
    const xt = stacked ? xs.filter((_, i) => i % Math.max(1, Math.ceil(n / 10)) === 0) : ticks(xmin, xmax, Math.min(8, Math.max(1, xmax - xmin)));
    for (const v of xt) {
      const i = stacked ? xs.indexOf(v) : null;
      const x = stacked ? X(i) : (xmax === xmin ? ml + pw / 2 : ml + (v - xmin) / (xmax - xmin) * pw);
      if (!stacked && (v < xmin || v > xmax || !Number.isInteger(v))) continue;
      el("text", {x, y: H - 8, "text-anchor": "middle", class: "axis"}, svg).textContent = fmt(v);
    }
    el("line", {x1: ml, x2: ml + pw, y1: M.t + ph, y2: M.t + ph, class: "axis-line"}, svg);
    // marks
    if (stacked) {
      const bw = Math.max(1, Math.min(48, band * 0.8));
      for (let i = 0; i < n; i++) {
        let acc = 0;
        series.forEach((se, k) => {
          const v = se.values[i] || 0;
          if (v <= 0) return;
          const y0 = Y(acc), y1 = Y(acc + v);
          acc += v;
          const r = el("rect", {x: X(i) - bw / 2, y: y1, width: bw, height: Math.max(0.5, y0 - y1), fill: color(se.name, k),
            class: "bar" + (spec.link ? " link" : ""), "data-step": xs[i], "data-series": se.name}, svg);
          if (spec.link === "outcome") {
            r.addEventListener("click", () => {
              const q = new URLSearchParams({step: xs[i], outcome: se.name});
              if (spec.split) q.set("split", spec.split);
              window.location.href = "/rollouts?" + q.toString();
            });
          }
        });
      }
    } else {
      series.forEach((se, k) => {
        let d = "", pen = false, pts = 0;
        se.values.forEach((v, i) => {
          if (v === null || (log && v <= 0)) { pen = false; return; }
          d += (pen ? "L" : "M") + X(i).toFixed(1) + "," + Y(v).toFixed(1);
          pen = true; pts++;
        });
        el("path", {d, fill: "none", stroke: color(se.name, k), "stroke-width": 2, class: "line"}, svg);
        if (pts <= 40) se.values.forEach((v, i) => {
          if (v !== null && (!log || v > 0)) el("circle", {cx: X(i), cy: Y(v), r: 2.6, fill: color(se.name, k)}, svg);
        });
      });
    }
    // hover
    const cursor = el("line", {y1: M.t, y2: M.t + ph, class: "cursor", visibility: "hidden", "pointer-events": "none"}, svg);
    const nearest = px => {
      if (stacked) return Math.max(0, Math.min(n - 1, Math.floor((px - ml) / band)));
      let best = 0, bd = Infinity;
      for (let i = 0; i < n; i++) { const dd = Math.abs(X(i) - px); if (dd < bd) { bd = dd; best = i; } }
      return best;
    };
    const move = ev => {
      const r = svg.getBoundingClientRect();
      const i = nearest(ev.clientX - r.left);
      cursor.setAttribute("x1", X(i)); cursor.setAttribute("x2", X(i)); cursor.setAttribute("visibility", "visible");
      const rows = series.map((se, k) => `<div><i style="background:${color(se.name, k)}"></i>${esc(se.name)}: <b>${fmt(se.values[i])}</b></div>`);
      tip(`<div class="tip-h">step ${xs[i]}</div>` + rows.join(""), ev);
    };
    const leave = () => { cursor.setAttribute("visibility", "hidden"); tip(null); };
    if (stacked) { // the bars take the clicks; hovering anywhere on the plot shows the step's values
      svg.addEventListener("mousemove", move);
      svg.addEventListener("mouseleave", leave);
    } else {
      const hit = el("rect", {x: ml, y: M.t, width: pw, height: ph, fill: "transparent"}, svg);
      hit.addEventListener("mousemove", move);
      hit.addEventListener("mouseleave", leave);
    }
    // legend
    const lg = document.createElement("div");
    lg.className = "legend";
    series.forEach((se, k) => {
      const s = document.createElement("span");
      s.innerHTML = `<i style="background:${color(se.name, k)}"></i>${esc(se.name)}`;
      lg.appendChild(s);
    });
    box.appendChild(lg);
  }

  return {render, fmt, color, tip, esc};
})();
