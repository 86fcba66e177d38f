// The report page without its 3D view: timestep slider and play button, held-out images and
// plots (inline SVG). A classic script, so it also works when the page is opened as a file.
// Served over HTTP it polls report.json and shows new steps of a running simulation.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const report = {
    data: JSON.parse($("insitu-data").textContent),
    index: 0,
    setStep,
  };
  report.index = Math.max(0, report.data.steps.length - 1);
  window.insituReport = report;
  const served = location.protocol === "http:" || location.protocol === "https:";
  if (!served) {
    $("file-note").hidden = false;
    $("viewer-status").textContent = "3D viewer: needs a web server (see the note above)";
  }
  let timer = null;

  function setStep(index) {
    const steps = report.data.steps;
    if (!steps.length) return;
    index = Math.max(0, Math.min(steps.length - 1, index));
    report.index = index;
    const s = steps[index];
    $("slider").value = String(index);
    $("step-label").textContent = `step ${s.step} (${index + 1}/${steps.length})` + figures(s);
    const images = $("images");
    images.textContent = "";
    for (const image of s.images) {
      const a = document.createElement("a");
      a.href = image.src;
      const img = document.createElement("img");
      img.src = image.src;
      img.alt = img.title = image.name;
      a.appendChild(img);
      images.appendChild(a);
    }
    document.dispatchEvent(new CustomEvent("insitu-step", { detail: { index } }));
  }

  // The step's figures, the surface's first: its held-out orbit views' foreground, then the views
  // 2x and 3x closer and off the orbit, then the whole image (black background included).
  function figures(s) {
    const db = (v) => (v != null ? v.toFixed(2) : "?");
    if (s.psnr_foreground == null) {
      return s.psnr != null ? `: PSNR ${db(s.psnr)} dB, SSIM ${s.ssim != null ? s.ssim.toFixed(3) : "?"}` : "";
    }
    const closer = [["2x closer", s.psnr_foreground_near2], ["3x closer", s.psnr_foreground_near3],
                    ["off the orbit", s.psnr_foreground_off]].filter(([, v]) => v != null);
    return `: surface PSNR ${db(s.psnr_foreground)} dB, SSIM ${s.ssim_foreground != null ? s.ssim_foreground.toFixed(3) : "?"}` +
      closer.map(([name, v]) => `; ${name} ${db(v)} dB`).join("") +
      ` (whole image ${db(s.psnr)} dB)`;
  }

  function setSteps(data) {
    const wasLast = report.index >= report.data.steps.length - 1;
    report.data = data;
    $("slider").max = String(Math.max(0, data.steps.length - 1));
    plots(data.steps);
    setStep(wasLast ? data.steps.length - 1 : report.index);
  }

  $("slider").addEventListener("input", (e) => setStep(Number(e.target.value)));
  $("play").addEventListener("click", () => {
    if (timer) {
      clearInterval(timer);
      timer = null;
      $("play").innerHTML = "&#9654;";
      return;
    }
    $("play").innerHTML = "&#10074;&#10074;";
    timer = setInterval(() => setStep((report.index + 1) % report.data.steps.length), 1500);
  });

  // ------------------------------------------------------------------------------- plots (SVG)
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf"];

  function el(name, attrs, parent, text) {
    const e = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text != null) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  function ticks(lo, hi, n = 5) {
    const span = hi - lo || 1;
    const step = Math.pow(10, Math.floor(Math.log10(span / n)));
    const k = [1, 2, 5, 10].find((m) => span / (m * step) <= n) * step;
    const out = [];
    for (let t = Math.ceil(lo / k) * k; t <= hi + 1e-9 * span; t += k) out.push(Number(t.toPrecision(10)));
    return out;
  }

  function frame(title, xs, ys, xlabel, ylabel) {
    const W = 360, H = 230, L = 48, R = 10, T = 24, B = 36;
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "plot" });
    el("text", { x: W / 2, y: 15, "text-anchor": "middle", class: "title" }, svg, title);
    let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= 1; y1 += 1; }
    const pad = 0.05 * (y1 - y0);
    y0 -= pad; y1 += pad;
    const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    for (const t of ticks(x0, x1)) {
      el("line", { x1: sx(t), x2: sx(t), y1: H - B, y2: H - B + 4, class: "axis" }, svg);
      el("text", { x: sx(t), y: H - B + 15, "text-anchor": "middle" }, svg, String(t));
    }
    for (const t of ticks(y0, y1)) {
      el("line", { x1: L, x2: W - R, y1: sy(t), y2: sy(t), class: "grid" }, svg);
      el("text", { x: L - 5, y: sy(t) + 4, "text-anchor": "end" }, svg, String(t));
    }
    el("rect", { x: L, y: T, width: W - L - R, height: H - T - B, class: "axes" }, svg);
    el("text", { x: L + (W - L - R) / 2, y: H - 4, "text-anchor": "middle" }, svg, xlabel);
    el("text", { x: 12, y: T + (H - T - B) / 2, "text-anchor": "middle",
                 transform: `rotate(-90 12 ${T + (H - T - B) / 2})` }, svg, ylabel);
    return { svg, sx, sy, W, L, R, T };
  }

  // series: [{name, points: [[x, y], ...]}]
  function lineChart(title, series, xlabel, ylabel) {
    const all = series.flatMap((s) => s.points).filter((p) => p[1] != null && isFinite(p[1]));
    if (!all.length) return null;
    const f = frame(title, all.map((p) => p[0]), all.map((p) => p[1]), xlabel, ylabel);
    series.forEach((s, i) => {
      const pts = s.points.filter((p) => p[1] != null && isFinite(p[1]));
      const color = COLORS[i % COLORS.length];
      el("polyline", { points: pts.map((p) => `${f.sx(p[0])},${f.sy(p[1])}`).join(" "), stroke: color,
                       fill: "none", "stroke-width": 1.5 }, f.svg);
      for (const p of pts) el("circle", { cx: f.sx(p[0]), cy: f.sy(p[1]), r: 2, fill: color }, f.svg);
      if (series.length <= 10) {
        el("text", { x: f.W - f.R - 4, y: f.T + 12 + 12 * i, "text-anchor": "end", fill: color }, f.svg, s.name);
      }
    });
    return f.svg;
  }

  // bars: [{x, parts: [values...]}], one stacked bar per x; names: the parts' names
  function stackedBars(title, bars, names, xlabel, ylabel) {
    if (!bars.length) return null;
    const totals = bars.map((b) => b.parts.reduce((a, v) => a + (v || 0), 0));
    const xs = bars.map((b) => b.x);
    const f = frame(title, xs.length > 1 ? xs : [xs[0] - 1, xs[0] + 1], [0, ...totals], xlabel, ylabel);
    const gap = xs.length > 1 ? Math.min(...xs.slice(1).map((x, i) => x - xs[i])) : 2;
    const width = Math.max(2, Math.abs(f.sx(gap) - f.sx(0)) * 0.6);
    bars.forEach((b) => {
      let base = 0;
      b.parts.forEach((v, j) => {
        if (!v) return;
        el("rect", { x: f.sx(b.x) - width / 2, y: f.sy(base + v), width, height: f.sy(base) - f.sy(base + v),
                     fill: COLORS[j % COLORS.length] }, f.svg);
        base += v;
      });
    });
    names.forEach((n, j) => el("text", { x: f.W - f.R - 4, y: f.T + 12 + 12 * j, "text-anchor": "end",
                                         fill: COLORS[j % COLORS.length] }, f.svg, n));
    return f.svg;
  }

  function plots(steps) {
    const box = $("plots");
    box.textContent = "";
    const perStep = (key) => steps.map((s) => ({ name: `step ${s.step}`,
                                                  points: s.history.map((h) => [h.iteration, h[key]]) }));
    const stageNames = steps.length ? Object.keys(steps[0].stages) : [];
    const fg = steps.some((s) => s.psnr_foreground != null);   // older folders: the whole image's only
    const [p, q, what] = fg ? ["psnr_foreground", "ssim_foreground", "surface"] : ["psnr", "ssim", "held-out"];
    const perTimestep = (series) => series.map(([name, key]) => ({ name, points: steps.map((s) => [s.step, s[key]]) }))
      .filter((s) => s.points.some((pt) => pt[1] != null));
    const charts = [
      lineChart(`${what} PSNR during training`, perStep(p), "iteration", "PSNR (dB)"),
      lineChart(`${what} SSIM during training`, perStep(q), "iteration", "SSIM"),
      lineChart(`${what} PSNR per timestep`, perTimestep(fg ? [["orbit", p], ["2x closer", "psnr_foreground_near2"],
                                                               ["3x closer", "psnr_foreground_near3"],
                                                               ["off the orbit", "psnr_foreground_off"],
                                                               ["whole image", "psnr"]] : [["", p]]),
                "timestep", "PSNR (dB)"),
      lineChart(`${what} SSIM per timestep`, perTimestep(fg ? [["orbit", q], ["whole image", "ssim"]] : [["", q]]),
                "timestep", "SSIM"),
      stackedBars("time per stage", steps.map((s) => ({ x: s.step, parts: stageNames.map((n) => s.stages[n]) })),
                  stageNames, "timestep", "seconds"),
    ];
    for (const c of charts) if (c) box.appendChild(c);
  }

  setSteps(report.data);
  if (served) {
    setInterval(() => {
      fetch("report.json", { cache: "no-store" }).then((r) => (r.ok ? r.json() : null)).then((data) => {
        if (data && JSON.stringify(data.steps) !== JSON.stringify(report.data.steps)) setSteps(data);
      }).catch(() => {});
    }, 5000);
  }
})();
