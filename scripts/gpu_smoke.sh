#!/usr/bin/env bash
# GPU smoke test (not part of the test suite) on one CUDA machine, offline is fine:
# doctor's speculators probes on cuda, the full tiny recipe with train.device=cuda
# (flex attention + fused losses), eval on cuda, and a test-suite subset. Figures go
# to WORKDIR/gpu_smoke.json (and --out DIR). Runs from this checkout without
# `make install`: python + torch are enough when the other wheels are carried
# (docs/GPU_SMOKE.md; default folder .gpu/wheels).
#
#   scripts/gpu_smoke.sh [--check] [--wheels DIR] [--out DIR] [--steps doctor,run,eval,tests]
#                        [--budget SECONDS] [WORKDIR]      # WORKDIR is created if missing
#
# --check: wheels, imports, workdir and the plan only (no GPU needed).
# Exit 0 ok, 1 a step failed, 2 usage/setup error, 3 no CUDA GPU visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/gpu_smoke.py "$@"
