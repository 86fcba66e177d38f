// The report page without its 3D view: timestep slider and play button, held-out images and
// plots (uPlot). A classic script, so it also works when the page is opened as a file.
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
    for (const [id, list] of [["images", s.images], ["files-images", s.files_images || []]]) {
      const images = $(id);
      images.textContent = "";
      for (const image of list) {
        const a = document.createElement("a");
        a.href = image.src;
        const img = document.createElement("img");
        img.src = image.src;
        img.alt = img.title = image.name;
        a.appendChild(img);
        images.appendChild(a);
      }
    }
    $("files-images-panel").hidden = !(s.files_images && s.files_images.length);
    $("files-caption").textContent = s.files_caption || "";
    $("files-line").textContent = s.files_text || "";
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

  // ------------------------------------------------------------------------------- plots (uPlot)
  // Drawn by uPlot (vendor/uplot, a classic script: window.uPlot). Every axis is fitted to its data
  // (fit), x included, so that each point and bar lies inside its axes; report.charts lists the charts
  // ({name, plot}: the uPlot instance) for the browser test.
  // no greys: the browser test tells a series from the axes, grid and text by its colour
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                  "#bcbd22", "#e7ba52"];
  // charts fill the page's width: as many columns of at least MIN_WIDTH px as fit, GAP px apart (one on a phone)
  const MIN_WIDTH = 400, GAP = 24;
  function chartSize(box) {
    const width = Math.max(200, box.clientWidth);
    const columns = Math.max(1, Math.floor((width + GAP) / (MIN_WIDTH + GAP)));
    const w = Math.floor((width - (columns - 1) * GAP) / columns);
    return { width: w, height: Math.round(Math.min(320, Math.max(200, 0.58 * w))) };
  }
  const INTEGER_STEPS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000, 25000,
                         50000, 1e5, 2e5, 2.5e5, 5e5, 1e6, 2e6, 5e6, 1e7, 2e7, 5e7, 1e8, 2e8, 5e8, 1e9];
  report.charts = [];

  // [lo, hi] around the finite values: 6% of their span beyond each end (a value alone: 2% of it), from 0
  // where `zero` (bars, counts of bytes), never above `upper` where every value is below it (SSIM's 1).
  function fit(values, { zero = false, upper = null } = {}) {
    const v = values.filter((x) => x != null && Number.isFinite(x));
    if (!v.length) return null;
    let lo = Math.min(...v), hi = Math.max(...v);
    if (zero) lo = Math.min(lo, 0);
    const pad = hi > lo ? 0.06 * (hi - lo) : (Math.abs(hi) * 0.02 || 1);
    const range = [zero && lo === 0 ? 0 : lo - pad, hi + pad];
    if (upper != null && hi <= upper) range[1] = Math.min(range[1], upper);
    return range;
  }

  // x: the steps or iterations, whole numbers; a bar needs half the gap between bars beside it
  function fitX(xs, bars) {
    const v = [...new Set(xs)].sort((a, b) => a - b);
    if (v.length === 1) return [v[0] - 1, v[0] + 1];
    const gap = Math.min(...v.slice(1).map((x, k) => x - v[k]));
    const pad = bars ? 0.6 * gap : 0.03 * (v[v.length - 1] - v[0]);
    return [v[0] - pad, v[v.length - 1] + pad];
  }

  function compact(x) {
    if (x == null || !Number.isFinite(x)) return "";
    const a = Math.abs(x);
    for (const [unit, size] of [["G", 1e9], ["M", 1e6], ["k", 1e3]]) {
      if (a >= size) return `${Number((x / size).toPrecision(3))}${unit}`;
    }
    return String(Number(x.toPrecision(4)));
  }

  // a y axis as wide as its widest value, measured at every layout cycle (its ticks change as the axis settles:
  // a width kept from the first cycle let a wider label run under the axis title)
  function axisSize(u, values, index) {
    const axis = u.axes[index];
    u.ctx.font = axis.font[0];
    const widest = Math.max(0, ...(values || []).map((v) => u.ctx.measureText(String(v)).width));
    return Math.ceil(axis.ticks.size + axis.gap + widest / (window.devicePixelRatio || 1)) + 4;
  }

  // the last finite value of `values` (what a legend shows when the pointer is not over the chart)
  function last(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] != null && Number.isFinite(values[i])) return values[i];
    return null;
  }

  // spec: {name, title, xlabel, ylabel, xs, series: [{label, values, color, key (the step's figure it plots, if
  //        any), dash, shown (the legend's values, if not values)}], y: fit's options, bars, integerX, ticksAtX (a
  //        tick at each x, if few), format (the legend's values)}. The legend shows the values under the pointer,
  //        and the last ones (the newest step's, the step's final figure) when it is elsewhere.
  function chart(box, spec) {
    const series = spec.series.filter((s) => s.values.some((v) => v != null && Number.isFinite(v)));
    if (!series.length || !spec.xs.length) return;
    const yRange = fit(series.flatMap((s) => s.values), spec.y);
    const xRange = fitX(spec.xs, spec.bars);
    const format = spec.format || compact;
    const xTicks = [...new Set(spec.xs)].sort((a, b) => a - b);
    const div = document.createElement("div");
    div.className = "chart";
    div.dataset.name = spec.name;
    box.appendChild(div);
    const opts = {
      title: spec.title, ...chartSize(box),
      scales: { x: { time: false, range: () => xRange }, y: { range: () => yRange } },
      cursor: { drag: { x: false, y: false, setScale: false } },
      legend: { show: series.length <= 12 },
      axes: [
        { label: spec.xlabel, incrs: spec.integerX ? INTEGER_STEPS : undefined, stroke: "#333", size: 30, labelSize: 20,
          splits: spec.ticksAtX && xTicks.length <= 8 ? () => xTicks : undefined,
          grid: { stroke: "#e8e8e8", width: 1 }, ticks: { stroke: "#999", width: 1, size: 4 },
          values: (u, splits) => splits.map(compact) },
        { label: spec.ylabel, stroke: "#333", size: axisSize, labelSize: 20, grid: { stroke: "#e8e8e8", width: 1 },
          ticks: { stroke: "#999", width: 1, size: 4 }, values: (u, splits) => splits.map(compact) },
      ],
      series: [{ label: spec.xlabel, value: (u, v, si, i) => compact(i == null ? last(spec.xs) : v) || "--" },
               ...series.map((s) => {
                 const shown = s.shown || s.values;
                 const at = (i) => (i == null ? last(shown) : shown[i]);
                 return {
                   label: s.label, stroke: s.color, width: spec.bars ? 0 : 1.5, spanGaps: true, dash: s.dash,
                   fill: spec.bars ? s.color : undefined,
                   paths: spec.bars ? uPlot.paths.bars({ size: [0.7, 48] }) : undefined,
                   points: spec.bars ? { show: false } : { show: true, size: s.dash ? 3.5 : 7, width: 1,
                                                           fill: s.color, stroke: s.color },
                   value: (u, v, si, i) => (at(i) == null || !Number.isFinite(at(i)) ? "--" : format(at(i))),
                 };
               })],
    };
    const plot = new uPlot(opts, [spec.xs, ...series.map((s) => s.values)], div);
    plot.setLegend({ idx: null });                    // the last values, until the pointer moves over it
    // what each series' last point is (the browser test checks it): the figure `key` of report.data.steps[step]
    // (a curve over iterations: its step's; over the timesteps: the last step that has it)
    const ends = series.map((s) => {
      if (!s.key) return null;
      let step = s.step;
      if (step == null) for (let i = 0; i < s.values.length; i++) if (s.values[i] != null) step = i;
      return { key: s.key, step };
    });
    report.charts.push({ name: spec.name, plot, ends });
  }

  // charts follow the page's width (a phone turned, a window resized)
  let laidOutAt = null;
  new ResizeObserver(() => {
    const box = document.querySelector("#plots .charts");
    if (!box || box.clientWidth === laidOutAt) return;
    laidOutAt = box.clientWidth;
    for (const c of report.charts) c.plot.setSize(chartSize(box));
  }).observe($("plots"));

  const finite = (v) => v != null && Number.isFinite(v);

  function plots(steps) {
    const box = $("plots");
    for (const c of report.charts) c.plot.destroy();
    report.charts = [];
    box.textContent = "";
    if (!steps.length || typeof uPlot === "undefined") return;
    const heading = (text) => {
      const h = document.createElement("h2");
      h.textContent = text;
      box.appendChild(h);
      const charts = document.createElement("div");
      charts.className = "charts";
      box.appendChild(charts);
      return charts;
    };
    const fg = steps.some((s) => finite(s.psnr_foreground));   // older folders: the whole image's only
    const [p, q, what] = fg ? ["psnr_foreground", "ssim_foreground", "Surface"] : ["psnr", "ssim", "Held-out"];
    const db = (v) => v.toFixed(2), ratio = (v) => v.toFixed(4);
    const ssimRange = { upper: 1 };

    // during training: a line per step over its iterations, ending at the step's final figure
    const during = heading("During training");
    const iterations = [...new Set(steps.flatMap((s) => s.history.map((h) => h.iteration)))].sort((a, b) => a - b);
    const colour = (k) => (steps.length <= COLORS.length ? COLORS[k] :
      `hsl(210, 70%, ${Math.round(75 - 50 * k / (steps.length - 1))}%)`);       // older steps lighter
    const curves = (key) => steps.map((s, k) => {
      const at = new Map(s.history.map((h) => [h.iteration, h[key]]));
      return { label: `step ${s.step}`, color: colour(k), key, step: k,
               values: iterations.map((it) => (at.has(it) ? at.get(it) : null)) };
    });
    chart(during, { name: "training-psnr", title: `${what} PSNR during training`, xlabel: "iteration",
                    ylabel: "PSNR (dB)", xs: iterations, integerX: true, series: curves(p), format: db });
    chart(during, { name: "training-ssim", title: `${what} SSIM during training`, xlabel: "iteration",
                    ylabel: "SSIM", xs: iterations, integerX: true, series: curves(q), y: ssimRange, format: ratio });

    // over the timesteps: a point per step
    const series = heading("Over the timesteps");
    const xs = steps.map((s) => s.step);
    const per = (pairs) => pairs.map(([label, key, dash], k) => ({ label, key, dash, color: COLORS[k],
                                                                     values: steps.map((s) => s[key]) }));
    const views = (prefix) => per(fg ? [["orbit", `${prefix}_foreground`], ["close-ups 2x", `${prefix}_foreground_near2`],
                                        ["close-ups 3x", `${prefix}_foreground_near3`],
                                        ["off the orbit", `${prefix}_foreground_off`]]
                                     : [["held-out", prefix]]);
    // the standard files in their light, each beside their bound (the trained model's image blurred as viewers blur)
    const files = (prefix) => per([["bound", `bound_${prefix}_foreground`], ["model.spz", `spz_${prefix}_foreground`],
                                   ["model.ply", `ply_${prefix}_foreground`]]);
    const common = { xlabel: "timestep", xs, integerX: true, ticksAtX: true };
    // the step's seeds before any training, on the orbit's views, beside where training took them
    const seeds = fg ? per([["seeds, orbit", "psnr_foreground_initial", [6, 4]]]).map((s) => ({ ...s, color: COLORS[4] }))
                     : [];
    chart(series, { ...common, name: "series-psnr", title: `${what} PSNR per timestep`, ylabel: "PSNR (dB)",
                    series: [...views("psnr"), ...seeds], format: db });
    chart(series, { ...common, name: "series-ssim", title: `${what} SSIM per timestep`, ylabel: "SSIM",
                    series: views("ssim"), y: ssimRange, format: ratio });
    chart(series, { ...common, name: "series-files", title: "Standard files: surface PSNR per timestep",
                    ylabel: "PSNR (dB)", series: files("psnr"), format: db });
    chart(series, { ...common, name: "series-files-ssim", title: "Standard files: surface SSIM per timestep",
                    ylabel: "SSIM", series: files("ssim"), y: ssimRange, format: ratio });
    // the seeds dashed, with smaller points, over the trained count: both seen where training kept the count
    chart(series, { ...common, name: "series-gaussians", title: "Gaussians per timestep", ylabel: "Gaussians",
                    series: per([["trained", "gaussians"], ["initial", "gaussians_initial", [6, 4]],
                                 ["model.ply", "ply_gaussians"]]) });
    chart(series, { ...common, name: "series-iterations", title: "Iterations per timestep", ylabel: "iterations",
                    series: per([["iterations", "iterations"]]) });
    // seconds: one stacked bar per step, a part per stage (its own seconds in the legend); drawn from the top
    // part down, each bar from 0 to the sum of the parts below it and its own
    const stages = Object.keys(steps[0].stages);
    const sums = steps.map((s) => { let t = 0; return stages.map((n) => (t += s.stages[n] || 0)); });
    const bars = stages.map((n, j) => ({ label: n, color: COLORS[j % COLORS.length], shown: steps.map((s) => s.stages[n]),
                                         values: sums.map((c) => c[j]) }))
      .filter((b) => b.shown.some(finite)).reverse();
    chart(series, { ...common, name: "series-seconds", title: "Seconds per timestep, by stage", ylabel: "seconds",
                    series: bars, bars: true, y: { zero: true }, format: (v) => (finite(v) ? v.toFixed(2) : "--") });
    chart(series, { ...common, name: "series-bytes", title: "Bytes written per timestep", ylabel: "bytes",
                    series: per([["written", "bytes_written"]]), y: { zero: true } });
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
