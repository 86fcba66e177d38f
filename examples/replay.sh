#!/usr/bin/env bash
# Offline replay: a Gray-Scott run writes a BP5 file, then P ranks replay it step by step,
# each rank reading only its own block.   Usage: examples/replay.sh [P]
set -euo pipefail
cd "$(dirname "$0")/.."                 # the repository's root: the paths below are relative to it
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"   # the environment `make` creates (python, mpiexec, insitu)
P=${1:-2}
python -m insitu_sims.gray_scott --L 64 --steps 600 --plotgap 200 --engine BP5 --output gs.bp
mpiexec -n "$P" insitu replay gs.bp --var V --iso 0.3 --views 64 --resolution 128 --iterations 500 \
    --config examples/config.yaml --out replay_out
echo "open replay_out/report.html; each replay_out/step_*/model.ply opens in a 3DGS viewer"
