"""The report in a real browser: headless Chromium (software WebGL) driven over the Chrome DevTools
protocol. The CPU demo's output is served with ``insitu view``; the viewer's camera is set to a
held-out view, the canvas is screenshot and compared with that view's ground truth, and the timestep
slider must switch the model. Other tests compare the canvas with the project's rasterizer on the same
model, and screenshot the plots of made-up runs' reports (opened as files): nothing drawn outside its
axes, the axes fitted to the data, the training curves ending at the final figures, a point per step.

Skipped, with the reason, only when no Chromium is installed (``.ci/run`` installs the Debian
package ``chromium``) or websocket-client is missing (the ``test`` extra has it).
"""
import base64
import io
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, insitu, subprocess_env
from PIL import Image

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# the CPU demo as `make demo` runs it (two analysed steps) with half its views and a sixth of its iterations: its
# held-out views still score far above what the viewer test asks
RUN = ["demo", "--device", "cpu", "--quiet", "--set", "output.images=2", "--set", "train.iterations=100",
       "--set", "series.warm_iterations=50", "--set", "views.count=24"]


def find_browser() -> str | None:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    return None


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) / 255 - b.astype(np.float64) / 255) ** 2)
    return float("inf") if mse == 0 else float(-10 * np.log10(mse))


class DevTools:
    """A minimal Chrome DevTools protocol client for one page (commands in order, events kept)."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=120, suppress_origin=True)
        self.next_id = 0
        self.log: list[str] = []

    def send(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            if msg.get("method") == "Runtime.consoleAPICalled":
                self.log.append(" ".join(str(a.get("value", a.get("description", ""))) for a in msg["params"]["args"]))
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.log.append("exception: " + json.dumps(msg["params"]["exceptionDetails"])[:500])

    def eval(self, expression: str, timeout: float = 120):
        r = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True,
                      timeout=timeout * 1000)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:80]}...: {r['exceptionDetails']}\nconsole: {self.log[-20:]}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 180):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.eval(expression):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{expression} not true after {timeout} s; console: {self.log[-20:]}")

    def canvas_png(self) -> np.ndarray:
        """Screenshot of the viewer's canvas, in CSS pixels (device scale factor 1)."""
        rect = self.eval("(() => { const r = insituViewer.canvas.getBoundingClientRect();"
                         " return [r.x + scrollX, r.y + scrollY, r.width, r.height]; })()")
        shot = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": rect[0], "y": rect[1], "width": rect[2], "height": rect[3], "scale": 1})
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB"))

    def close(self):
        self.ws.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    path = find_browser()
    if path is None:
        pytest.skip("no Chromium installed (looked for " + ", ".join(BROWSERS) + "); .ci/run installs it")
    pytest.importorskip("websocket", reason="websocket-client is not installed (pip install '.[test]')")
    profile = tmp_path_factory.mktemp("chromium")
    proc = subprocess.Popen(
        [path, "--headless=new", "--no-sandbox", "--disable-gpu-sandbox", "--use-angle=swiftshader",
         "--enable-unsafe-swiftshader", "--ignore-gpu-blocklist", "--no-first-run", "--no-default-browser-check",
         "--disable-dev-shm-usage", "--remote-debugging-port=0", f"--user-data-dir={profile}",
         "--window-size=1000,1000", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        endpoint, seen = None, []
        t0 = time.monotonic()
        while endpoint is None and time.monotonic() - t0 < 60:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            if m := re.search(r"DevTools listening on ws://([\d.]+:\d+)/", line):
                endpoint = m.group(1)
        assert endpoint, f"Chromium did not start its DevTools endpoint: {''.join(seen)[-2000:]}"
        with urllib.request.urlopen(f"http://{endpoint}/json/list") as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        dt = DevTools(pages[0]["webSocketDebuggerUrl"])
        dt.send("Runtime.enable")
        dt.send("Page.enable")
        dt.send("Emulation.setDeviceMetricsOverride", width=1000, height=1000, deviceScaleFactor=1, mobile=False)
        # no scrollbars: a full-page screenshot (captureBeyondViewport) drops them, which would widen the page
        # between reading where a chart lies and taking its picture (the charts follow the page's width)
        dt.send("Emulation.setScrollbarsHidden", hidden=True)
        yield dt
        dt.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo's output folder (RUN), served by ``insitu view`` on a free port: (out, base URL)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    r = insitu(*RUN, "--out", out, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    server = subprocess.Popen([sys.executable, "-m", "insitu", "view", str(out), "--port", "0"], env=subprocess_env(),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = server.stdout.readline()
        m = re.search(r"(http://localhost:\d+/[A-Za-z0-9_-]+/)report\.html", line)     # the token's prefix
        assert m, f"insitu view printed {line!r}"
        yield out, m.group(1)
    finally:
        server.terminate()
        server.wait(timeout=20)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Three steps of random Gaussians (SH degree 1; step 5 a lit model's) with orbit cameras, served in this process: (out, URL, views)."""
    import threading

    import torch

    from insitu.groundtruth.views import orbit_views
    from insitu.output.export import StepWriter
    from insitu.output.report import make_server
    from insitu.surface.gaussians import Gaussians, rgb_to_sh0
    from test_report import random_gaussians

    out = tmp_path_factory.mktemp("synthetic") / "out"
    views = orbit_views([-5, -5, -5], [5, 5, 5], 16, 96)
    writer = StepWriter(out)
    for step in (0, 5, 10, 15):
        g = random_gaussians(300, 1, seed=step, extent=4.0)
        g.log_scales -= 1.0
        metrics = {"psnr": 20.0}
        if step == 10:                            # trained with a smaller blur than standard viewers add
            metrics["eps2d"] = 0.05
        if step == 15:                            # trained antialiased: the blur keeps each splat's integral
            g.log_scales -= 1.5                   # splats under a pixel, where the two modes differ
            metrics["eps2d"], metrics["antialiased"] = 0.3, True
        if step == 5:                             # a lit model: base colours (degree 0), shaded by the viewer
            g.log_scales[:, 2] -= 2.0             # discs, as training makes them
            base = torch.rand(len(g), 3, generator=torch.Generator().manual_seed(5)) * 0.7 + 0.2
            g = Gaussians(g.means, g.log_scales, g.quats, g.opacity_logits, rgb_to_sh0(base)[:, None, :],
                          torch.zeros(len(g), 0, 3))
            metrics["color_model"] = "lit"
        writer.write(step, g, [("view_000", torch.zeros(96, 96, 3), torch.zeros(96, 96, 3))], metrics, None,
                     cameras=views)
    server = make_server(out, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield out, server.url(""), views
    finally:
        server.shutdown()
        server.server_close()


def test_viewer_draws_what_the_rasterizer_draws(browser, synthetic):
    """The viewer's canvas at an orbit camera against the project's rasterizer on the same (decoded)
    model: checks the camera mapping, the SPZ encoding (SH included) and the render settings together,
    the blur the model was trained with (step 10's metrics: ``eps2d`` 0.05) included."""
    from insitu.render.rendering import rasterize
    out, base, views = synthetic
    dt = browser
    g, quats = open_step(dt, base, out, 2, "step_000010")
    assert dt.eval("insituViewer.state().blur") == pytest.approx([0.05, 0.0])
    for view_id in (0, 5, 11):
        shot = show_view(dt, view_id)
        ids = [view_id]
        ours = {}
        for eps2d in (0.05, 0.3):
            rgb, _, _ = rasterize(g.means, quats, g.scales, g.opacities, g.sh, views.viewmats[ids], views.Ks[ids],
                                  96, 96, sh_degree=1, backend="torch", eps2d=eps2d)
            ours[eps2d] = (rgb[0].clamp(0, 1).numpy() * 255 + 0.5).astype(np.uint8)
        value, standard = psnr(shot, ours[0.05]), psnr(shot, ours[0.3])
        print(f"viewer vs rasterizer, view {view_id}: {value:.2f} dB (with the standard blur: {standard:.2f})")
        assert value >= 35.0 and value > standard + 1, (view_id, value, standard, dt.log[-20:])
        mirrored = psnr(shot[:, ::-1], ours[0.05])             # a mirrored camera would not pass
        assert mirrored < value - 5, (view_id, value, mirrored)
    select_step(dt, 0, "step_000000/model.spz")
    assert dt.eval("insituViewer.state().blur") == pytest.approx([0.3, 0.0])    # no eps2d: the standard blur


def test_viewer_draws_an_antialiased_model_as_the_rasterizer_does(browser, synthetic):
    """A step trained antialiased (step 15: ``eps2d`` 0.3, ``antialiased``): the viewer adds the blur with
    Spark's opacity-scaling ``blurAmount``, and its canvas matches the rasterizer's antialiased render of
    the model, not its classic one."""
    from insitu.render.rendering import rasterize
    out, base, views = synthetic
    dt = browser
    g, quats = open_step(dt, base, out, 3, "step_000015")
    assert dt.eval("insituViewer.state().blur") == pytest.approx([0.0, 0.3])
    for view_id in (0, 7):
        shot = show_view(dt, view_id)
        ours = {}
        for antialiased in (True, False):
            rgb, _, _ = rasterize(g.means, quats, g.scales, g.opacities, g.sh, views.viewmats[[view_id]],
                                  views.Ks[[view_id]], 96, 96, sh_degree=1, backend="torch", eps2d=0.3,
                                  antialiased=antialiased)
            ours[antialiased] = psnr(shot, (rgb[0].clamp(0, 1).numpy() * 255 + 0.5).astype(np.uint8))
        print(f"antialiased model, view {view_id}: viewer vs rasterizer {ours}")
        assert ours[True] >= 35.0 and ours[True] > ours[False] + 1, (view_id, ours, dt.log[-20:])


def test_viewer_shades_a_lit_model_with_the_headlight(browser, synthetic):
    """A lit model's step: the viewer shades each Gaussian's base colour with the headlight for its
    camera, as the lit colour model does (:func:`insitu.training.appearance.lit_colors`): its canvas against the
    rasterizer's render of those colours, and not the unshaded base colours."""
    import torch

    from insitu.render.lighting import HEADLIGHT, Headlight
    from insitu.render.rendering import rasterize
    from insitu.training.appearance import lit_colors
    out, base, views = synthetic
    dt = browser
    g, quats = open_step(dt, base, out, 1, "step_000005", "model.lit.spz")
    assert dt.eval("insituReport.data.steps[1].lighting.shininess") == 32
    flat = g.sh[:, 0] * 0.28209479177387814 + 0.5
    for view_id in (0, 6):
        shot = show_view(dt, view_id)
        ids = [view_id]
        campos = torch.linalg.inv(views.viewmats[ids])[:, :3, 3]
        rendered = {}
        for name, colors in (("lit", lit_colors(g.means, quats, flat, campos)), ("unshaded", flat[None])):
            rgb, _, _ = rasterize(g.means, quats, g.scales, g.opacities, colors, views.viewmats[ids], views.Ks[ids],
                                  96, 96, backend="torch")
            rendered[name] = psnr(shot, (rgb[0].clamp(0, 1).numpy() * 255 + 0.5).astype(np.uint8))
        print(f"lit model, view {view_id}: viewer vs rasterizer {rendered}")
        assert rendered["lit"] >= 45.0 and rendered["unshaded"] < rendered["lit"] - 5, (view_id, rendered,
                                                                                         dt.log[-20:])
    # the light controls: another light without retraining (the viewer's own sliders), then back as trained
    assert dt.eval("document.getElementById('light').hidden") is False
    ids = [0]
    campos = torch.linalg.inv(views.viewmats[ids])[:, :3, 3]

    def against(light):
        rgb, _, _ = rasterize(g.means, quats, g.scales, g.opacities, lit_colors(g.means, quats, flat, campos, light),
                              views.viewmats[ids], views.Ks[ids], 96, 96, backend="torch")
        return psnr(shot, (rgb[0].clamp(0, 1).numpy() * 255 + 0.5).astype(np.uint8))
    dull = Headlight(ambient=0.4, diffuse=0.3, specular=0.0, shininess=8)
    got = dt.eval("insituViewer.setLight({ambient: 0.4, diffuse: 0.3, specular: 0, shininess: 8})")
    assert got == pytest.approx(dull.as_dict()), got
    assert float(dt.eval("document.getElementById('light-diffuse').value")) == pytest.approx(0.3)
    shot = show_view(dt, 0)
    assert against(dull) >= 30.0 and against(HEADLIGHT) < against(dull) - 5, (against(dull), against(HEADLIGHT))
    dt.eval("document.getElementById('light-reset').click()")
    shot = show_view(dt, 0)
    assert against(HEADLIGHT) >= 30.0, against(HEADLIGHT)


def ground_truth(out: Path, step_dir: str, name: str) -> np.ndarray:
    """The left half (ground truth) of a held-out image ``GT | render``."""
    image = np.asarray(Image.open(out / step_dir / "views" / f"{name}.png").convert("RGB"))
    w = (image.shape[1] - 2) // 2
    return image[:, :w]


def open_step(dt: DevTools, base: str, out: Path, index: int, step_dir: str, name: str = "model.spz"):
    """Open the report, move its slider to timestep ``index`` (``step_dir``), and return that step's model
    ``name`` as the viewer decodes it (``read_spz``) with its rotations normalised."""
    from insitu.output.webmodel import read_spz

    dt.send("Page.navigate", url=base + "report.html")
    dt.wait_for("window.insituViewer && window.insituViewer.ready === true")
    select_step(dt, index, f"{step_dir}/{name}")
    g = read_spz(out / step_dir / name)
    return g, g.quats / g.quats.norm(dim=1, keepdim=True)


def select_step(dt: DevTools, index: int, model: str) -> None:
    """Move the timestep slider to ``index`` and wait until the viewer shows ``model``."""
    dt.eval(f"(() => {{ const s = document.getElementById('slider'); s.value = '{index}';"
            " s.dispatchEvent(new Event('input')); })()")
    dt.wait_for(f"insituViewer.state().url === {json.dumps(model)}")


def show_view(dt: DevTools, view_id: int) -> np.ndarray:
    size = dt.eval(f"(async () => {{ const s = insituViewer.showView({view_id}); await insituViewer.frames(5);"
                   " return s; })()")
    time.sleep(1.0)                           # Spark sorts in a worker: let it finish, then render again
    dt.eval("insituViewer.frames(10)")
    image = dt.canvas_png()
    assert image.shape[:2] == (size["height"], size["width"]), image.shape
    return image


def test_viewer_renders_held_out_views_and_the_slider_switches_steps(browser, served):
    out, base = served
    dt = browser
    dt.send("Page.navigate", url=base + "report.html")
    dt.wait_for("window.insituViewer && window.insituViewer.ready === true")
    data = dt.eval("insituReport.data")
    steps = data["steps"]
    assert len(steps) == 2 and all(s["model"] for s in steps), steps
    assert dt.eval("insituViewer.state().url") == steps[-1]["model"]          # opens on the newest step
    names = {c["name"]: c for c in charts(dt)}
    assert set(TRAINING + SERIES) <= set(names), list(names)
    for k, s in enumerate(steps):                     # each training curve ends at its step's final figure
        assert last_point(names["training-psnr"], k) == [s["iterations"], s["psnr_foreground"]], k
    for chart in names.values():
        check_chart(dt, chart)

    results = {}
    for index in (1, 0):
        s = steps[index]
        if index == 0:                                                           # move the slider
            dt.eval("(() => { const s = document.getElementById('slider'); s.value = '0';"
                    " s.dispatchEvent(new Event('input')); })()")
            dt.wait_for(f"insituViewer.state().url === {json.dumps(s['model'])} && "
                        f"insituViewer.state().visible.join() === {json.dumps(s['model'])}")
            assert dt.eval("document.getElementById('step-label').textContent").startswith(f"step {s['step']} ")
            assert dt.eval("document.querySelector('#images img').getAttribute('src')").startswith(s["dir"])
        for image in s["images"]:
            view_id = int(image["name"].split("_")[1])
            shot = show_view(dt, view_id)
            gt = ground_truth(out, s["dir"], image["name"])
            results[(index, view_id)] = (psnr(shot, gt), shot)
            Image.fromarray(np.concatenate([gt, shot], axis=1)).save(out / f"browser_{s['dir']}_{image['name']}.png")
    summary = {k: round(v[0], 2) for k, v in results.items()}
    print("viewer vs ground truth, PSNR (dB):", summary)
    assert all(p >= 20.0 for p, _ in results.values()), (summary, dt.log[-20:])
    # the two steps' surfaces differ: the same camera shows different images
    (_, a), (_, b) = results[(1, 0)], results[(0, 0)]
    assert psnr(a, b) < min(results[(1, 0)][0], results[(0, 0)][0]), summary


# ---------------------------------------------------------------------------------------------- plots

TRAINING = ["training-psnr", "training-ssim"]
SERIES = ["series-psnr", "series-ssim", "series-files", "series-gaussians", "series-iterations", "series-seconds"]
BARS = {"series-seconds"}                       # stacked from 0
ZERO = BARS | {"series-bytes"}                  # y from 0

CHARTS = """insituReport.charts.map(({name, plot: u, ends}) => {
  const norm = (c) => { const x = document.createElement('canvas').getContext('2d'); x.fillStyle = c; return x.fillStyle; };
  const r = u.ctx.canvas.getBoundingClientRect(), root = u.root.getBoundingClientRect(), dpr = devicePixelRatio;
  return {name, ends, legend: [...u.root.querySelectorAll('.u-legend .u-value')].map((e) => e.textContent),
          canvas: [r.x + scrollX, r.y + scrollY, r.width, r.height],
          root: [root.x + scrollX, root.y + scrollY, root.width, root.height],
          plot: [u.bbox.left / dpr, u.bbox.top / dpr, u.bbox.width / dpr, u.bbox.height / dpr],
          x: [u.scales.x.min, u.scales.x.max], y: [u.scales.y.min, u.scales.y.max], data: u.data,
          colors: u.series.slice(1).map((s, i) => norm(s.stroke(u, i + 1))),
          pos: u.data.slice(1).map((ys) => ys.map((y, j) => y == null ? null :
                                                   [u.valToPos(u.data[0][j], 'x'), u.valToPos(y, 'y')]))};
})"""


def charts(dt: DevTools) -> list[dict]:
    """Every chart of the page (report.js's insituReport.charts): its name, the page rectangles of its canvas
    and its whole box, its plot area inside the canvas (CSS px), its scales' ranges, its data ([xs, *series]),
    its series' colours (#rrggbb) and where each point lies in the plot area."""
    return dt.eval(CHARTS)


def last_point(chart: dict, k: int) -> list[float]:
    """The last drawn point (x, y) of series ``k``."""
    xs, ys = chart["data"][0], chart["data"][k + 1]
    return [[x, y] for x, y in zip(xs, ys) if y is not None][-1]


def screenshot(dt: DevTools, rect) -> np.ndarray:
    shot = dt.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                   clip={"x": rect[0], "y": rect[1], "width": rect[2], "height": rect[3], "scale": 1})
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")).astype(np.int32)


def near(image: np.ndarray, color: str, tolerance: float) -> np.ndarray:
    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
    return np.linalg.norm(image - rgb, axis=-1) < tolerance


def check_chart(dt: DevTools, chart: dict) -> np.ndarray:
    """Screenshot ``chart``'s canvas: no pixel of a series' colour outside the plot area (1 px of
    antialiasing aside), and each point's colour where its series puts it (lines) or in each part of a bar
    (stacked bars) taller than 3 px. Checks that the axes fit the data: every value inside, the y range no wider
    than a quarter beyond the data's span (2% of a lone value's), the x range no wider than two of its steps
    or a tenth beyond it. Returns the screenshot."""
    name, image = chart["name"], screenshot(dt, chart["canvas"])
    left, top, width, height = chart["plot"]
    assert image.shape[:2] == (round(chart["canvas"][3]), round(chart["canvas"][2])), (name, image.shape)
    assert 0 <= left and left + width <= image.shape[1] and 0 <= top and top + height <= image.shape[0], name
    outside = np.ones(image.shape[:2], bool)
    outside[max(0, int(top) - 1):int(np.ceil(top + height)) + 1, max(0, int(left) - 1):int(np.ceil(left + width)) + 1] = False
    for color in chart["colors"]:
        spilled = near(image, color, 40) & outside
        assert not spilled.any(), (f"{name}: drawn outside the axes", color, np.argwhere(spilled)[:5].tolist())

    xs = chart["data"][0]
    ys = [y for series in chart["data"][1:] for y in series if y is not None]
    (x0, x1), (y0, y1) = chart["x"], chart["y"]
    assert x0 <= min(xs) and x1 >= max(xs) and y0 <= min(ys) and y1 >= max(ys), (name, chart["x"], chart["y"])
    gap = min(np.diff(sorted(set(xs)))) if len(set(xs)) > 1 else 1     # bars: 0.6 of it each side; lines: 3%
    assert x1 - x0 <= max(xs) - min(xs) + max(2 * gap, 0.1 * (max(xs) - min(xs))), (name, chart["x"], xs)
    lo, hi = (0.0, max(ys)) if name in ZERO else (min(ys), max(ys))
    assert y1 - y0 <= (1.25 * (hi - lo) if hi > lo else 0.04 * abs(hi)), (name, chart["y"], lo, hi)

    def color_at(x: float, y: float, color: str) -> bool:
        i, j = int(round(top + y)), int(round(left + x))
        return bool(near(image[i - 1:i + 2, j - 1:j + 2], color, 60).any())

    for k, (color, points) in enumerate(zip(chart["colors"], chart["pos"])):
        for j, point in enumerate(points):
            if point is None:
                continue
            if name not in BARS:                      # its colour, or that of a series drawn over it there
                over = [c for c, other in zip(chart["colors"], chart["pos"])
                        if other[j] is not None and np.hypot(*np.subtract(other[j], point)) < 4]
                assert any(color_at(*point, c) for c in over), (name, k, j, point, color)
            else:                                     # the part between the next series' top and this one's
                below = chart["pos"][k + 1][j][1] if k + 1 < len(chart["pos"]) else height
                if below - point[1] > 3:
                    assert color_at(point[0], (point[1] + below) / 2, color), (name, k, j, point, color)
    return image


def open_file(dt: DevTools, page: Path) -> list[dict]:
    dt.send("Page.navigate", url=page.as_uri())
    dt.wait_for("window.insituReport && insituReport.charts && insituReport.charts.length > 0", timeout=60)
    return charts(dt)


@pytest.fixture(scope="module")
def made_up(tmp_path_factory):
    """Two made-up runs' report pages (tests/test_report.made_up_run): four steps, the first of 300
    iterations, the others of 200 with one evaluation (warm steps), bytes written recorded; and one step
    without bytes written."""
    from test_report import made_up_run, step_metrics

    root = tmp_path_factory.mktemp("made_up")
    steps = {}
    for k, step in enumerate((0, 40, 80, 120)):
        m = step_metrics(step, k, iterations=300 if k == 0 else 200)
        m["history"] = m["history"][:3 if k == 0 else 1]
        steps[step] = m
    return made_up_run(root / "four", steps), made_up_run(root / "one", {7: step_metrics(7, 0, bytes_written=False)})


def test_plots_stay_inside_their_axes_and_show_every_step(browser, made_up):
    dt = browser
    page = made_up[0]
    found = {c["name"]: c for c in open_file(dt, page)}
    assert list(found) == TRAINING + SERIES + ["series-bytes"], list(found)
    boxes = [c["root"] for c in found.values()]
    for a, b in ((a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):      # charts side by side, not over
        assert a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[3] <= b[1] or b[1] + b[3] <= a[1], (a, b)
    for chart in found.values():
        check_chart(dt, chart)
    steps = dt.eval("insituReport.data.steps")
    for name, key in (("training-psnr", "psnr_foreground"), ("training-ssim", "ssim_foreground")):
        for k, s in enumerate(steps):                 # ends at the final figure, after the last evaluation
            assert last_point(found[name], k) == [s["iterations"], s[key]], (name, k)
    assert found["training-psnr"]["data"][0] == [0, 100, 200, 300]
    assert [len([y for y in ys if y is not None]) for ys in found["training-psnr"]["data"][1:]] == [4, 2, 2, 2]
    for name in SERIES + ["series-bytes"]:            # one point per step, in every series
        chart = found[name]
        assert chart["data"][0] == [0, 40, 80, 120], name
        assert all(y is not None for ys in chart["data"][1:] for y in ys), name
    assert len(found["series-psnr"]["data"]) == 1 + 4             # orbit, close-ups 2x and 3x, off the orbit
    assert len(found["series-files"]["data"]) == 1 + 3            # the bound, model.spz, model.ply
    assert found["series-bytes"]["data"][1] == [s["bytes_written"] for s in steps]
    seconds = found["series-seconds"]["data"]                      # stacked: the top is the step's seconds
    assert seconds[1] == pytest.approx([s["stages"]["writing"] + 110.0 + 11 * k for k, s in enumerate(steps)])


def test_plots_of_one_step_fit_its_figures(browser, made_up):
    """A run of one step: its axes around its single values (no SSIM axis from -0.5 to 1.5), its training
    curve from the first evaluation to the final figure; no bytes plot where none were recorded."""
    dt = browser
    found = {c["name"]: c for c in open_file(dt, made_up[1])}
    assert list(found) == TRAINING + SERIES, list(found)
    for chart in found.values():
        check_chart(dt, chart)
    ssim = found["series-ssim"]                       # orbit 0.93 ... 3x closer 0.8
    assert ssim["data"][:2] == [[7], [0.93]] and 0.75 < ssim["y"][0] < 0.8 and 0.93 < ssim["y"][1] <= 1, ssim["y"]
    iterations = found["series-iterations"]           # a lone value
    assert iterations["data"] == [[7], [300]] and 290 < iterations["y"][0] < 300 < iterations["y"][1] < 310
    # the screenshot check sees a bar that spills over the x axis, as the page's hand-drawn bars once did
    # (uPlot clips what it draws to the plot area: paint one past it)
    dt.eval("""(() => { const u = insituReport.charts.find((c) => c.name === 'series-seconds').plot;
                        u.ctx.fillStyle = u.series[1].stroke(u, 1);
                        u.ctx.fillRect(u.bbox.left + 10, u.bbox.top + u.bbox.height - 20, 12, 40); })()""")
    with pytest.raises(AssertionError, match="series-seconds: drawn outside the axes"):
        check_chart(dt, found["series-seconds"])
    assert found["training-psnr"]["data"][0][-1] == 300 and last_point(found["training-psnr"], 0) == [300, 31.17]


# ---------------------------------------------------------------------------------------------- page widths

LAYOUT = """(() => {
  const W = document.documentElement.clientWidth, out = [];
  const where = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.right, r.width]; };
  for (const e of document.querySelectorAll('body *')) {
    const [left, right, width] = where(e);
    if (width > 0 && (left < -0.5 || right > W + 0.5)) out.push(`${e.tagName}#${e.id}.${e.className}: ${left}..${right}`);
  }
  for (const root of document.querySelectorAll('.uplot')) {        // nothing of a chart outside its box
    const [l, r] = where(root);
    for (const e of root.querySelectorAll('*')) {
      const [left, right, width] = where(e);
      if (width > 0 && (left < l - 0.5 || right > r + 0.5)) out.push(`in ${root.parentNode.dataset.name}: ${e.className}`);
    }
  }
  return {W, scroll: document.documentElement.scrollWidth, outside: out};
})()"""


@pytest.mark.parametrize("width", [390, 1400])
def test_the_report_reads_right_on_a_phone_and_a_wide_screen(browser, served, width):
    """The demo's report at 390 px (a phone) and 1400 px wide: no sideways scrolling, no element outside the
    page's width nor any part of a chart outside its box; the charts fill the width (one column on the phone, three
    on the wide screen) and draw inside their axes; every series ends at its step's final figure (a training curve
    at its step's, a series over the timesteps at the newest step's) and its legend shows that figure without the
    pointer over it; the viewer's line names the one file it draws, its Gaussians and its size. Screenshots:
    report_WIDTH.png in the demo's folder."""
    out, base = served
    dt = browser
    dt.send("Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1, mobile=False)
    try:
        dt.send("Page.navigate", url=base + "report.html")
        dt.wait_for("window.insituViewer && window.insituViewer.ready === true && insituReport.charts.length > 0")
        dt.eval("insituViewer.frames(3)")
        layout = dt.eval(LAYOUT)
        assert layout["scroll"] <= layout["W"] and not layout["outside"], layout
        steps = dt.eval("insituReport.data.steps")
        found = charts(dt)
        assert {"series-files", "series-files-ssim"} <= {c["name"] for c in found}
        content = dt.eval("document.querySelector('#plots .charts').clientWidth")
        columns = {round(c["root"][0]) for c in found}
        assert len(columns) == (1 if width < 800 else 3), (width, columns)
        wide = (content - (len(columns) - 1) * 24) / len(columns) - 1           # 24 px apart (report.js's GAP)
        assert all(c["canvas"][2] >= wide for c in found), (content, wide, found[0]["canvas"])
        for chart in found:
            check_chart(dt, chart)
            legend = chart["legend"]
            for k, end in enumerate(chart["ends"]):
                if end is None:
                    continue
                s = steps[end["step"]]
                x = s["iterations"] if chart["name"].startswith("training") else s["step"]
                assert last_point(chart, k) == [x, s[end["key"]]], (chart["name"], k, end)
                assert legend[k + 1] not in ("", "--"), (chart["name"], legend)
                if "psnr" in end["key"] or "ssim" in end["key"]:          # dB to 2 decimals, SSIM to 4
                    assert float(legend[k + 1]) == pytest.approx(s[end["key"]], abs=0.006), (chart["name"], legend)
        shown = steps[-1]["shown"]
        line = dt.eval("document.getElementById('model-info').textContent")
        assert line.startswith(f"{shown['file']}: {shown['gaussians']:,} Gaussians, {shown['bytes'] / 1e6:.2f} MB"), line
        height = dt.eval("document.documentElement.scrollHeight")
        shot = dt.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                       clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        (out / f"report_{width}.png").write_bytes(base64.b64decode(shot["data"]))
    finally:
        dt.send("Emulation.setDeviceMetricsOverride", width=1000, height=1000, deviceScaleFactor=1, mobile=False)
