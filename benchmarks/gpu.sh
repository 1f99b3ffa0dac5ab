#!/usr/bin/env bash
# One-GPU throughput/MFU check of both reference recipes' models (experiment=gpt2_124m, llama_124m), bf16-mixed,
# torch.compile: model=small, then the same with the stability measurement read at the step itself, for the cost of
# that sync; then model=llama_small; then model=small's default recipe against experiment=fast, each 300 steps: their
# tokens/s, MFU, and the steps and time each takes to the default's final val loss. Extra args go to gpu.py.
# CPU form (tests/test_perf.py): python benchmarks/gpu.py --cpu [--to-loss].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} "$PY" benchmarks/gpu.py --compare-defer "$@"
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} "$PY" benchmarks/gpu.py model=llama_small "$@"
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} "$PY" benchmarks/gpu.py --to-loss --steps 300 "$@"
