// The report's 3D view: the selected step's model.lit.spz or model.spz, rendered by Spark (three.js).
// report.js owns the page state (the selected step); this module follows it through the
// "insitu-step" event. Cameras come converted from the project's convention by
// insitu.output.report.viewer_camera (position, look-at target, up, vertical fov, aspect).
// A lit model (metrics "color_model": "lit"; report data "lighting") holds each Gaussian's base
// colour; the viewer shades it with the ground truth's headlight, as training did: one colour per
// Gaussian per camera (headlightModifier). window.insituViewer is the interface the browser test drives.
import * as THREE from "three";
import { OrbitControls } from "three/addons/controls/OrbitControls.js";
import { SparkRenderer, SplatMesh, dyno } from "@sparkjsdev/spark";

const report = window.insituReport;
const box = document.getElementById("viewer");
const status = document.getElementById("viewer-status");
const cameraSelect = document.getElementById("camera");
const info = document.getElementById("model-info");
const KEEP = 6;                                   // models kept loaded (most recently used)

const renderer = new THREE.WebGLRenderer({ antialias: false });
renderer.setPixelRatio(window.devicePixelRatio || 1);
box.appendChild(renderer.domElement);
const scene = new THREE.Scene();
const camera = new THREE.PerspectiveCamera(40, 1, 0.01, 1000);
// As the training rasterizer: the step's blur (report data "eps2d", px^2) added to the 2D covariance,
// as gsplat's "classic" mode (Spark's preBlurAmount) or, for a step trained "antialiased", with the opacity
// scaled to keep each splat's integral (Spark's blurAmount); splats to 3 standard deviations, alphas
// below 1/255 dropped, sorted by view depth.
// Frames are drawn on demand: after a change, and when Spark has a new sort order (onDirty).
let dirty = 2;
const invalidate = () => { dirty = 2; };
const STANDARD_BLUR = 0.3;                        // what a model trained before the blur was recorded had
const spark = new SparkRenderer({ renderer, preBlurAmount: STANDARD_BLUR, blurAmount: 0.0, maxStdDev: 3.0,
                                  minAlpha: 1.0 / 255.0, sortRadial: false, onDirty: invalidate });
scene.add(spark);

// The headlight (insitu.render.lighting.Headlight): colour = clamp(base * (ambient + diffuse c +
// specular c^shininess), 0, 1), c = |n . v|, n the disc's normal (the local z axis of its rotation),
// v the unit direction from the Gaussian to the camera. `eye` follows the camera (world frame); the
// coefficients are uniforms too, so the light controls change them without retraining or reloading.
const eye = dyno.dynoVec3(new THREE.Vector3());
const LIGHT_KEYS = ["ambient", "diffuse", "specular", "shininess"];
const light = Object.fromEntries(LIGHT_KEYS.map((k) => [k, dyno.dynoFloat(0)]));
let lightSet = null;                              // the coefficients the user chose (null: the step's own)
let litShown = false;                             // the shown mesh is lit: a camera move regenerates it

function headlightModifier() {
  return dyno.dynoBlock({ gsplat: dyno.Gsplat }, { gsplat: dyno.Gsplat }, ({ gsplat }) => {
    const shade = new dyno.Dyno({
      inTypes: { gsplat: dyno.Gsplat, eye: "vec3", ambient: "float", diffuse: "float", specular: "float",
                 shininess: "float" },
      outTypes: { gsplat: dyno.Gsplat },
      globals: () => [dyno.unindent(`
        float insituHeadlight(vec4 q, vec3 center, vec3 eyePos, vec4 k) {
          q = normalize(q);                                        // (x, y, z, w)
          vec3 n = vec3(2.0 * (q.x * q.z + q.w * q.y), 2.0 * (q.y * q.z - q.w * q.x),
                        1.0 - 2.0 * (q.x * q.x + q.y * q.y));
          float c = clamp(abs(dot(normalize(n), normalize(eyePos - center))), 0.0, 1.0);
          return k.x + k.y * c + k.z * pow(c, k.w);               // ambient, diffuse, specular, shininess
        }
      `)],
      statements: ({ inputs, outputs }) => dyno.unindentLines(`
        ${outputs.gsplat} = ${inputs.gsplat};
        ${outputs.gsplat}.rgba.rgb = clamp(${inputs.gsplat}.rgba.rgb *
          insituHeadlight(${inputs.gsplat}.quaternion, ${inputs.gsplat}.center, ${inputs.eye},
                          vec4(${inputs.ambient}, ${inputs.diffuse}, ${inputs.specular}, ${inputs.shininess})),
          0.0, 1.0);
      `),
    });
    return { gsplat: shade.apply({ gsplat, eye, ...light }).gsplat };
  });
}

const lightPanel = document.getElementById("light");
const lightInputs = Object.fromEntries(LIGHT_KEYS.map((k) => [k, document.getElementById(`light-${k}`)]));

// Shade with `coeffs` ({ambient, diffuse, specular, shininess}); regenerate the shown lit model.
function applyLight(coeffs) {
  for (const k of LIGHT_KEYS) {
    if (coeffs[k] === undefined || !isFinite(Number(coeffs[k]))) continue;
    light[k].value = Number(coeffs[k]);
    if (lightInputs[k]) lightInputs[k].value = String(coeffs[k]);
  }
  if (litShown) shown.mesh.updateVersion();
  invalidate();
}

for (const k of LIGHT_KEYS) {
  if (!lightInputs[k]) continue;
  lightInputs[k].addEventListener("input", () => {
    lightSet = Object.fromEntries(LIGHT_KEYS.map((j) => [j, Number(lightInputs[j].value)]));
    applyLight(lightSet);
  });
}
// The light the user chooses: {ambient, diffuse, specular, shininess} (missing keys: as now); null: the
// shown step's own. Returns the coefficients in use.
function setLight(coeffs) {
  const step = report.data.steps[current.index];
  lightSet = coeffs ? { ...Object.fromEntries(LIGHT_KEYS.map((k) => [k, light[k].value])), ...coeffs } : null;
  applyLight(lightSet || (step && step.lighting) || {});
  return Object.fromEntries(LIGHT_KEYS.map((k) => [k, light[k].value]));
}
const lightReset = document.getElementById("light-reset");
if (lightReset) lightReset.addEventListener("click", () => setLight(null));

let controls = null;
let fixedSize = null;                             // [W, H] while showing an exact orbit view
let shown = null;                                 // {index, url, mesh}
const meshes = new Map();                         // url -> {mesh, ready}
const camerasByUrl = new Map();                   // url -> Promise of cameras.json
let current = { index: -1, cameras: null, viewId: null };
let token = 0;

function say(text) {
  status.textContent = text;
  status.hidden = !text;
}

function resize() {
  let w, h;
  if (fixedSize) {
    [w, h] = fixedSize;
    renderer.setPixelRatio(1);
  } else {
    w = Math.max(1, box.clientWidth);
    h = Math.max(1, box.clientHeight);
    renderer.setPixelRatio(window.devicePixelRatio || 1);
  }
  renderer.setSize(w, h, true);
  camera.aspect = fixedSize && current.aspect ? current.aspect : w / h;
  camera.updateProjectionMatrix();
  invalidate();
}
new ResizeObserver(() => { if (!fixedSize) resize(); }).observe(box);

// Place the camera: cam = {position, target, up, fov, aspect} (insitu.output.report.viewer_camera).
// exact: [W, H] renders at that many pixels with the camera's own aspect, as the orbit view.
function setCamera(cam, exact = null) {
  fixedSize = exact;
  current.aspect = cam.aspect;
  camera.position.fromArray(cam.position);
  camera.up.fromArray(cam.up);
  camera.fov = cam.fov;
  const distance = camera.position.distanceTo(new THREE.Vector3().fromArray(cam.target));
  camera.near = distance * 1e-3;
  camera.far = distance * 1e3;
  camera.lookAt(new THREE.Vector3().fromArray(cam.target));
  if (controls) controls.dispose();
  controls = new OrbitControls(camera, renderer.domElement);    // orbits about target, around cam.up
  controls.target.fromArray(cam.target);
  controls.enableDamping = false;
  controls.addEventListener("change", invalidate);
  controls.update();
  resize();
}

function loadCameras(url) {
  if (!camerasByUrl.has(url)) {
    camerasByUrl.set(url, fetch(url, { cache: "no-cache" }).then((r) => {
      if (!r.ok) throw new Error(`${url}: ${r.status} ${r.statusText}`);
      return r.json();
    }));
  }
  return camerasByUrl.get(url);
}

function loadMesh(url, lighting) {
  let entry = meshes.get(url);
  if (!entry) {
    const mesh = new SplatMesh({ url });
    if (lighting) {
      mesh.worldModifier = headlightModifier();
      mesh.updateGenerator();
    }
    mesh.visible = false;
    scene.add(mesh);
    entry = { mesh, ready: mesh.initialized, lit: Boolean(lighting) };
    meshes.set(url, entry);
  }
  meshes.delete(url);                              // most recently used last
  meshes.set(url, entry);
  while (meshes.size > KEEP) {
    const [oldUrl, old] = meshes.entries().next().value;
    if (shown && shown.url === oldUrl) break;
    meshes.delete(oldUrl);
    scene.remove(old.mesh);
    old.mesh.dispose();
  }
  return entry;
}

// SPZ files hold SPZ's axes (x right, y up, z back): the mesh turns them back by 180 degrees about x into the
// step's frame, where the cameras are.
function placeModel(mesh) {
  mesh.quaternion.set(1, 0, 0, 0);
}

function fillCameras(cams) {
  const keep = cameraSelect.value;
  cameraSelect.textContent = "";
  for (const v of cams.views) {
    const option = document.createElement("option");
    option.value = String(v.id);
    option.textContent = `${v.name}${v.test ? " (held out)" : ""}`;
    cameraSelect.appendChild(option);
  }
  const first = cams.views.find((v) => v.test) || cams.views[0];
  cameraSelect.value = cams.views.some((v) => String(v.id) === keep) ? keep : String(first.id);
}

function viewById(id) {
  return current.cameras && current.cameras.views.find((v) => v.id === Number(id));
}

// Show step number `index` of report.data.steps; resolves once its model is loaded and visible.
async function show(index) {
  const mine = ++token;
  const step = report.data.steps[index];
  if (!step) return;
  if (!step.model) {
    say(`step ${step.step}: no model.spz or model.lit.spz in this folder`);
    return;
  }
  say(shown ? "" : `loading step ${step.step}...`);
  const entry = loadMesh(step.model, step.lighting);
  const cams = step.cameras ? await loadCameras(step.cameras).catch(() => null) : null;
  await entry.ready;
  if (mine !== token) return;                       // a later step was asked for meanwhile
  placeModel(entry.mesh);
  const firstCamera = current.cameras === null;
  current.index = index;
  if (cams) {
    current.cameras = cams;
    fillCameras(cams);
  }
  for (const e of meshes.values()) e.mesh.visible = e === entry;
  shown = { index, url: step.model, mesh: entry.mesh };
  litShown = entry.lit;
  if (lightPanel) lightPanel.hidden = !entry.lit;
  if (entry.lit) applyLight(lightSet || step.lighting);  // and shaded for this eye, not the last one it had
  const blur = typeof step.eps2d === "number" ? step.eps2d : STANDARD_BLUR;
  spark.preBlurAmount = step.antialiased ? 0.0 : blur;
  spark.blurAmount = step.antialiased ? blur : 0.0;
  const bg = step.background || [0, 0, 0];
  scene.background = new THREE.Color().setRGB(bg[0], bg[1], bg[2], THREE.SRGBColorSpace);
  if (firstCamera && cams) setCamera(viewById(cameraSelect.value).camera);
  info.textContent = modelInfo(step.shown, entry.lit);
  say("");
  invalidate();
}

// What the view draws, all of one file: its name, its Gaussians and its size (report.shown_model).
function modelInfo(shown, lit) {
  if (!shown) return "";
  const count = shown.gaussians != null ? `${shown.gaussians.toLocaleString("en-US")} Gaussians` : "";
  const size = shown.bytes != null ? `${(shown.bytes / 1e6).toFixed(2)} MB` : "";
  return `${shown.file}: ${[count, size].filter(Boolean).join(", ")}${lit ? ", lit by a headlight" : ""}`;
}

cameraSelect.addEventListener("change", () => {
  const v = viewById(cameraSelect.value);
  if (v) setCamera(v.camera);
});
document.getElementById("reset").addEventListener("click", () => {
  const v = viewById(cameraSelect.value);
  if (v) setCamera(v.camera);
});
document.addEventListener("insitu-step", (event) => { show(event.detail.index).catch(fail); });

function fail(error) {
  console.error(error);
  say(`3D viewer: ${error && error.message ? error.message : error}`);
}

function nextFrame() {
  return new Promise((resolve) => requestAnimationFrame(() => resolve()));
}

renderer.setAnimationLoop(() => {
  if (dirty > 0) {
    dirty -= 1;
    if (litShown && !eye.value.equals(camera.position)) {     // the headlight moved with the camera
      eye.value.copy(camera.position);
      shown.mesh.updateVersion();
      dirty = Math.max(dirty, 2);
    }
    renderer.render(scene, camera);
  }
});

window.insituViewer = {
  show,
  setCamera,
  // the camera of orbit view `id` of the shown step, at its own size in pixels
  showView(id) {
    const v = viewById(id);
    if (!v) throw new Error(`no orbit camera ${id} in this step`);
    cameraSelect.value = String(v.id);
    setCamera(v.camera, [current.cameras.width, current.cameras.height]);
    return { width: current.cameras.width, height: current.cameras.height };
  },
  setLight,                                         // the light of a lit model (see setLight above)
  async frames(n = 2) {
    invalidate();
    for (let i = 0; i < n; i++) await nextFrame();
  },
  state() {
    return { index: current.index, url: shown ? shown.url : null,
             visible: [...meshes.entries()].filter(([, e]) => e.mesh.visible).map(([u]) => u),
             canvas: [renderer.domElement.width, renderer.domElement.height],
             blur: [spark.preBlurAmount, spark.blurAmount] };
  },
  canvas: renderer.domElement,
};

resize();
if (report && report.data.steps.length) {
  show(report.index).then(() => { window.insituViewer.ready = true; }).catch(fail);
} else {
  say("no steps yet");
  window.insituViewer.ready = true;
}
