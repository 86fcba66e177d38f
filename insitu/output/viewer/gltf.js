// A step's model.glb (glTF 2.0 with KHR_gaussian_splatting; insitu.output.gltf) as a glTF viewer draws it:
// PlayCanvas's own glTF loader and splat renderer (vendor/playcanvas, from npm), nothing of ours in between.
//   gltf.html?model=../step_000120/model.glb[&view=N][&aa=0|1][&cameras=URL]
// The model is drawn antialiased (each splat's opacity scaled to keep its integral as the 0.3 px^2 blur widens it)
// when the file's asset extras say so, as it was made to be drawn (aa= overrides). The camera starts at the step's
// held-out view N (default the first) of cameras.json beside the model: those cameras are in the step's frame with
// +Z up, the file's scene in world units with glTF's +Y up, so each is moved by the frame (world = origin +
// scale * x) and turned as the file is (toGltf). Drag turns about the target, the wheel moves in and out.
// window.insituGltf is the interface the browser test drives (tests/test_gltf.py).
import * as pc from "./vendor/playcanvas/playcanvas.min.mjs";

const params = new URLSearchParams(location.search);
const status = document.getElementById("status");
const canvas = document.getElementById("canvas");
const toGltf = ([x, y, z]) => [x, z, -y];         // the data's +Z up -> glTF's +Y up (insitu.output.gltf.TO_GLTF)

const app = new pc.Application(canvas, {
  graphicsDeviceOptions: { antialias: false, preserveDrawingBuffer: true, deviceTypes: ["webgl2"] } });
app.setCanvasFillMode(pc.FILLMODE_NONE);
const camera = new pc.Entity("camera");
camera.addComponent("camera", { clearColor: new pc.Color(0, 0, 0, 1), fov: 40 });
app.root.addChild(camera);

const state = { ready: false, error: null, antialiased: null, count: 0, views: [], fixed: null };
window.insituGltf = {
  get ready() { return state.ready; },
  get error() { return state.error; },
  get antialiased() { return state.antialiased; },
  get count() { return state.count; },
  canvas,
  showView,
  frames: (n) => new Promise((done) => {
    let k = 0;
    const tick = () => { if (++k >= n) { app.off("frameend", tick); done(); } };
    app.on("frameend", tick);
  }),
};

function size(width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  app.setCanvasResolution(pc.RESOLUTION_FIXED, Math.round(width * ratio), Math.round(height * ratio));
}

function clip(distance) {                         // any unit: the planes follow the distance to the target
  camera.camera.nearClip = distance / 1000;
  camera.camera.farClip = distance * 1000;
}

// turning about a target with +Y up: yaw about it, pitch above the horizon
const orbit = { target: new pc.Vec3(), distance: 1, yaw: 0, pitch: 0 };
function orbitFrom(position, target) {
  const d = new pc.Vec3().sub2(position, target);
  orbit.target.copy(target);
  orbit.distance = d.length();
  orbit.yaw = Math.atan2(d.x, d.z);
  orbit.pitch = Math.asin(Math.max(-1, Math.min(1, d.y / orbit.distance)));
}
function place() {
  const { target: t, distance: r, yaw, pitch } = orbit;
  camera.setPosition(t.x + r * Math.cos(pitch) * Math.sin(yaw), t.y + r * Math.sin(pitch),
                     t.z + r * Math.cos(pitch) * Math.cos(yaw));
  camera.lookAt(t, pc.Vec3.UP);
  clip(r);
}

// The step's view `id` (cameras.json's id) at its own size: the same pixels as its held-out image.
function showView(id) {
  const view = state.views.find((v) => v.id === id);
  if (!view) throw new Error(`no view ${id} in cameras.json`);
  const { origin, scale } = state.frame;
  const scene = (p) => toGltf(p.map((v, i) => origin[i] + scale * v));
  const c = view.camera;
  const position = new pc.Vec3(...scene(c.position)), target = new pc.Vec3(...scene(c.target));
  state.fixed = { width: state.width, height: state.height };
  size(state.width, state.height);
  camera.camera.fov = c.fov;                      // vertical, degrees
  camera.camera.horizontalFov = false;
  camera.camera.aspectRatioMode = pc.ASPECT_MANUAL;
  camera.camera.aspectRatio = c.aspect;
  camera.setPosition(position);
  camera.lookAt(target, new pc.Vec3(...toGltf(c.up)));
  orbitFrom(position, target);
  clip(orbit.distance);
  return { width: state.width, height: state.height };
}

function fitWindow() {
  if (state.fixed) return;
  size(window.innerWidth, window.innerHeight);
  camera.camera.aspectRatioMode = pc.ASPECT_AUTO;
  camera.camera.horizontalFov = window.innerWidth < window.innerHeight;   // a narrow window: the fov across it
}

function controls() {
  let last = null;
  canvas.addEventListener("pointerdown", (e) => {
    last = [e.clientX, e.clientY];
    canvas.setPointerCapture(e.pointerId);
  });
  canvas.addEventListener("pointerup", () => { last = null; });
  canvas.addEventListener("pointermove", (e) => {
    if (!last) return;
    orbit.yaw -= 0.01 * (e.clientX - last[0]);
    orbit.pitch = Math.max(-1.55, Math.min(1.55, orbit.pitch + 0.01 * (e.clientY - last[1])));
    last = [e.clientX, e.clientY];
    place();
  });
  canvas.addEventListener("wheel", (e) => {
    e.preventDefault();
    orbit.distance *= Math.exp(0.001 * e.deltaY);
    place();
  }, { passive: false });
  window.addEventListener("resize", fitWindow);
}

// the glb's JSON chunk (its header: magic "glTF", version 2; then the chunk's length and type "JSON")
function glbJson(bytes) {
  const head = new DataView(bytes);
  if (bytes.byteLength < 20 || head.getUint32(0, true) !== 0x46546c67 || head.getUint32(16, true) !== 0x4e4f534a) {
    throw new Error("not a glTF binary (.glb) file");
  }
  return JSON.parse(new TextDecoder().decode(new Uint8Array(bytes, 20, head.getUint32(12, true))));
}

async function load() {
  const url = params.get("model");
  if (!url) throw new Error("give the model in the address: gltf.html?model=../step_000120/model.glb");
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: ${response.status} ${response.statusText}`);
  const bytes = await response.arrayBuffer();
  const gltf = glbJson(bytes);
  const aa = params.get("aa");
  state.antialiased = aa === null ? Boolean(gltf.asset?.extras?.antialiased) : aa === "1";
  app.scene.gsplat.antiAlias = state.antialiased;
  const primitive = gltf.meshes?.[0]?.primitives?.[0];
  state.count = primitive ? gltf.accessors[primitive.attributes.POSITION].count : 0;

  const where = params.get("cameras") || new URL("cameras.json", new URL(url, location.href)).href;
  const cameras = await fetch(where).then((r) => (r.ok ? r.json() : null)).catch(() => null);
  if (cameras) {
    Object.assign(state, { views: cameras.views, frame: cameras.frame, width: cameras.width, height: cameras.height });
  }

  const asset = new pc.Asset("model", "container",
                             { url: URL.createObjectURL(new Blob([bytes])), filename: "model.glb" });
  await new Promise((done, fail) => {
    asset.ready(done);
    asset.on("error", (e) => fail(new Error(`PlayCanvas could not load ${url}: ${e}`)));
    app.assets.add(asset);
    app.assets.load(asset);
  });
  app.root.addChild(asset.resource.instantiateRenderEntity());
  app.start();
  fitWindow();
  if (state.views.length) {
    const wanted = params.get("view");
    const first = state.views.find((v) => v.test) || state.views[0];
    showView(wanted === null ? first.id : Number(wanted));
    state.fixed = null;                            // the user's window: the view's camera, the window's size
    fitWindow();
  } else if (primitive) {                         // no cameras: the model's box (POSITION's bounds, by the node)
    const { min, max } = gltf.accessors[primitive.attributes.POSITION];
    const node = gltf.nodes.find((n) => n.mesh === 0) || {};
    const s = (node.scale || [1, 1, 1])[0], t = node.translation || [0, 0, 0];
    orbit.target.set(...min.map((lo, i) => t[i] + s * 0.5 * (lo + max[i])));
    orbit.distance = 3 * s * Math.hypot(...min.map((lo, i) => 0.5 * (max[i] - lo))) || 1;
    place();
  }
  controls();
  status.textContent = `${url}: ${state.count} Gaussians, drawn ${state.antialiased ? "antialiased" : "classic"} by ` +
    `PlayCanvas ${pc.version}; drag to turn, wheel to zoom`;
  state.ready = true;
}

load().catch((e) => { state.error = String(e.message || e); status.textContent = `error: ${state.error}`; });
