#!/usr/bin/env bash
# Refresh the vendored report libraries from the npm registry (needs npm; run from anywhere):
#   insitu/output/viewer/vendor/update.sh [SPARK_VERSION] [THREE_VERSION] [UPLOT_VERSION]
# Spark (https://github.com/sparkjsdev/spark, MIT) renders the splats; it needs three.js
# (https://threejs.org, MIT) >= the version in its peerDependencies. uPlot
# (https://github.com/leeoniya/uPlot, MIT, no dependencies) draws the plots. Only the built files the
# report loads are kept, each with its package's licence; then rerun the browser test
# (tests/test_report_browser.py) and update the versions in docs/report.md.
set -euo pipefail
SPARK=${1:-2.2.0}
THREE=${2:-0.180.0}
UPLOT=${3:-1.6.32}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent "@sparkjsdev/spark@$SPARK" "three@$THREE" "uplot@$UPLOT" >/dev/null
mkdir spark three uplot
tar xzf sparkjsdev-spark-"$SPARK".tgz -C spark
tar xzf three-"$THREE".tgz -C three
tar xzf uplot-"$UPLOT".tgz -C uplot
rm -rf "$here/spark" "$here/three" "$here/uplot"
mkdir -p "$here/spark" "$here/three/addons/controls" "$here/three/addons/postprocessing" "$here/uplot"
cp spark/package/LICENSE spark/package/dist/spark.module.min.js "$here/spark/"
cp three/package/LICENSE three/package/build/three.module.min.js three/package/build/three.core.min.js "$here/three/"
cp three/package/examples/jsm/controls/OrbitControls.js "$here/three/addons/controls/"
cp three/package/examples/jsm/postprocessing/Pass.js "$here/three/addons/postprocessing/"
# uPlot's classic-script build: the plots work from a page opened as a plain file too (no modules there).
# Its stylesheet's rules are in ../report.css (the package data holds no vendored .css): compare them with
# uplot/package/dist/uPlot.min.css on an update.
cp uplot/package/LICENSE uplot/package/dist/uPlot.iife.min.js "$here/uplot/"
# the source-map comment points at a file that is not shipped
sed -i '/^\/\/# sourceMappingURL=/d' "$here/spark/spark.module.min.js"
printf 'spark %s\nthree %s\nuplot %s\n' "$SPARK" "$THREE" "$UPLOT" > "$here/VERSIONS"
echo "vendored @sparkjsdev/spark $SPARK, three $THREE and uplot $UPLOT into $here"
