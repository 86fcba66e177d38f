#!/usr/bin/env bash
# Refresh the vendored viewer libraries from the npm registry (needs npm; run from anywhere):
#   insitu/output/viewer/vendor/update.sh [SPARK_VERSION] [THREE_VERSION]
# Spark (https://github.com/sparkjsdev/spark, MIT) renders the splats; it needs three.js
# (https://threejs.org, MIT) >= the version in its peerDependencies. Only the built files the
# report loads are kept, each with its package's licence; then rerun the browser test
# (tests/test_report_browser.py) and update the versions in README.md.
set -euo pipefail
SPARK=${1:-2.2.0}
THREE=${2:-0.180.0}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent "@sparkjsdev/spark@$SPARK" "three@$THREE" >/dev/null
mkdir spark three
tar xzf sparkjsdev-spark-"$SPARK".tgz -C spark
tar xzf three-"$THREE".tgz -C three
rm -rf "$here/spark" "$here/three"
mkdir -p "$here/spark" "$here/three/addons/controls" "$here/three/addons/postprocessing"
cp spark/package/LICENSE spark/package/dist/spark.module.min.js "$here/spark/"
cp three/package/LICENSE three/package/build/three.module.min.js three/package/build/three.core.min.js "$here/three/"
cp three/package/examples/jsm/controls/OrbitControls.js "$here/three/addons/controls/"
cp three/package/examples/jsm/postprocessing/Pass.js "$here/three/addons/postprocessing/"
# the source-map comment points at a file that is not shipped
sed -i '/^\/\/# sourceMappingURL=/d' "$here/spark/spark.module.min.js"
printf 'spark %s\nthree %s\n' "$SPARK" "$THREE" > "$here/VERSIONS"
echo "vendored @sparkjsdev/spark $SPARK and three $THREE into $here"
