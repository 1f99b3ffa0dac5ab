#!/usr/bin/env bash
# One-GPU throughput/MFU check: model=small, bf16-mixed, torch.compile; then the same with the stability
# probe read at the step itself, for the cost of that sync. Extra args go to benchmarks/gpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} "$PY" benchmarks/gpu.py --compare-defer "$@"
