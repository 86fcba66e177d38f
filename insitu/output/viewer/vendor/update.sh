#!/usr/bin/env bash
# Refresh the vendored report libraries from the npm registry (needs npm; run from anywhere):
#   insitu/output/viewer/vendor/update.sh [SPARK_VERSION] [THREE_VERSION] [UPLOT_VERSION] [PLAYCANVAS_VERSION]
# Spark (https://github.com/sparkjsdev/spark, MIT) renders the splats; it needs three.js
# (https://threejs.org, MIT) >= the version in its peerDependencies. uPlot
# (https://github.com/leeoniya/uPlot, MIT, no dependencies) draws the plots. PlayCanvas
# (https://github.com/playcanvas/engine, MIT, no dependencies) draws model.glb in ../gltf.html with its own glTF
# loader (KHR_gaussian_splatting). Only the built files the pages load are kept, each with its package's licence;
# then rerun the browser tests (tests/test_report_browser.py, tests/test_gltf.py) and update the versions in
# docs/report.md and docs/model.md.
set -euo pipefail
SPARK=${1:-2.2.0}
THREE=${2:-0.180.0}
UPLOT=${3:-1.6.32}
PLAYCANVAS=${4:-2.23.3}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent "@sparkjsdev/spark@$SPARK" "three@$THREE" "uplot@$UPLOT" "playcanvas@$PLAYCANVAS" >/dev/null
mkdir spark three uplot playcanvas
tar xzf sparkjsdev-spark-"$SPARK".tgz -C spark
tar xzf three-"$THREE".tgz -C three
tar xzf uplot-"$UPLOT".tgz -C uplot
tar xzf playcanvas-"$PLAYCANVAS".tgz -C playcanvas
rm -rf "$here/spark" "$here/three" "$here/uplot" "$here/playcanvas"
mkdir -p "$here/spark" "$here/three/addons/controls" "$here/three/addons/postprocessing" "$here/uplot" \
    "$here/playcanvas"
cp spark/package/LICENSE spark/package/dist/spark.module.min.js "$here/spark/"
cp three/package/LICENSE three/package/build/three.module.min.js three/package/build/three.core.min.js "$here/three/"
cp three/package/examples/jsm/controls/OrbitControls.js "$here/three/addons/controls/"
cp three/package/examples/jsm/postprocessing/Pass.js "$here/three/addons/postprocessing/"
# uPlot's classic-script build: the plots work from a page opened as a plain file too (no modules there).
# Its stylesheet's rules are in ../report.css (the package data holds no vendored .css): compare them with
# uplot/package/dist/uPlot.min.css on an update.
cp uplot/package/LICENSE uplot/package/dist/uPlot.iife.min.js "$here/uplot/"
# PlayCanvas's minified ES module build, one file without imports (2.5 MB: the only npm glTF splat viewer found
# that draws a model antialiased, as model.glb is made to be drawn, in WebGL2; docs/model.md)
cp playcanvas/package/LICENSE playcanvas/package/build/playcanvas.min.mjs "$here/playcanvas/"
# the source-map comment points at a file that is not shipped
sed -i '/^\/\/# sourceMappingURL=/d' "$here/spark/spark.module.min.js"
printf 'spark %s\nthree %s\nuplot %s\nplaycanvas %s\n' "$SPARK" "$THREE" "$UPLOT" "$PLAYCANVAS" > "$here/VERSIONS"
echo "vendored @sparkjsdev/spark $SPARK, three $THREE, uplot $UPLOT and playcanvas $PLAYCANVAS into $here"
