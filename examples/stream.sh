#!/usr/bin/env bash
# In transit: the simulation streams through ADIOS2 SST; the analysis reads steps as they come,
# as P reader ranks (each its own SST reader, so the writer waits for P readers).
# Usage: examples/stream.sh [P]
set -euo pipefail
cd "$(dirname "$0")/.."                 # the repository's root: the paths below are relative to it
[ -d .venv/bin ] && export PATH="$PWD/.venv/bin:$PATH"   # the environment `make` creates (python, mpiexec, insitu)
P=${1:-1}
python -m insitu_sims.gray_scott --L 64 --steps 600 --plotgap 200 --engine SST --output gs_stream \
    --sst-readers "$P" --sst-policy Block &
sim=$!
mpiexec -n "$P" insitu stream gs_stream --var V --iso 0.3 --views 64 --resolution 128 --iterations 300 \
    --timeout 120 --out stream_out
wait "$sim"
